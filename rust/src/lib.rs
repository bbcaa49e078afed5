//! dflash-engine core: the state whose corruption would be silent.
//!
//! - [`page_pool`]: KV pages, refcounts, RAII page lists;
//! - [`request`]: the per-request state machine (no draft-side counters exist);
//! - [`scheduler`]: continuous batching, chunked prefill, speculation, preemption;
//! - [`plan`]: the flat arrays a step hands to the model runner, and its move-only ticket;
//! - [`draft_len`]: each step's draft length: fixed, by batch size, or adaptive to live
//!   acceptance and measured step costs;
//! - [`profile`]: the largest step the engine can plan, for sizing memory at startup;
//! - [`staging`]: a plan packed into a captured step graph's fixed shapes.
//!
//! The PyO3 layer lives in `python.rs`, compiled only with the `python` feature.

pub mod draft_len;
pub mod error;
pub mod page_pool;
pub mod plan;
pub mod profile;
pub mod request;
pub mod scheduler;
pub mod staging;

#[cfg(feature = "python")]
mod python;

pub use draft_len::{draft_len_for, expected_tokens, DraftLen, DraftLenPolicy, StepCosts};
pub use error::{CoreError, CoreResult, Param};
pub use page_pool::{PageId, PageList, PagePool, NULL_PAGE};
pub use plan::{draft_pass_rows, EntryKind, PassArrays, PlanEntry, StepPlan, StepTicket};
pub use request::{Applied, FinishReason, Phase, Request};
pub use scheduler::{
    pages_per_seq, state_slots_per_seq, CommitBatch, MixedStepLimit, Refused, Scheduler, SchedulerConfig,
};
