//! A context's chunk memory in the pager: the engine's [`ChunkMemory`] over userfaultfd slots.
//!
//! Chunks are read in place through a [`ContextLock`] held while the memory is pinned (a call
//! runs on the context); unpinned, the pager may reclaim any chunk and `get` answers `None`.
//! Every store bumps the chunk's version in the [`ChunkBook`], so the AoT writer marks a chunk
//! written out only if the bytes it wrote are still the chunk's bytes.

use std::sync::Arc;

use uffd_pager::{ChunkKey, ContextId, ContextLock, Pager, PagerError};

use model::kv::{ChunkMemory, KvError};

use crate::chunks::ChunkBook;

/// One context's sealed chunks in the pager's slots.
pub struct PagerChunks {
    pager: Arc<Pager>,
    ctx: ContextId,
    book: Arc<ChunkBook>,
    lock: Option<ContextLock>,
}

impl PagerChunks {
    /// The chunks of pager context `ctx` (already added to the pager).
    pub fn new(pager: Arc<Pager>, ctx: ContextId, book: Arc<ChunkBook>) -> Self {
        Self {
            pager,
            ctx,
            book,
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
        self.lock.as_ref()?.chunk(index as u32).ok()
    }

    fn put(&mut self, index: usize, bytes: &[u8]) -> Result<(), KvError> {
        let key = self.key(index);
        let book = Arc::clone(&self.book);
        book.change(key, || self.store(index, bytes))
    }

    /// Drops a chunk from memory (through the context's lock while pinned).
    fn reclaim(&mut self, index: usize) -> Result<(), KvError> {
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
