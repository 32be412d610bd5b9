//! The pager's public vocabulary: its errors, settings, a context's shape and what it knows of a chunk.

use std::time::Duration;

use thiserror::Error;

use crate::sys::SysError;
use crate::{ChunkKey, ContextId, SourceError};

/// Errors of the pager's primitives, each with the chunk or context it concerns.
#[derive(Debug, Error)]
pub enum PagerError {
    #[error("the pager is shut down")]
    ShutDown,
    #[error("setting up the pager failed: {source}")]
    Setup { source: SysError },
    #[error("context {ctx} already exists", ctx = .ctx.0)]
    ContextExists { ctx: ContextId },
    #[error("context {ctx} does not exist", ctx = .ctx.0)]
    NoContext { ctx: ContextId },
    #[error("{key} is beyond its context's {max_chunks} chunks")]
    NoChunk { key: ChunkKey, max_chunks: u32 },
    #[error("{key}: slot of {bytes} bytes exceeds the context's slot size {slot_max}")]
    SlotTooLarge {
        key: ChunkKey,
        bytes: usize,
        slot_max: usize,
    },
    #[error("{key}: a {bytes}-byte chunk can never fit the budget of {budget} bytes")]
    LargerThanBudget {
        key: ChunkKey,
        bytes: u64,
        budget: u64,
    },
    #[error(
        "{key}: needs {need} bytes but {resident} of {budget} are resident and nothing can be \
         reclaimed (every resident chunk is locked or busy); unlock a context or raise the budget"
    )]
    BudgetExhausted {
        key: ChunkKey,
        need: u64,
        resident: u64,
        budget: u64,
    },
    #[error("context {ctx} is locked by a running call", ctx = .ctx.0)]
    Locked { ctx: ContextId },
    #[error("context {ctx} must be locked for this access", ctx = .ctx.0)]
    NotLocked { ctx: ContextId },
    #[error("context {ctx} is not locked", ctx = .ctx.0)]
    NotLockedUnlock { ctx: ContextId },
    #[error("{key} is being populated by another thread")]
    Busy { key: ChunkKey },
    #[error("{key} is already resident; write it in place")]
    AlreadyResident { key: ChunkKey },
    #[error("{key} is not resident")]
    NotResident { key: ChunkKey },
    #[error("{key} holds zeros and must be recomputed before use")]
    NeedsRecompute { key: ChunkKey },
    #[error("{key}: the chunk source failed: {source}")]
    Source { key: ChunkKey, source: SourceError },
    #[error("{key}: populating failed: {source}")]
    Populate { key: ChunkKey, source: SysError },
    #[error("{key}: reclaiming failed: {source}")]
    Reclaim { key: ChunkKey, source: SysError },
    #[error("{key}: {len} bytes at offset {offset} fall outside the {bytes}-byte chunk")]
    OutOfRange {
        key: ChunkKey,
        offset: usize,
        len: usize,
        bytes: usize,
    },
    #[error("{key}: UFFDIO_MOVE needs a staging buffer of whole pages, got {len} bytes")]
    StagingTooSmall { key: ChunkKey, len: usize },
}

/// How `populate` puts bytes into a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PopulateVia {
    /// UFFDIO_COPY: the kernel copies from the buffer into fresh pages.
    Copy,
    /// UFFDIO_MOVE (Linux 6.8+): the staging buffer's pages are remapped into the slot, no copy;
    /// the staging buffer is left empty and refaults on its next write.
    Move,
}

/// The pager's settings.
#[derive(Debug, Clone)]
pub struct PagerConfig {
    /// Hard limit on resident chunk bytes (page-rounded), across all contexts.
    pub budget_bytes: u64,
    /// The largest slot any context may ask for (sizes the fault thread's buffers).
    pub max_slot_bytes: usize,
    /// How the fault thread populates: `Copy` (the default: UFFDIO_COPY from a warm buffer, the
    /// best throughput), or `Move` (UFFDIO_MOVE from a buffer it warms up again while idle: lower
    /// latency for isolated faults, more CPU in bursts). `Move` falls back to `Copy` on kernels
    /// without UFFDIO_MOVE.
    pub fault_via: PopulateVia,
    /// Fail-stop for a source that never returns: if one fill on the fault thread, or one
    /// victim's write-back on any thread, takes longer, a watchdog stops the pager, which
    /// releases every faulting thread (`check` then reports `ShutDown`). `None` trusts the
    /// source to bound its own reads and writes.
    pub source_deadline: Option<Duration>,
}

impl PagerConfig {
    /// A budget and a largest slot, faults resolved by copy.
    pub fn new(budget_bytes: u64, max_slot_bytes: usize) -> PagerConfig {
        PagerConfig {
            budget_bytes,
            max_slot_bytes,
            fault_via: PopulateVia::Copy,
            source_deadline: Some(Duration::from_secs(10)),
        }
    }
}

/// The shape of one context's region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextSpec {
    /// The most chunks the context can hold (its maximum length in chunks).
    pub max_chunks: u32,
    /// The largest slot of any format (bytes; page-rounded by the pager).
    pub max_slot_bytes: usize,
}

/// Where a chunk is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum MemoryState {
    /// Never populated.
    Absent,
    /// Being populated right now (by the fault thread or an API call).
    Populating,
    /// Its bytes are in memory and counted against the budget.
    Resident,
    /// Mapped to the shared zero page because the budget was exhausted at fault time; costs nothing
    /// and needs recompute.
    ZeroMapped,
    /// Dropped; a touch faults it back in from the source.
    Reclaimed,
}

/// What the pager knows of one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Where it is.
    pub state: MemoryState,
    /// Its slot size in bytes (page-rounded); meaningful once populated.
    pub bytes: usize,
    /// Whether the engine marked it written out, or it was loaded from the source.
    pub persisted: bool,
    /// Whether it holds zeros that must be recomputed before use.
    pub needs_recompute: bool,
}

/// Why a chunk needs recompute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecomputeReason {
    /// The source could not supply it (the chunk holds zeros).
    Source(SourceError),
    /// A fault found the budget exhausted; the chunk maps the zero page.
    BudgetExhausted,
}

/// A chunk the engine must recompute before it uses the chunk's data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecomputeRequest {
    /// The chunk.
    pub key: ChunkKey,
    /// Why.
    pub reason: RecomputeReason,
}
