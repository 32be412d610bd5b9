//! A context's chunk memory in the pager: the engine's [`ChunkMemory`] over userfaultfd slots.
//!
//! Chunks are read in place through a [`ContextLock`] held while the memory is pinned (a call
//! runs on the context); unpinned, the pager may reclaim any chunk and `get` answers `None`.
//! Every store bumps the chunk's version, so the AoT writer marks a chunk written out only if
//! the bytes it wrote are still the chunk's bytes.

use std::collections::HashMap;
use std::sync::Arc;

use uffd_pager::{ChunkKey, ContextId, ContextLock, Pager, PagerError};

use model::kv::{ChunkMemory, KvError};

use crate::sync::{Primitives, Std};

/// Per chunk, a counter bumped whenever its bytes change in memory, so that the AoT writer marks
/// a chunk persisted only if the bytes it wrote are still the chunk's.
///
/// The protocol: a change of a chunk's bytes goes through [`Versions::change`], which bumps the
/// version *before* the bytes change and leaves the chunk unpersisted (the pager's `write`,
/// `shrink` and `populate` all do); the writer marks a chunk persisted only inside
/// [`Versions::if_current`], under the same lock. So a write-out of the old bytes that completes
/// while the chunk changes either marks it before the bump (and the change then unmarks it) or
/// finds the version moved and marks nothing: the new bytes are never taken as persisted.
/// Generic over its [`Primitives`] for the shuttle model of this (`engine/service/tests/models.rs`).
pub struct Versions<S: Primitives = Std> {
    map: S::Mutex<HashMap<ChunkKey, u64>>,
}

impl<S: Primitives> Default for Versions<S> {
    fn default() -> Self {
        Self {
            map: S::mutex(HashMap::new()),
        }
    }
}

impl<S: Primitives> std::fmt::Debug for Versions<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Versions").finish_non_exhaustive()
    }
}

impl<S: Primitives> Versions<S> {
    /// The chunk's current version.
    pub fn get(&self, key: ChunkKey) -> u64 {
        *S::lock(&self.map).get(&key).unwrap_or(&0)
    }

    /// Changes the chunk's bytes: bumps its version, then runs `change`, which must leave the
    /// chunk unpersisted.
    pub fn change<R>(&self, key: ChunkKey, change: impl FnOnce() -> R) -> R {
        *S::lock(&self.map).entry(key).or_insert(0) += 1;
        change()
    }

    /// Runs `f` if the chunk is still at `version`, with the versions held so no change can
    /// begin meanwhile.
    pub fn if_current(&self, key: ChunkKey, version: u64, f: impl FnOnce()) -> bool {
        let map = S::lock(&self.map);
        let current = *map.get(&key).unwrap_or(&0) == version;
        if current {
            f();
        }
        current
    }

    /// Forgets every chunk of `ctx`.
    pub fn forget(&self, ctx: ContextId) {
        S::lock(&self.map).retain(|k, _| k.ctx != ctx);
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

    /// Stores chunk `index`'s new bytes (its version already bumped): in place when it is
    /// resident, pinned and the bytes fit (recompute, recompress), else in a new slot. Either
    /// way the chunk ends unpersisted (`Pager::write` and `Pager::populate` see to it).
    fn store(&mut self, index: usize, bytes: &[u8]) -> Result<(), KvError> {
        let key = self.key(index);
        let info = self
            .pager
            .chunk_info(key)
            .map_err(|e| store_err(index, e))?;
        let resident = info.state == uffd_pager::MemoryState::Resident;
        if resident && self.lock.is_some() && bytes.len() <= info.bytes {
            // Rewrite in place, then give back the pages past the end.
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
        if resident || info.state == uffd_pager::MemoryState::ZeroMapped {
            self.reclaim(key)?;
        }
        self.pager
            .populate(key, bytes.len(), bytes)
            .map_err(|e| store_err(index, e))
    }

    /// Drops a chunk from memory (through the context's lock while pinned).
    fn reclaim(&mut self, key: ChunkKey) -> Result<(), KvError> {
        let r = match &mut self.lock {
            Some(lock) => lock.reclaim(key.index),
            None => self.pager.reclaim(key),
        };
        match r {
            Ok(_) | Err(PagerError::NotResident { .. }) => Ok(()),
            Err(e) => Err(store_err(key.index as usize, e)),
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
        let versions = Arc::clone(&self.versions);
        versions.change(key, || self.store(index, bytes))
    }

    fn evict(&mut self, index: usize) -> Result<(), KvError> {
        self.reclaim(self.key(index))
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
                    uffd_pager::MemoryState::Resident | uffd_pager::MemoryState::ZeroMapped
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
