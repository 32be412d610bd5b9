//! uffd-pager: KV chunk slots in userfaultfd-managed memory under a hard resident-byte budget.
//!
//! The crate knows nothing of models or of kvfs.
//! It reserves one region of virtual memory per context, with one page-aligned slot per chunk,
//! registers the regions with userfaultfd (MISSING mode), and keeps the bytes of resident chunks
//! under a budget.
//! The engine plugs in three things: a [`ChunkSource`] that fills a chunk's bytes on a fault or a
//! load, a [`VictimChooser`] that picks chunks to reclaim when a populate needs room, and it drains
//! the recompute queue ([`Pager::drain_recompute`]) of chunks that could not be read.
//! See `docs/uffd.md` for the flows and the kernel's caveats.

pub mod bench;
mod fault;
mod pager;
pub mod ring;
mod shared;
mod source;
mod staging;
mod stats;
pub mod sys;
pub mod testing;
mod types;
mod victim;

pub use pager::{ContextLock, Pager};
pub use ring::{Read, ReadRing};
pub use source::{ChunkSource, SourceError};
pub use staging::Staging;
pub use stats::{Histogram, HistogramSummary, Sample, Stats, StatsSnapshot, median};
pub use types::{
    ChunkInfo, ContextSpec, MemoryState, PagerConfig, PagerError, PopulateVia, RecomputeReason,
    RecomputeRequest,
};
pub use victim::{Candidate, LruChooser, ResidentView, VictimChooser};

/// A context's id, as the engine numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContextId(pub u64);

/// A chunk: its context and its index (chunk `i` holds tokens `16 i .. 16 i + 15`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey {
    /// The context the chunk belongs to.
    pub ctx: ContextId,
    /// The chunk's index in its context.
    pub index: u32,
}

impl ChunkKey {
    /// The key of chunk `index` of context `ctx`.
    pub const fn new(ctx: u64, index: u32) -> ChunkKey {
        ChunkKey {
            ctx: ContextId(ctx),
            index,
        }
    }
}

impl std::fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ctx {} chunk {}", self.ctx.0, self.index)
    }
}
