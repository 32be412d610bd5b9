//! The service: the context manager that runs each call of each context against managed memory
//! (Load, Run, Compress, AoT write-out, Reclaim; paper §3 and DESIGN.md "the four primitives").
//!
//! Read it top-down: [`manager`] runs a call; [`load`] brings a context's missing chunks back;
//! [`memory`] puts a context's chunks in the pager's userfaultfd slots; [`writer`] writes chunks
//! to kvfs ahead of time; [`source`] reads them back on a fault; [`chooser`] lets the policy
//! crate's LCTRU queue pick the pager's victims. docs/service.md gives the numbered flows.
//! Around it, [`daemon`] serves many apps over a Unix socket in the JSON-lines [`protocol`]
//! (docs/protocol.md), and [`client`] is the typed client `llms` and apps use; [`inspect`] shows
//! people who mount kvfs the contexts' text and which chunks are in memory.

pub mod bench;
pub mod cgroup;
pub mod chooser;
pub mod chunk_io;
pub mod client;
pub mod daemon;
pub mod inspect;
pub mod load;
pub mod manager;
pub mod managers;
pub mod memory;
pub mod pressure;
pub mod profile;
pub mod protocol;
pub mod source;
pub mod writer;

pub use load::{LoadMode, LoadReport};
pub use manager::{
    CallOptions, CallReport, ContextSummary, Latency, Manager, ManagerConfig, Owner, Prompt,
    ServiceStats, ServiceWeights, VictimPolicy, WriteOut,
};
pub use managers::ManagerKind;

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
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Kv(#[from] crate::kv::KvError),
    #[error(transparent)]
    Recompute(#[from] crate::kv::recompute::RecomputeError),
    #[error("kv store: {0}")]
    Store(#[from] kvfs::StoreError),
    #[error("kv memory: {0}")]
    Pager(#[from] uffd_pager::PagerError),
    #[error("planning the load: {0}")]
    Plan(#[from] policy::planner::PlanError),
    #[error("{what}")]
    Internal { what: String },
}

impl ServiceError {
    /// A stable, machine-readable name for the error.
    pub fn code(&self) -> &'static str {
        use crate::kv::recompute::RecomputeError;
        use crate::model::ModelError;
        let kv = |e: &crate::kv::KvError| match e {
            crate::kv::KvError::Full { .. } => "context_full",
            crate::kv::KvError::OverBudget { .. } => "over_budget",
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
            ServiceError::Pager(uffd_pager::PagerError::BudgetExhausted { .. })
            | ServiceError::Pager(uffd_pager::PagerError::LargerThanBudget { .. }) => "over_budget",
            ServiceError::Store(_) => "store",
            _ => "internal",
        }
    }
}
