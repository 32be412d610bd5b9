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
}
