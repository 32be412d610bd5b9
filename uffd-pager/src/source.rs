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
    /// the pager reclaims it ("sync reclaim": the reclaim waits for this write). `data` is the
    /// chunk's slot (page-rounded). Return `Ok(true)` when the chunk is now stored and can come
    /// back by `fill`, `Ok(false)` when this source does not keep such chunks (the default: the
    /// chunk is given up and must be recomputed), or an error (given up too).
    ///
    /// Called with the pager's state lock held, from the thread that needed room (an API call
    /// or the fault thread): it must not call back into the pager.
    fn write_back(&self, key: ChunkKey, data: &[u8]) -> Result<bool, SourceError> {
        let _ = (key, data);
        Ok(false)
    }
}
