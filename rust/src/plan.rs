//! The step plan: everything the model runner needs for one step, as flat arrays, and the
//! ticket that alone can apply the step's results.
//!
//! Target pass rows are grouped per request (`query_start_loc`). Decoding requests come
//! first, each with its verify block `[bonus, d_1 .. d_{B-1}]` at positions
//! `committed .. committed+B-1`; prefill chunks follow. The runner writes draft token k of a
//! request into `verify_target_rows` (rows 1..B-1 of each verify block).
//!
//! The draft pass ([`DraftPass`]) runs the first `num_decode` requests' draft blocks: D rows
//! `[bonus, MASK x (D-1)]` at `committed .. committed+D-1`, D = max(B, the draft's trained
//! block) (a draft proposes much worse in a block shorter than it was trained on), over the
//! same page tables; rows 1..B-1 of each block (`proposal_rows`) are the K proposals. Its KV
//! rows are scratch: the reservation covers max(B, D) rows past `committed`, and the context
//! write of committed rows overwrites them. A step with B = 1 (no drafts) has no draft pass.
//! Every slot and page id comes from here: Python derives none.
//!
//! Hybrid targets (recurrent state; request.rs): `state_read[r]` is request r's committed
//! state slot (-1: no state yet, read zeros) and `state_write[t]` the slot that keeps the
//! state after target row t (-1: not kept): the last row of a prefill chunk, and every verify
//! row. Both are empty for targets without state. State slots are page ids of the same pool.
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
    /// State slots the kept rows write (hybrid targets): the prefill chunk's last row, or
    /// verify rows 0..B-1; `commit` makes the one of the last kept row the committed slot.
    pub state_writes: Vec<u32>,
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

/// D: rows of each draft block in a step verifying `block_rows` (B) rows, for a draft trained
/// on blocks of `draft_block_rows`: max(B, that block), or 0 (no draft pass) when B = 1. The
/// one definition (the scheduler, the profile plan and, through the binding, the runner's
/// graph buffers use it).
pub fn draft_pass_rows(block_rows: usize, draft_block_rows: usize) -> usize {
    if block_rows > 1 {
        block_rows.max(draft_block_rows)
    } else {
        0
    }
}

/// The draft pass of a step: one block of `rows` (D) rows per decoding request.
#[derive(Debug, Default)]
pub struct DraftPass {
    /// D: rows per block (0: no draft pass in this step).
    pub rows: usize,
    /// `[bonus, MASK x (D-1)]` per block.
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    /// `committed + D` per block (the context the block attends to, itself included).
    pub seq_lens: Vec<i32>,
    /// Rows 1..B-1 of every block: the K proposals, in draft-pass row numbers.
    pub proposal_rows: Vec<i64>,
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
    /// Rows 1..B-1 of every verify block (where the drafts go).
    pub verify_target_rows: Vec<i64>,
    /// The draft pass over the first `num_decode` requests (page tables: their target rows').
    pub draft: DraftPass,
    /// `[R]`: each request's committed state slot, -1 for none (hybrid targets; else empty).
    pub state_read: Vec<i64>,
    /// `[T]`: the slot keeping the state after each target row, -1 for none (hybrid; else empty).
    pub state_write: Vec<i64>,
}

impl StepPlan {
    /// Target rows sampled in this step (the length `sampled` must have at commit).
    pub fn num_sample_rows(&self) -> usize {
        self.sample_rows.len()
    }

    /// Rows of the draft pass: `num_decode` blocks of D rows.
    pub fn num_draft_rows(&self) -> usize {
        self.num_decode * self.draft.rows
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
