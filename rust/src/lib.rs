//! dflash-engine core: the state whose corruption would be silent.
//!
//! - [`block_pool`]: pages, refcounts, RAII page lists;
//! - [`request`]: the per-request state machine (no draft-side counters exist);
//! - [`scheduler`]: continuous batching, chunked prefill, speculation, preemption;
//! - [`plan`]: the flat arrays a step hands to the model runner.
//!
//! The PyO3 layer lives in `python.rs`, compiled only with the `python` feature.

pub mod block_pool;
pub mod error;
pub mod plan;
pub mod request;
pub mod scheduler;

#[cfg(feature = "python")]
mod python;

pub use block_pool::{BlockPool, PageId, PageList, NULL_PAGE};
pub use error::{CoreError, CoreResult};
pub use plan::{EntryKind, PassArrays, PlanEntry, StepPlan};
pub use request::{FinishReason, Phase, Request};
pub use scheduler::{CommitBatch, CommitOutput, Scheduler, SchedulerConfig};
