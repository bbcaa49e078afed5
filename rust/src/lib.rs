//! dflash-engine core: the state whose corruption would be silent.
//!
//! - [`page_pool`]: KV pages, refcounts, RAII page lists;
//! - [`request`]: the per-request state machine (no draft-side counters exist);
//! - [`scheduler`]: continuous batching, chunked prefill, speculation, preemption;
//! - [`plan`]: the flat arrays a step hands to the model runner, and its move-only ticket.
//!
//! The PyO3 layer lives in `python.rs`, compiled only with the `python` feature.

pub mod error;
pub mod page_pool;
pub mod plan;
pub mod request;
pub mod scheduler;

#[cfg(feature = "python")]
mod python;

pub use error::{CoreError, CoreResult, Param};
pub use page_pool::{PageId, PageList, PagePool, NULL_PAGE};
pub use plan::{EntryKind, PassArrays, PlanEntry, StepPlan, StepTicket};
pub use request::{Applied, FinishReason, Phase, Request};
pub use scheduler::{draft_len_for, pages_per_seq, CommitBatch, Refused, Scheduler, SchedulerConfig};
