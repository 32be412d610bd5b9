//! Pure policy decisions of llms: information density, bit-width assignment, the LCTRU queue, AoT write-out, the swapping-recompute planner and the weight residency planner. No I/O.
//!
//! This crate owns the decisions and nothing else: no clock, no thread, no file, and no type of
//! the pager, kvfs or the model; chunks are ids, levels, sizes and densities.

pub mod assign;
pub mod cost;
pub mod density;
mod hash;
pub mod lctru;
pub mod level;
pub mod planner;
pub mod pressure;
pub mod victim;
pub mod weights;
pub mod whole;
pub mod writeout;

pub use assign::{AssignError, Assignment, assign_levels, assign_levels_grouped};
pub use cost::{CostError, CostModel, Fit, LinearCost};
pub use density::{DensityError, DensityTracker, GroupDensity, TokenAttention, chunk_densities};
pub use lctru::{ChunkLru, LctruQueue};
pub use level::{Level, LevelError, LevelSet};
pub use planner::{
    LoadPlan, MissingChunk, PlanError, Prediction, evaluate, plan_load, plan_load_from,
    plan_order_blind,
};
pub use pressure::{
    BudgetChange, BudgetConfig, BudgetController, PressureError, PressureSignals, ShrinkReason,
};
pub use victim::{ChunkId, Victim, VictimChooser, VictimError, Victims};
pub use weights::{
    PassPrediction, Residency, StreamModel, WeightPlan, WeightPlanError, WeightTensor, min_budget,
    plan_bytes, plan_weights, predict,
};
pub use whole::{WholeContextKind, WholeContextLru};
pub use writeout::{Write, WriteCandidate, WriteOutError, WriteReason, plan_writeout};

#[cfg(test)]
mod tests {
    /// The pager calls its chooser from its own thread, under a lock.
    #[test]
    fn choosers_can_move_between_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<crate::LctruQueue>();
        send_sync::<crate::ChunkLru>();
        send_sync::<crate::WholeContextLru>();
        send_sync::<crate::DensityTracker>();
        send_sync::<crate::BudgetController>();
    }
}
