//! A context's chunk memory in the pager: the engine's [`ChunkMemory`] over userfaultfd slots.
//!
//! Chunks are read in place through a [`ContextLock`] held while the memory is pinned (a call
//! runs on the context); unpinned, the pager may reclaim any chunk and `get` answers `None`.
//! Every store bumps the chunk's version in the [`ChunkBook`], so the AoT writer marks a chunk
//! written out only if the bytes it wrote are still the chunk's bytes.
//!
//! A context's first chunks may be borrowed from shared prefixes ([`Lineage`]): they live in the
//! prefixes' regions, read through their locks, which pinning takes beside the context's own, so
//! every context that borrows a chunk reads the one resident copy.

use std::sync::Arc;

use parking_lot::Mutex;
use uffd_pager::{ChunkKey, ContextId, ContextLock, Pager, PagerError};

use model::kv::{ChunkMemory, KvError};

use crate::chunks::ChunkBook;
use crate::lineage::Lineage;

/// One context's sealed chunks in the pager's slots.
pub struct PagerChunks {
    pager: Arc<Pager>,
    ctx: ContextId,
    book: Arc<ChunkBook>,
    /// Who holds which chunk, as the manager last set it (it changes only while unpinned).
    lineage: Arc<Mutex<Lineage>>,
    /// The lineage as of the last pin or change: reads use it without a lock.
    view: Lineage,
    lock: Option<ContextLock>,
    /// While pinned, a lock on each shared prefix, with the end of the chunks it lends.
    prefixes: Vec<(u32, ContextLock)>,
}

impl PagerChunks {
    /// The chunks of pager context `ctx` (already added to the pager, as are the prefixes its
    /// lineage borrows from).
    pub fn new(
        pager: Arc<Pager>,
        ctx: ContextId,
        book: Arc<ChunkBook>,
        lineage: Arc<Mutex<Lineage>>,
    ) -> Self {
        let view = lineage.lock().clone();
        Self {
            pager,
            ctx,
            book,
            lineage,
            view,
            lock: None,
            prefixes: Vec::new(),
        }
    }

    fn key(&mut self, index: usize) -> ChunkKey {
        if self.lock.is_none() {
            self.view = self.lineage.lock().clone();
        }
        self.view.key(index as u32)
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
        let locked = if key.ctx == self.ctx {
            self.lock.is_some()
        } else {
            self.prefixes.iter().any(|(_, l)| l.context() == key.ctx)
        };
        if resident && locked && bytes.len() <= info.bytes {
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
            ChunkMemory::reclaim(self, index)?;
        }
        self.pager
            .populate(key, bytes.len(), bytes)
            .map_err(|e| store_err(index, e))
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
        let i = index as u32;
        if i >= self.view.shared() {
            return self.lock.as_ref()?.chunk(i).ok();
        }
        let (_, lock) = self.prefixes.iter().find(|(end, _)| i < *end)?;
        lock.chunk(i).ok()
    }

    fn put(&mut self, index: usize, bytes: &[u8]) -> Result<(), KvError> {
        let key = self.key(index);
        let book = Arc::clone(&self.book);
        book.change(key, || self.store(index, bytes))
    }

    /// Drops a chunk from memory (through the lock of its holder while pinned).
    fn reclaim(&mut self, index: usize) -> Result<(), KvError> {
        let key = self.key(index);
        let lock = if key.ctx == self.ctx {
            self.lock.as_mut()
        } else {
            (self.prefixes.iter_mut())
                .find(|(_, l)| l.context() == key.ctx)
                .map(|(_, l)| l)
        };
        let r = match lock {
            Some(lock) => lock.reclaim(key.index),
            None => self.pager.reclaim(key),
        };
        match r {
            Ok(_) | Err(PagerError::NotResident { .. }) => Ok(()),
            Err(e) => Err(store_err(index, e)),
        }
    }

    /// Drops the context's own chunks from `chunks` on (borrowed ones are the prefixes').
    fn truncate(&mut self, chunks: usize) -> Result<(), KvError> {
        let max = self
            .pager
            .context_chunks(self.ctx)
            .map_err(|e| store_err(chunks, e))?;
        let own = (self.lineage.lock().shared() as usize).max(chunks);
        for i in own..max as usize {
            let key = self.key(i);
            let info = self.pager.chunk_info(key);
            if info.is_ok_and(|i| {
                matches!(
                    i.state,
                    uffd_pager::MemoryState::Resident | uffd_pager::MemoryState::ZeroMapped
                )
            }) {
                ChunkMemory::reclaim(self, i)?;
            }
        }
        Ok(())
    }

    fn resident_bytes(&self) -> usize {
        self.pager.context_resident(self.ctx).unwrap_or(0) as usize
    }

    /// Locks the context and every prefix it borrows from; the borrowed chunks resident are
    /// told to the victim chooser as used, so a prefix many contexts read stays resident.
    fn pin(&mut self) -> Result<(), KvError> {
        if self.lock.is_some() {
            return Ok(());
        }
        self.view = self.lineage.lock().clone();
        let mut prefixes = Vec::new();
        for (range, p) in self.view.ranges() {
            let lock = self.pager.lock(p).map_err(|e| store_err(0, e))?;
            for index in range.clone() {
                let key = ChunkKey { ctx: p, index };
                let info = self.pager.chunk_info(key);
                if info.is_ok_and(|s| s.state == uffd_pager::MemoryState::Resident) {
                    self.pager.note_access(key);
                }
            }
            prefixes.push((range.end, lock));
        }
        self.lock = Some(self.pager.lock(self.ctx).map_err(|e| store_err(0, e))?);
        self.prefixes = prefixes;
        Ok(())
    }

    fn unpin(&mut self) {
        self.lock = None;
        self.prefixes.clear();
    }
}
