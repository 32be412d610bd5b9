//! service: the context manager that runs each call of each context against managed memory
//! (Load, Run, Compress, AoT write-out, Reclaim; paper §3 and DESIGN.md "the four primitives").
//!
//! Read it top-down: [`manager`] holds the contexts and starts each call, which [`call`] runs
//! step by step; [`load`] brings a context's missing chunks back;
//! [`memory`] puts a context's chunks in the pager's userfaultfd slots; [`writer`] writes chunks
//! to kvfs ahead of time; [`source`] reads them back on a fault; [`config`] holds the settings and the named
//! managers (LLMS and the paper's baselines); [`chooser`] lets the policy crate's LCTRU queue pick the pager's victims; [`pressure`] moves the budget with the system's
//! memory pressure; [`profile`] is the planner's cost profile; [`inspect`] shows people who
//! mount kvfs the contexts' text and which chunks are in memory; [`sync`] is what the
//! hand-made concurrent pieces lock with (std's, or shuttle's in their models),
//! [`write_queue`] the writer's queue and flush, and [`transcript`] each context's turns as text,
//! recorded with its tokens. docs/service.md gives the numbered flows, and
//! its "Failpoints" and "Models" the failure tests.
//!
//! This crate owns contexts, their owners and their chunks' whereabouts (memory, kvfs, queued
//! for write-out). It never reads a socket or parses a request (the daemon crate does), never
//! measures a workload (the bench crate does), and reaches chunk bytes only through the pager
//! and kvfs.

pub mod call;
pub mod chooser;
pub mod chunk_io;
pub mod chunks;
pub mod config;
mod failpoints;
pub mod inspect;
pub mod lineage;
pub mod load;
pub mod manager;
pub mod memory;
pub mod pressure;
pub mod profile;
pub mod source;
pub mod sync;
pub mod transcript;
pub mod write_queue;
pub mod writer;

pub use call::{CallOptions, CallReport, Owner, Prompt};
pub use config::{DEFAULT_KV_BITS, ManagerConfig, ManagerKind, VictimPolicy, WriteOut};
pub use load::{LoadMode, LoadReport};
pub use manager::{ContextSummary, Manager};
pub use protocol::{Latency, ServiceStats, ServiceWeights};

/// What went wrong in the service; [`ServiceError::code`] is the stable name clients match on.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// No such context for this owner (another owner's contexts are not found either).
    #[error("no context {id}; list your contexts to see their ids")]
    NotFound { id: u64 },
    /// The request is malformed or out of range.
    #[error("{what}")]
    BadRequest { what: String },
    /// The owner holds as many contexts as allowed.
    #[error("app {app:?} already holds {max} contexts; delete one first")]
    TooManyContexts { app: String, max: usize },
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Kv(#[from] model::kv::KvError),
    #[error(transparent)]
    Recompute(#[from] model::kv::recompute::RecomputeError),
    #[error("kv store: {0}")]
    Store(#[from] kvfs::StoreError),
    #[error("kv memory: {0}")]
    Pager(#[from] uffd_pager::PagerError),
    #[error("planning the load: {0}")]
    Plan(#[from] policy::planner::PlanError),
    /// The call's attention could not be merged into the context's densities (paper Eq. 1).
    #[error("merging the call's attention into the densities: {0}")]
    Density(#[from] policy::density::DensityError),
    /// The compression levels could not be assigned (paper Eq. 2-3).
    #[error("assigning compression levels: {0}")]
    Assign(#[from] policy::assign::AssignError),
    /// The write-out could not be planned.
    #[error("planning the write-out: {0}")]
    WriteOut(#[from] policy::writeout::WriteOutError),
    /// A call on a context whose chunks, with the prompt's and the answer's, need more memory
    /// than the whole KV budget: refused before anything changes (docs/service.md).
    #[error(
        "context {id} needs {needed} bytes of KV memory for this call (its chunks, the prompt's \
         and the answer's) but the KV budget is {budget} bytes; raise --kv-budget, ask for fewer \
         tokens, or continue in a new context (nothing was changed)"
    )]
    OverBudget { id: u64, needed: u64, budget: u64 },
    /// A context the store holds was made with another model than the one loaded; it is kept.
    #[error(
        "context {id} was made with another model than the one this service runs and has no \
         transcript to rebuild it from; restart the service with that model to use it, or \
         delete it (nothing was changed)"
    )]
    OtherModel { id: u64 },
    /// The context has no transcript (made by an older service, or through the token API).
    #[error(
        "context {id} has no transcript: it was made before transcripts were recorded, or \
         from tokens rather than text"
    )]
    NoTranscript { id: u64 },
    /// A transcript the service cannot rebuild a context from.
    #[error("{what}")]
    InvalidTranscript { what: String },
    /// A chunk the store gave back does not fit its context (its format or its size); the call
    /// failed and the context is reloaded, so the chunk is recomputed.
    #[error("{key}: {what}")]
    ChunkMismatch {
        key: uffd_pager::ChunkKey,
        what: String,
    },
    /// A part of the service could not start (a thread, the store's directory, reading the model).
    #[error("{what}: {source}")]
    Start {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}")]
    Internal { what: String },
}

impl ServiceError {
    /// A stable, machine-readable name for the error.
    pub fn code(&self) -> &'static str {
        use model::ModelError;
        use model::kv::recompute::RecomputeError;
        let kv = |e: &model::kv::KvError| match e {
            model::kv::KvError::Full { .. } => "context_full",
            model::kv::KvError::OverBudget { .. } => "over_budget",
            _ => "internal",
        };
        match self {
            ServiceError::NotFound { .. } => "not_found",
            ServiceError::BadRequest { .. } => "bad_request",
            ServiceError::TooManyContexts { .. } => "too_many_contexts",
            ServiceError::Kv(e)
            | ServiceError::Model(ModelError::Kv(e))
            | ServiceError::Recompute(RecomputeError::Model {
                source: ModelError::Kv(e),
                ..
            }) => kv(e),
            ServiceError::Model(ModelError::BadToken { .. }) => "bad_request",
            ServiceError::OverBudget { .. }
            | ServiceError::Pager(uffd_pager::PagerError::BudgetExhausted { .. })
            | ServiceError::Pager(uffd_pager::PagerError::LargerThanBudget { .. }) => "over_budget",
            ServiceError::Store(_) | ServiceError::ChunkMismatch { .. } => "store",
            ServiceError::OtherModel { .. } => "other_model",
            ServiceError::NoTranscript { .. } => "no_transcript",
            ServiceError::InvalidTranscript { .. } => "invalid_transcript",
            _ => "internal",
        }
    }
}
