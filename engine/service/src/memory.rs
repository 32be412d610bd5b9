//! A context's chunk memory in the pager: the engine's [`ChunkMemory`] over userfaultfd slots.
//!
//! Chunks are read in place through a [`ContextLock`] held while the memory is pinned (a call
//! runs on the context); unpinned, the pager may reclaim any chunk and `get` answers `None`.
//! Every store bumps the chunk's version, so the AoT writer marks a chunk written out only if
//! the bytes it wrote are still the chunk's bytes.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use uffd_pager::{ChunkKey, ContextId, ContextLock, Pager, PagerError};

use model::kv::{ChunkMemory, KvError};

/// Per chunk, a counter bumped whenever its bytes change in memory.
#[derive(Debug, Default)]
pub struct Versions {
    map: Mutex<HashMap<ChunkKey, u64>>,
}

impl Versions {
    /// The chunk's current version.
    pub fn get(&self, key: ChunkKey) -> u64 {
        *self.map.lock().get(&key).unwrap_or(&0)
    }

    fn bump(&self, key: ChunkKey) {
        *self.map.lock().entry(key).or_insert(0) += 1;
    }

    /// Runs `f` if the chunk is still at `version`, with the versions held so no store can
    /// change the chunk meanwhile.
    pub fn if_current(&self, key: ChunkKey, version: u64, f: impl FnOnce()) -> bool {
        let map = self.map.lock();
        let current = *map.get(&key).unwrap_or(&0) == version;
        if current {
            f();
        }
        current
    }

    /// Forgets every chunk of `ctx`.
    pub fn forget(&self, ctx: ContextId) {
        self.map.lock().retain(|k, _| k.ctx != ctx);
    }
}

/// One context's sealed chunks in the pager's slots.
pub struct PagerChunks {
    pager: Arc<Pager>,
    ctx: ContextId,
    versions: Arc<Versions>,
    lock: Option<ContextLock>,
}

impl PagerChunks {
    /// The chunks of pager context `ctx` (already added to the pager).
    pub fn new(pager: Arc<Pager>, ctx: ContextId, versions: Arc<Versions>) -> Self {
        Self {
            pager,
            ctx,
            versions,
            lock: None,
        }
    }

    fn key(&self, index: usize) -> ChunkKey {
        ChunkKey {
            ctx: self.ctx,
            index: index as u32,
        }
    }
}

fn store_err(index: usize, e: PagerError) -> KvError {
    match e {
        PagerError::BudgetExhausted { .. } | PagerError::LargerThanBudget { .. } => {
            KvError::OverBudget {
                index,
                reason: e.to_string(),
            }
        }
        e => KvError::Store {
            index,
            reason: e.to_string(),
        },
    }
}

impl ChunkMemory for PagerChunks {
    fn get(&self, index: usize) -> Option<&[u8]> {
        self.lock.as_ref()?.chunk(index as u32).ok()
    }

    fn put(&mut self, index: usize, bytes: &[u8]) -> Result<(), KvError> {
        let key = self.key(index);
        self.versions.bump(key);
        let info = self
            .pager
            .chunk_info(key)
            .map_err(|e| store_err(index, e))?;
        let resident = info.state == uffd_pager::ChunkState::Resident;
        if resident && self.lock.is_some() && bytes.len() <= info.bytes {
            // Rewrite in place (recompute, recompress), then give back the pages past the end.
            self.pager
                .write(key, 0, bytes)
                .map_err(|e| store_err(index, e))?;
            self.pager
                .shrink(key, bytes.len())
                .map_err(|e| store_err(index, e))?;
            if info.needs_recompute {
                self.pager
                    .mark_recomputed(key)
                    .map_err(|e| store_err(index, e))?;
            }
            return Ok(());
        }
        if resident || info.state == uffd_pager::ChunkState::ZeroMapped {
            self.evict(index)?;
        }
        self.pager
            .populate(key, bytes.len(), bytes)
            .map_err(|e| store_err(index, e))
    }

    fn evict(&mut self, index: usize) -> Result<(), KvError> {
        let key = self.key(index);
        let r = match &mut self.lock {
            Some(lock) => lock.reclaim(key.index),
            None => self.pager.reclaim(key),
        };
        match r {
            Ok(_) | Err(PagerError::NotResident { .. }) => Ok(()),
            Err(e) => Err(store_err(index, e)),
        }
    }

    fn truncate(&mut self, chunks: usize) -> Result<(), KvError> {
        let max = self
            .pager
            .context_chunks(self.ctx)
            .map_err(|e| store_err(chunks, e))?;
        for i in chunks..max as usize {
            let info = self.pager.chunk_info(self.key(i));
            if info.is_ok_and(|i| {
                matches!(
                    i.state,
                    uffd_pager::ChunkState::Resident | uffd_pager::ChunkState::ZeroMapped
                )
            }) {
                self.evict(i)?;
            }
        }
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        self.pager.context_resident(self.ctx).unwrap_or(0) as usize
    }

    fn pin(&mut self) -> Result<(), KvError> {
        if self.lock.is_none() {
            self.lock = Some(self.pager.lock(self.ctx).map_err(|e| store_err(0, e))?);
        }
        Ok(())
    }

    fn unpin(&mut self) {
        self.lock = None;
    }
}
