//! The `ChunkSource` trait: where a non-resident chunk's bytes come from (kvfs, in the engine).

use crate::ChunkKey;
use thiserror::Error;

/// Why a source could not fill a chunk; the pager zero-fills the chunk and queues it for recompute.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SourceError {
    /// The chunk was never written out (or was deleted).
    #[error("{key} is not in the store")]
    Missing { key: ChunkKey },
    /// The stored chunk failed a check (checksum, header, size).
    #[error("{key} is corrupt: {detail}")]
    Corrupt { key: ChunkKey, detail: String },
    /// Reading failed.
    #[error("reading {key} failed: {detail}")]
    Io { key: ChunkKey, detail: String },
    /// The read did not finish in time.
    #[error("reading {key} timed out after {millis} ms")]
    Timeout { key: ChunkKey, millis: u64 },
    /// The source panicked; the pager caught it.
    #[error("the chunk source panicked while reading {key}")]
    Panicked { key: ChunkKey },
}

/// Fills chunks with their bytes. Called from the fault thread and from `Pager::load`, so it must
/// not wait on the engine, and it is called with no pager lock held.
pub trait ChunkSource: Send + Sync {
    /// Fill all of `dst` (the chunk's slot, `dst.len()` bytes, page-rounded) with `key`'s bytes,
    /// or fail with a classified error.
    fn fill(&self, key: ChunkKey, dst: &mut [u8]) -> Result<(), SourceError>;

    /// Write a resident chunk that was never written out to where `fill` will find it, before
    /// the pager reclaims it ("sync reclaim": the victim goes once this write ends). `data` is
    /// the chunk's slot (page-rounded). Return `Ok(true)` when the chunk is now stored and can
    /// come back by `fill`, `Ok(false)` when it cannot (it is given up and must be recomputed),
    /// or an error (given up too). Only called when [`ChunkSource::writes_back`] says so.
    ///
    /// Called with no pager lock held, from the thread that needed room (an API call) or from
    /// the pager's write-back thread (for the fault thread, which never writes a victim itself);
    /// the chunk's context cannot be locked, so nothing writes the slot, until this returns. It
    /// may take as long as a disk write takes; one that outlasts the pager's `source_deadline`
    /// stops the pager.
    fn write_back(&self, key: ChunkKey, data: &[u8]) -> Result<bool, SourceError> {
        let _ = (key, data);
        Ok(false)
    }

    /// Whether [`ChunkSource::write_back`] keeps victims (the default: no, and a victim never
    /// written out is dropped at once). A source that answers `true` has its unwritten victims
    /// written back first, outside the pager's lock.
    fn writes_back(&self) -> bool {
        false
    }
}
