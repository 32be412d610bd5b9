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

/// The ids of contexts and chunks, shared with the store and the service.
pub use ids::{ChunkKey, ContextId};
