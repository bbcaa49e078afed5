//! The step plan: everything the model runner needs for one step, as flat arrays, and the
//! ticket that alone can apply the step's results.
//!
//! Target pass rows are grouped per request (`query_start_loc`). Decoding requests come
//! first, each with its verify block `[bonus, d_1 .. d_{B-1}]` at positions
//! `committed .. committed+B-1`; prefill chunks follow. The draft pass is exactly the first
//! `num_decode` requests / `num_decode * B` rows of the same arrays before the runner fills in
//! the drafts: one block `[bonus, MASK x (B-1)]` per decoding request, same positions, same
//! slots, same page tables (so it costs no second copy). The runner writes draft token k of a
//! request into `verify_target_rows`, which are also the draft rows whose logits it reads.
//! Every slot and page id comes from here: Python derives none.
//!
//! The plan is information for the runner; the scheduler never reads it back. `commit`
//! takes the [`StepTicket`] (move-only, unforgeable) and applies results against the
//! scheduler's own record of what it planned.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// Rows are tokens `start .. start+len`; `sample` when the last row yields the first token.
    Prefill { start: usize, len: usize, sample: bool },
    /// Verify block of B rows at `committed ..`.
    Decode { committed: usize },
}

impl EntryKind {
    /// Target rows of an entry of this kind: the prefill chunk, or the B verify rows. The one
    /// definition (the scheduler budgets with it, the plan lays rows out with it).
    pub fn num_rows(&self, block_rows: usize) -> usize {
        match *self {
            EntryKind::Prefill { len, .. } => len,
            EntryKind::Decode { .. } => block_rows,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanEntry {
    pub handle: u64,
    pub kind: EntryKind,
    /// First target row of this request.
    pub q_start: usize,
    /// First entry of this request in `sample_rows`.
    pub sample_start: usize,
    pub num_samples: usize,
}

impl PlanEntry {
    /// Target rows of this request in this step (a verify entry samples each of its B rows).
    pub fn num_rows(&self) -> usize {
        self.kind.num_rows(self.num_samples)
    }

    /// Draft tokens proposed to this request in this step (the most it can accept).
    pub fn num_drafts(&self) -> usize {
        match self.kind {
            EntryKind::Decode { .. } => self.num_samples - 1,
            EntryKind::Prefill { .. } => 0,
        }
    }
}

#[derive(Debug, Default)]
pub struct PassArrays {
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    /// R+1 offsets.
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    /// Row-major `[R, max_pages]`, padded with the null page.
    pub page_tables: Vec<i32>,
    pub max_pages: usize,
}

impl PassArrays {
    pub fn num_rows(&self) -> usize {
        self.input_ids.len()
    }

    pub fn num_reqs(&self) -> usize {
        self.seq_lens.len()
    }
}

#[derive(Debug, Default)]
pub struct StepPlan {
    pub step_id: u64,
    /// B = num_speculative_tokens + 1 (1 when speculation is off).
    pub block_rows: usize,
    /// A copy of what the scheduler planned, for readers; `commit` uses its own record.
    pub entries: Vec<PlanEntry>,
    pub target: PassArrays,
    /// Target rows whose logits are sampled: the last prompt row, or all B verify rows.
    pub sample_rows: Vec<i64>,
    /// Decoding requests: the first `num_decode` entries (and draft-pass requests).
    pub num_decode: usize,
    /// Rows 1..B-1 of every verify block (draft rows, and where the drafts go).
    pub verify_target_rows: Vec<i64>,
}

impl StepPlan {
    /// Target rows sampled in this step (the length `sampled` must have at commit).
    pub fn num_sample_rows(&self) -> usize {
        self.sample_rows.len()
    }

    /// Rows of the draft pass: the leading `num_decode * B` target rows.
    pub fn num_draft_rows(&self) -> usize {
        self.num_decode * self.block_rows
    }
}

/// The right to apply (or cancel, or fail) one step's results, once. It cannot be cloned,
/// built outside the core, or used with another scheduler.
#[derive(Debug, PartialEq, Eq)]
pub struct StepTicket {
    scheduler: u64,
    step_id: u64,
}

impl StepTicket {
    pub(crate) fn new(scheduler: u64, step_id: u64) -> Self {
        StepTicket { scheduler, step_id }
    }

    pub fn step_id(&self) -> u64 {
        self.step_id
    }

    pub(crate) fn scheduler(&self) -> u64 {
        self.scheduler
    }
}
