//! Continuous-batching scheduler with one rule for every request: bring its computed tokens
//! up to its known tokens, plus (when decoding) a verify block of B rows. That one rule
//! covers chunked prefill, plain decode (B = 1) and DFlash speculation.
//!
//! Prefix caching (on by default, `enable_prefix_caching`): admission shares the longest run
//! of cached full pages equal to the leading pages of what the request must prefill (at least
//! one token is always computed), and every commit publishes the full pages its computed
//! prefix now covers (page_pool.rs has the hash, the collision rule and LRU eviction).
//!
//! Invariants (see `check_invariants`, exercised by the property tests):
//! - every page is free or owned by live requests, and its refcount is its number of owners;
//!   a page owned twice (shared) is published and frozen in every owner;
//! - a request's frozen pages (cache hits, its published pages) lie inside its computed
//!   prefix; no step writes a slot of a frozen page (`build_plan` asserts it), so a published
//!   page's content never changes; its other pages are private (refcount 1, unpublished);
//! - a free page is either uncached or cached (published, refcount 0, revivable);
//! - a running request is in `running` and nowhere else; waiting/preempted ones in `waiting`;
//! - a decoding request's pages cover `committed`; one in the outstanding step covers
//!   `committed + B` (pages for the draft block are allocated before the step that drafts);
//! - acceptance counts (draft_len.rs) exist only for live requests: they die in `remove`;
//! - hybrid targets (`state_slots`): state slots are pages of the same pool, each owned by
//!   exactly one request (never shared, never published, never one of its KV pages); a
//!   request's committed slot is one it owns, and it has one iff it has computed tokens;
//!   queued requests hold none; a prefilling request holds 2 (the committed one and the one
//!   its chunk writes), a decoding one B_max + 1 once it has been scheduled to decode (one per
//!   verify row besides the committed one): admission and preemption count them with its KV;
//! - at most one step is outstanding; its record lives here, and only its move-only
//!   [`StepTicket`] can apply, cancel or fail it (the caller's plan is never read back).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::draft_len::{DraftLen, DraftLenPolicy, StepCosts};
use crate::error::{CoreError, CoreResult, Param};
use crate::page_pool::{PagePool, NULL_PAGE};
use crate::plan::{EntryKind, PlanEntry, StepPlan, StepTicket};
use crate::request::{FinishReason, Phase, Request};

/// Pages one request of `max_len` tokens holds at most: its last decode step writes
/// `reserve_rows` rows (`SchedulerConfig::reserve_rows`, max(B, D)) from its last committed
/// position. The one place this bound is computed (admission checks it; the runner sizes
/// pools and page-table widths with it through the Python binding).
pub fn pages_per_seq(max_len: usize, reserve_rows: usize, page_size: usize) -> usize {
    (max_len + reserve_rows).div_ceil(page_size)
}

/// State slots a decoding request of a hybrid target holds: its committed state and one per
/// row of the largest verify block (K + 1). The one formula (admission counts it; the runner
/// sizes the pool's concurrency with it through the Python binding).
pub fn state_slots_per_seq(num_speculative_tokens: usize) -> usize {
    num_speculative_tokens + 2
}

/// Distinguishes schedulers so that a ticket of one is refused by another.
static NEXT_SCHEDULER_ID: AtomicU64 = AtomicU64::new(1);

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Pages in the pool, the null page included.
    pub num_pages: usize,
    pub page_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// 0 turns speculation off (B = 1).
    pub num_speculative_tokens: usize,
    pub mask_token_id: u32,
    /// Share cached prefixes at admission and publish computed full pages.
    pub enable_prefix_caching: bool,
    /// How each step's K is chosen (draft_len.rs): always `num_speculative_tokens` (Fixed), by
    /// batch size (Schedule), or by live acceptance and measured step costs (Adaptive). Every
    /// K is in 0..=num_speculative_tokens: the KV reservation is sized for the largest block.
    pub draft_len_policy: DraftLenPolicy,
    /// D: rows of the draft's block (its trained block size), 0 for B. A decode step drafts
    /// a block of D rows (scratch KV at committed..committed+D-1) and verifies the first K
    /// of its proposals: a draft proposes much worse in a block shorter than it was trained
    /// on. KV is reserved for max(B, D) rows past the last token.
    pub draft_block_rows: usize,
    /// A hybrid target: every running request also holds recurrent-state slots, pages of
    /// the one pool (`state_slots_per_seq`; request.rs). Excludes prefix caching (a cached
    /// prefix's state is not stored).
    pub state_slots: bool,
}

impl SchedulerConfig {
    /// B: rows of the largest verify block (what admission reserves KV for).
    pub fn block_rows(&self) -> usize {
        self.num_speculative_tokens + 1
    }

    /// Rows a decode step writes past `committed` (the verify block, or the longer draft
    /// block): what admission and every decode step reserve KV for.
    pub fn reserve_rows(&self) -> usize {
        self.block_rows().max(self.draft_block_rows)
    }

    /// State slots a decoding request holds: the committed one and one per row of the
    /// largest verify block (0 without state). The admission bound counts them.
    pub fn state_slots_per_seq(&self) -> usize {
        if self.state_slots {
            state_slots_per_seq(self.num_speculative_tokens)
        } else {
            0
        }
    }

    /// State slots a prefilling request holds: the committed one and its chunk's last row's.
    pub fn prefill_state_slots(&self) -> usize {
        if self.state_slots {
            2
        } else {
            0
        }
    }

    /// B of a step with `num_decoding` decoding requests under a static policy (Fixed,
    /// Schedule); under Adaptive B depends on live state (`Scheduler::next_draft_len`): the
    /// largest block here.
    pub fn block_rows_for(&self, num_decoding: usize) -> usize {
        let k = self.draft_len_policy.static_draft_len(self.num_speculative_tokens, num_decoding);
        k.unwrap_or(self.num_speculative_tokens) + 1
    }

    fn validate(&self) -> CoreResult<()> {
        let bad = |m: String| Err(CoreError::InvalidConfig(m));
        if self.num_pages < 2 {
            return bad(format!("num_pages must be >= 2 (null page + one usable), got {}", self.num_pages));
        }
        if self.page_size == 0 {
            return bad("page_size must be >= 1".into());
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be >= 1".into());
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be >= 1".into());
        }
        if let Err(m) = self.draft_len_policy.validate(self.num_speculative_tokens) {
            return bad(m);
        }
        if self.draft_block_rows != 0 && (self.num_speculative_tokens == 0 || self.draft_block_rows < self.block_rows())
        {
            return bad(format!(
                "draft_block_rows ({}) needs speculation and must be >= num_speculative_tokens + 1 ({})",
                self.draft_block_rows,
                self.block_rows()
            ));
        }
        if self.state_slots && self.enable_prefix_caching {
            return bad("prefix caching is not supported with state slots (a hybrid target): the recurrent state \
                        of a cached prefix is not stored; turn prefix caching off"
                .into());
        }
        if self.max_num_batched_tokens < self.block_rows() {
            return bad(format!(
                "max_num_batched_tokens ({}) must be >= num_speculative_tokens + 1 ({})",
                self.max_num_batched_tokens,
                self.block_rows()
            ));
        }
        Ok(())
    }
}

/// What a commit did, flat (one entry per still-live planned request), ready to hand over
/// as arrays.
#[derive(Debug, Clone, Default)]
pub struct CommitBatch {
    pub handles: Vec<u64>,
    /// R+1 offsets into `tokens`.
    pub offsets: Vec<i64>,
    pub tokens: Vec<i64>,
    /// 0 = still running, else `FinishReason::code`.
    pub finish: Vec<u8>,
    /// Prompt tokens each request took from the prefix cache at its first admission.
    pub num_cached_tokens: Vec<u32>,
}

/// Handles are sequential integers: hashing them is wasted work on the per-step path.
#[derive(Default)]
struct HandleHasher(u64);

impl Hasher for HandleHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type HandleMap<V> = HashMap<u64, V, BuildHasherDefault<HandleHasher>>;

/// A commit the core refused: nothing changed, and the ticket comes back to try again
/// (or to cancel / fail the step with).
#[derive(Debug)]
pub struct Refused {
    pub error: CoreError,
    pub ticket: StepTicket,
}

/// The scheduler's own record of the step it handed out.
#[derive(Debug)]
struct Outstanding {
    step_id: u64,
    block_rows: usize,
    entries: Vec<PlanEntry>,
    num_sample_rows: usize,
}

#[derive(Debug)]
pub struct Scheduler {
    id: u64,
    cfg: SchedulerConfig,
    pool: PagePool,
    requests: HandleMap<Request>,
    /// The one request-id registry: client-visible id -> handle, for live requests.
    ids: HashMap<String, u64>,
    waiting: VecDeque<u64>,
    /// Admission order, oldest first; the newest is preempted first.
    running: Vec<u64>,
    next_handle: u64,
    next_step: u64,
    outstanding: Option<Outstanding>,
    num_preemptions: u64,
    /// Prefix cache lookups: tokens of the admitted requests, and of those, tokens served
    /// from the cache (vLLM's `prefix_cache_queries` / `prefix_cache_hits`).
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    /// Each step's K, and the acceptance it learns from (per-request counts die in `remove`).
    draft_len: DraftLen,
    /// The prefill a step with decoding requests may carry (`set_mixed_step_limit`).
    mixed_limit: Option<MixedStepLimit>,
}

/// The prefill a step with decoding requests carries at most: what the runner's mixed-step
/// CUDA graphs hold. A step past it runs eagerly, which on a small model costs ten decode
/// steps, so the chunk waits a step instead (its prompt's first token comes a step later).
/// A step with no decoding request is not limited (only `max_num_batched_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixedStepLimit {
    /// Prefill tokens (rows) in all, >= 1.
    pub tokens: usize,
    /// Prefill entries (chunks of distinct requests), >= 1.
    pub requests: usize,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> CoreResult<Self> {
        cfg.validate()?;
        let pool = PagePool::new(cfg.num_pages, cfg.page_size);
        let draft_len = DraftLen::new(cfg.draft_len_policy.clone(), cfg.num_speculative_tokens);
        Ok(Scheduler {
            id: NEXT_SCHEDULER_ID.fetch_add(1, Ordering::Relaxed),
            cfg,
            pool,
            requests: HandleMap::default(),
            ids: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_handle: 1,
            next_step: 1,
            outstanding: None,
            num_preemptions: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            draft_len,
            mixed_limit: None,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// The draft-length policy's state: acceptance estimates, step costs, counters.
    pub fn draft_len(&self) -> &DraftLen {
        &self.draft_len
    }

    /// Measured seconds of a decode step per (batch bucket, k), from the runner at startup.
    pub fn set_step_costs(&mut self, costs: StepCosts) -> CoreResult<()> {
        self.draft_len.set_step_costs(costs)
    }

    /// Limit the prefill of steps with decoding requests (`MixedStepLimit`), or lift it (None).
    pub fn set_mixed_step_limit(&mut self, limit: Option<MixedStepLimit>) -> CoreResult<()> {
        if let Some(l) = limit {
            if l.tokens == 0 || l.requests == 0 {
                return Err(CoreError::InvalidConfig(format!(
                    "a mixed-step limit needs >= 1 token and >= 1 request, got {} and {}",
                    l.tokens, l.requests
                )));
            }
        }
        self.mixed_limit = limit;
        Ok(())
    }

    pub fn mixed_step_limit(&self) -> Option<MixedStepLimit> {
        self.mixed_limit
    }

    /// K the next `schedule()` drafts, given the requests decoding now.
    pub fn next_draft_len(&self) -> usize {
        self.draft_len.choose(&self.decoding_among(None))
    }

    /// Running requests in `Decoding` (only `only`, if given), in running order.
    fn decoding_among(&self, only: Option<u64>) -> Vec<u64> {
        self.running
            .iter()
            .copied()
            .filter(|&h| only.is_none_or(|o| o == h) && matches!(self.requests[&h].phase(), Phase::Decoding))
            .collect()
    }

    /// Queue a request; rejects at once what could never be served.
    pub fn add_request(
        &mut self,
        id: &str,
        prompt: Vec<u32>,
        max_tokens: usize,
        stop_token_ids: Vec<u32>,
    ) -> CoreResult<u64> {
        if self.ids.contains_key(id) {
            return Err(CoreError::DuplicateRequest(id.to_string()));
        }
        let reject =
            |param: Param, reason: String| Err(CoreError::Rejected { request_id: id.to_string(), param, reason });
        if prompt.is_empty() {
            return reject(Param::Prompt, "the prompt is empty".into());
        }
        if max_tokens == 0 {
            return reject(Param::MaxTokens, "max_tokens must be >= 1".into());
        }
        let total = prompt.len() + max_tokens;
        if prompt.len() >= self.cfg.max_model_len {
            return reject(
                Param::Prompt,
                format!(
                    "the prompt ({} tokens) leaves no room to generate within max_model_len ({})",
                    prompt.len(),
                    self.cfg.max_model_len
                ),
            );
        }
        if total > self.cfg.max_model_len {
            return reject(
                Param::MaxTokens,
                format!(
                    "prompt ({} tokens) + max_tokens ({max_tokens}) = {total} exceeds max_model_len ({})",
                    prompt.len(),
                    self.cfg.max_model_len
                ),
            );
        }
        let pages = pages_per_seq(total, self.cfg.reserve_rows(), self.cfg.page_size);
        let slots = self.cfg.state_slots_per_seq();
        if pages + slots > self.pool.num_usable() {
            let with = if slots > 0 { format!(" and {slots} state slots") } else { String::new() };
            return reject(
                Param::Prompt,
                format!("needs {pages} KV pages{with} at full length but the pool has {}", self.pool.num_usable()),
            );
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        self.requests.insert(handle, Request::new(id, &prompt, max_tokens, stop_token_ids, self.pool.empty_list()));
        self.ids.insert(id.to_string(), handle);
        self.waiting.push_back(handle);
        Ok(handle)
    }

    pub fn handle_of(&self, id: &str) -> Option<u64> {
        self.ids.get(id).copied()
    }

    pub fn request(&self, handle: u64) -> Option<&Request> {
        self.requests.get(&handle)
    }

    /// Finish a live request now (client gone, stop string, per-request error); frees its
    /// pages at once. A plan holding a ticket for it becomes stale.
    pub fn finish(&mut self, handle: u64, reason: FinishReason) -> CoreResult<()> {
        if !self.requests.contains_key(&handle) {
            return Err(CoreError::UnknownRequest(format!("handle {handle}")));
        }
        self.remove(handle, reason);
        Ok(())
    }

    fn remove(&mut self, handle: u64, reason: FinishReason) -> Request {
        let mut req = self.requests.remove(&handle).expect("live request");
        self.ids.remove(req.id());
        self.draft_len.forget(handle);
        if req.phase().is_running() {
            self.running.retain(|&h| h != handle);
        } else {
            self.waiting.retain(|&h| h != handle);
        }
        req.finish(reason);
        req
    }

    fn preempt(&mut self, handle: u64) {
        self.requests.get_mut(&handle).expect("live request").preempt();
        self.running.retain(|&h| h != handle);
        self.waiting.push_front(handle);
        self.num_preemptions += 1;
    }

    /// Plan one step: `None` when there is nothing to run (then nothing is outstanding).
    /// Errors if the previous step is still outstanding.
    pub fn schedule(&mut self) -> CoreResult<Option<(StepTicket, StepPlan)>> {
        self.schedule_among(None)
    }

    /// Plan a step for one running request alone (no admission): how an engine tells a
    /// request that fails by itself from the innocent ones of a failed step.
    pub fn schedule_only(&mut self, handle: u64) -> CoreResult<Option<(StepTicket, StepPlan)>> {
        self.schedule_among(Some(handle))
    }

    fn schedule_among(&mut self, only: Option<u64>) -> CoreResult<Option<(StepTicket, StepPlan)>> {
        if let Some(o) = &self.outstanding {
            return Err(CoreError::PlanOutstanding { step_id: o.step_id });
        }
        // K from the requests decoding at the start of the step (schedule_only: that one alone).
        let decoding = self.decoding_among(only);
        let b = self.draft_len.choose(&decoding) + 1;
        let mut budget = self.cfg.max_num_batched_tokens;
        // Prefill tokens and entries this step may still take: a step with decoding requests
        // stays within the mixed-step limit (one a preemption empties of them stays too).
        let (mut prefill_tokens, mut prefill_entries) = match self.mixed_limit {
            Some(l) if !decoding.is_empty() => (l.tokens, l.requests),
            _ => (usize::MAX, usize::MAX),
        };
        let mut chosen: Vec<(u64, EntryKind)> = Vec::with_capacity(self.running.len() + 8);
        let mut preempted_any = false;
        let mut max_pages = 0;

        let mut i = 0;
        while i < self.running.len() {
            let h = self.running[i];
            if only.is_some_and(|o| o != h) {
                i += 1;
                continue;
            }
            let req = &self.requests[&h];
            let kind = match req.phase() {
                Phase::Prefilling { computed } => {
                    if prefill_entries == 0 {
                        i += 1;
                        continue;
                    }
                    let (target, sample) = req.prefill_target();
                    let len = (target - computed).min(budget).min(prefill_tokens);
                    EntryKind::Prefill { start: computed, len, sample: sample && computed + len == target }
                }
                Phase::Decoding => EntryKind::Decode { committed: req.num_computed() },
                p => unreachable!("{} request in running", p.name()),
            };
            let rows = kind.num_rows(b);
            // A decode step's draft block may reach past its verify block (draft_block_rows).
            let reach =
                if matches!(kind, EntryKind::Decode { .. }) { rows.max(self.cfg.draft_block_rows) } else { rows };
            let need_tokens = req.num_computed() + reach;
            if rows == 0 || rows > budget {
                i += 1;
                continue;
            }
            let need_pages = self.pool.pages_for(need_tokens);
            let need_slots = match kind {
                EntryKind::Decode { .. } => self.cfg.state_slots_per_seq(),
                EntryKind::Prefill { .. } => self.cfg.prefill_state_slots(),
            };
            let mut fits = true;
            loop {
                let req = self.requests.get_mut(&h).expect("running request");
                if req.grow(need_pages, need_slots) {
                    max_pages = max_pages.max(req.pages().len());
                    break;
                }
                let victim = *self.running.last().expect("h is running");
                self.preempt(victim);
                preempted_any = true;
                if victim == h {
                    fits = false;
                    break;
                }
            }
            if fits {
                if let EntryKind::Prefill { len, .. } = kind {
                    prefill_tokens -= len;
                    prefill_entries -= 1;
                }
                chosen.push((h, kind));
                budget -= rows;
                i += 1;
            }
        }

        // FCFS admission (sharing cached prefix pages); none in a step that had to preempt.
        while only.is_none()
            && !preempted_any
            && budget > 0
            && prefill_tokens > 0
            && prefill_entries > 0
            && self.running.len() < self.cfg.max_num_seqs
        {
            let Some(&h) = self.waiting.front() else { break };
            let req = self.requests.get_mut(&h).expect("waiting request");
            let (target, sample) = req.prefill_target();
            let hits = if self.cfg.enable_prefix_caching { req.cache_lookup() } else { Vec::new() };
            let start = hits.len() * self.cfg.page_size;
            let len = (target - start).min(budget).min(prefill_tokens);
            if !req.admit(&hits, self.pool.pages_for(start + len), self.cfg.prefill_state_slots()) {
                break;
            }
            if self.cfg.enable_prefix_caching {
                self.prefix_cache_queries += req.tokens().len() as u64;
                self.prefix_cache_hits += start as u64;
            }
            max_pages = max_pages.max(req.pages().len());
            self.waiting.pop_front();
            self.running.push(h);
            chosen.push((h, EntryKind::Prefill { start, len, sample: sample && start + len == target }));
            budget -= len;
            prefill_tokens -= len;
            prefill_entries -= 1;
        }

        if chosen.is_empty() {
            return Ok(None);
        }
        let step_id = self.next_step;
        self.next_step += 1;
        // Decoding requests first: the draft pass is then a prefix of the target pass.
        chosen.sort_by_key(|(_, k)| matches!(k, EntryKind::Prefill { .. }));
        let plan = self.build_plan(step_id, &chosen, max_pages, b);
        if plan.num_decode > 0 {
            self.draft_len.record_choice(b - 1);
        }
        self.outstanding = Some(Outstanding {
            step_id,
            block_rows: b,
            entries: plan.entries.clone(),
            num_sample_rows: plan.num_sample_rows(),
        });
        Ok(Some((StepTicket::new(self.id, step_id), plan)))
    }

    /// Lays out the arrays of the chosen requests.
    fn build_plan(&self, step_id: u64, chosen: &[(u64, EntryKind)], max_pages: usize, b: usize) -> StepPlan {
        let mask = self.cfg.mask_token_id as i64;
        let mut plan = StepPlan { step_id, block_rows: b, ..Default::default() };
        let num_decode = chosen.iter().filter(|(_, k)| matches!(k, EntryKind::Decode { .. })).count();
        plan.num_decode = num_decode;
        let ps = self.cfg.page_size;
        let rows: usize = chosen.iter().map(|(_, k)| k.num_rows(b)).sum();
        plan.sample_rows.reserve(num_decode * b + chosen.len());
        plan.verify_target_rows.reserve(num_decode * b);
        // D: the draft block (see plan.rs); no draft pass when the step verifies no drafts.
        let d = crate::plan::draft_pass_rows(b, self.cfg.draft_block_rows);
        plan.draft.rows = d;
        plan.entries.reserve(chosen.len());
        let t = &mut plan.target;
        for v in [&mut t.input_ids, &mut t.positions, &mut t.slot_mapping] {
            v.reserve(rows);
        }
        t.max_pages = max_pages;
        t.query_start_loc.push(0);
        t.page_tables.reserve(chosen.len() * max_pages);

        for (h, kind) in chosen {
            let req = &self.requests[h];
            let (tokens, pages) = (req.tokens(), req.pages().pages());
            // Every slot this step writes (prefill rows; verify rows and the draft block's
            // scratch rows, same slots) lies past the frozen pages: a published page never changes.
            let write_start = match *kind {
                EntryKind::Prefill { start, .. } => start,
                EntryKind::Decode { committed } => committed,
            };
            assert!(
                write_start >= req.num_frozen_pages() * ps,
                "request {h}: step writes position {write_start} inside its frozen prefix of {} pages",
                req.num_frozen_pages()
            );
            let q_start = t.input_ids.len();
            let sample_start = plan.sample_rows.len();
            // State: read the committed slot; keep the chunk's last row, or every verify row,
            // in the slots other than the committed one.
            let mut state_writes = Vec::new();
            if self.cfg.state_slots {
                plan.state_read.push(req.committed_slot().map_or(-1, |p| p as i64));
                let rows = kind.num_rows(b);
                state_writes = req.state_writes(if matches!(kind, EntryKind::Decode { .. }) { b } else { 1 });
                let first_kept = rows - state_writes.len();
                plan.state_write.extend(std::iter::repeat_n(-1, first_kept));
                plan.state_write.extend(state_writes.iter().map(|&p| p as i64));
            }
            let seq_len = match *kind {
                EntryKind::Prefill { start, len, sample } => {
                    t.input_ids.extend(tokens[start..start + len].iter().map(|&x| x as i64));
                    t.positions.extend((start..start + len).map(|p| p as i64));
                    push_slots(&mut t.slot_mapping, pages, ps, start, len);
                    if sample {
                        plan.sample_rows.push((q_start + len - 1) as i64);
                    }
                    start + len
                }
                EntryKind::Decode { committed } => {
                    t.input_ids.push(tokens[committed] as i64);
                    t.input_ids.extend(std::iter::repeat_n(mask, b - 1));
                    t.positions.extend((committed..committed + b).map(|p| p as i64));
                    push_slots(&mut t.slot_mapping, pages, ps, committed, b);
                    plan.sample_rows.extend((q_start..q_start + b).map(|r| r as i64));
                    plan.verify_target_rows.extend((q_start + 1..q_start + b).map(|r| r as i64));
                    if d > 0 {
                        // The draft block's rows past the verify block are reserved too
                        // (`reach` in schedule_among): push_slots panics on a missing page.
                        let dp = &mut plan.draft;
                        let first = dp.input_ids.len();
                        dp.input_ids.push(tokens[committed] as i64);
                        dp.input_ids.extend(std::iter::repeat_n(mask, d - 1));
                        dp.positions.extend((committed..committed + d).map(|p| p as i64));
                        push_slots(&mut dp.slot_mapping, pages, ps, committed, d);
                        dp.seq_lens.push((committed + d) as i32);
                        dp.proposal_rows.extend((first + 1..first + b).map(|r| r as i64));
                    }
                    committed + b
                }
            };
            t.query_start_loc.push(t.input_ids.len() as i32);
            t.seq_lens.push(seq_len as i32);
            push_table(&mut t.page_tables, pages, max_pages);
            let num_samples = plan.sample_rows.len() - sample_start;
            let entry = PlanEntry { handle: *h, kind: *kind, q_start, sample_start, num_samples, state_writes };
            debug_assert_eq!(entry.num_rows(), t.input_ids.len() - q_start);
            plan.entries.push(entry);
        }
        plan
    }

    /// Takes the outstanding record if `ticket` is its ticket.
    fn redeem(&mut self, ticket: &StepTicket) -> CoreResult<Outstanding> {
        match &self.outstanding {
            _ if ticket.scheduler() != self.id => Err(CoreError::StalePlan(format!(
                "the ticket of step {} belongs to another scheduler",
                ticket.step_id()
            ))),
            Some(o) if o.step_id == ticket.step_id() => Ok(self.outstanding.take().expect("matched")),
            _ => Err(CoreError::StalePlan(format!("step {} is not the outstanding step", ticket.step_id()))),
        }
    }

    /// Drop the outstanding step without applying it: every request keeps the state it had
    /// before `schedule()` (KV written by the step is beyond `committed` and is rewritten).
    pub fn cancel(&mut self, ticket: StepTicket) -> CoreResult<()> {
        self.redeem(&ticket).map(|_| ())
    }

    /// Finish every still-live request of the outstanding step with `reason` (a failed step).
    pub fn fail(&mut self, ticket: StepTicket, reason: FinishReason) -> CoreResult<Vec<u64>> {
        let o = self.redeem(&ticket)?;
        let mut failed = Vec::new();
        for e in &o.entries {
            if self.requests.contains_key(&e.handle) {
                self.remove(e.handle, reason);
                failed.push(e.handle);
            }
        }
        Ok(failed)
    }

    /// Apply a step's results: `accepted[i]` drafts accepted for entry i of the plan,
    /// `sampled[j]` the target's token at `sample_rows[j]`. Everything is validated against
    /// the scheduler's own record before anything changes; on refusal the ticket comes back.
    /// Requests finished since `schedule()` (aborted) are skipped.
    pub fn commit(&mut self, ticket: StepTicket, accepted: &[u32], sampled: &[u32]) -> Result<CommitBatch, Refused> {
        let o = match self.redeem(&ticket) {
            Ok(o) => o,
            Err(error) => return Err(Refused { error, ticket }),
        };
        if let Err(error) = Self::validate(&o, accepted, sampled) {
            self.outstanding = Some(o);
            return Err(Refused { error, ticket });
        }
        // Acceptance is learned before any request of the step leaves (its counts die with it).
        let decoded = o
            .entries
            .iter()
            .zip(accepted)
            .filter(|(e, _)| matches!(e.kind, EntryKind::Decode { .. }) && self.requests.contains_key(&e.handle));
        self.draft_len.observe_step(decoded.map(|(e, &a)| (e.handle, e.num_drafts(), a as usize)));
        let n = o.entries.len();
        let mut out = CommitBatch {
            handles: Vec::with_capacity(n),
            offsets: Vec::with_capacity(n + 1),
            tokens: Vec::with_capacity(sampled.len()),
            finish: Vec::with_capacity(n),
            num_cached_tokens: Vec::with_capacity(n),
        };
        out.offsets.push(0);
        for (e, &a) in o.entries.iter().zip(accepted) {
            let Some(req) = self.requests.get_mut(&e.handle) else { continue };
            let s = &sampled[e.sample_start..e.sample_start + e.num_samples];
            let applied = match e.kind {
                EntryKind::Prefill { start, len, sample } => req.finish_prefill_chunk(start, len, sample.then(|| s[0])),
                EntryKind::Decode { committed } => req.apply_verify(committed, &s[..a as usize + 1]),
            };
            if !e.state_writes.is_empty() && applied.finish.is_none() {
                // The state after the last kept row (the chunk's last; verify row a) is the
                // committed one now: the rejected rows' states are never read.
                let last = if matches!(e.kind, EntryKind::Decode { .. }) { a as usize } else { 0 };
                req.commit_state(e.state_writes[last]);
            }
            if self.cfg.enable_prefix_caching {
                // Before any removal: a request finished mid-block still computed its prefix.
                req.publish_computed();
            }
            let toks = req.tokens();
            out.tokens.extend(toks[toks.len() - applied.new_tokens..].iter().map(|&t| t as i64));
            out.num_cached_tokens.push(req.num_cached_tokens() as u32);
            if let Some(reason) = applied.finish {
                self.remove(e.handle, reason);
            }
            out.handles.push(e.handle);
            out.offsets.push(out.tokens.len() as i64);
            out.finish.push(applied.finish.map_or(0, FinishReason::code));
        }
        Ok(out)
    }

    fn validate(o: &Outstanding, accepted: &[u32], sampled: &[u32]) -> CoreResult<()> {
        if accepted.len() != o.entries.len() {
            return Err(CoreError::InvalidCommit(format!(
                "accepted has {} entries, the step has {} requests",
                accepted.len(),
                o.entries.len()
            )));
        }
        if sampled.len() != o.num_sample_rows {
            return Err(CoreError::InvalidCommit(format!(
                "sampled has {} tokens, the step samples {} rows",
                sampled.len(),
                o.num_sample_rows
            )));
        }
        for (e, &a) in o.entries.iter().zip(accepted) {
            if a as usize > e.num_drafts() {
                return Err(CoreError::InvalidCommit(format!(
                    "request {}: accepted {a} tokens but only {} were proposed",
                    e.handle,
                    e.num_drafts()
                )));
            }
        }
        Ok(())
    }

    pub fn outstanding_step(&self) -> Option<u64> {
        self.outstanding.as_ref().map(|o| o.step_id)
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_live(&self) -> usize {
        self.requests.len()
    }

    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn num_free_pages(&self) -> usize {
        self.pool.num_free()
    }

    /// Tokens of admitted requests looked up in the prefix cache (vLLM's `prefix_cache_queries`).
    pub fn prefix_cache_queries(&self) -> u64 {
        self.prefix_cache_queries
    }

    /// Of those, tokens served from the cache (vLLM's `prefix_cache_hits`).
    pub fn prefix_cache_hits(&self) -> u64 {
        self.prefix_cache_hits
    }

    /// Fraction of usable pages owned by requests.
    pub fn kv_usage(&self) -> f64 {
        1.0 - self.pool.num_free() as f64 / self.pool.num_usable() as f64
    }

    pub fn handles(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.requests.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Checks every invariant in the module doc; returns the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_integrity()?;
        let b = self.outstanding.as_ref().map_or(self.cfg.block_rows(), |o| o.block_rows);
        let in_step: Vec<u64> = self.outstanding.iter().flat_map(|o| o.entries.iter().map(|e| e.handle)).collect();
        let ps = self.cfg.page_size;
        let mut owners = vec![0u32; self.pool.num_pages()];
        for (h, r) in &self.requests {
            let frozen = r.num_frozen_pages();
            if frozen > r.pages().len() {
                return Err(format!("request {h}: {frozen} frozen pages but {} pages", r.pages().len()));
            }
            if frozen * ps > r.num_computed() {
                return Err(format!("request {h}: frozen pages reach past computed {}", r.num_computed()));
            }
            if !self.cfg.enable_prefix_caching && frozen > 0 {
                return Err(format!("request {h} has frozen pages with prefix caching off"));
            }
            for (j, &p) in r.pages().pages().iter().enumerate() {
                if p == NULL_PAGE {
                    return Err(format!("request {h} owns the null page"));
                }
                if r.pages().pages()[..j].contains(&p) {
                    return Err(format!("request {h} holds page {p} twice"));
                }
                owners[p as usize] += 1;
                let meta = self.pool.cache_meta(p);
                if j < frozen {
                    // Its own publication or a hit: the entry it recorded; or a private
                    // duplicate of a page published first (then unpublished, refcount 1).
                    match meta {
                        Some(m) if m.entry != r.frozen_entries()[j] => {
                            return Err(format!(
                                "request {h}: frozen page {p} is entry {} not {}",
                                m.entry,
                                r.frozen_entries()[j]
                            ))
                        }
                        None if self.pool.refcount(p) != 1 => {
                            return Err(format!("request {h}: unpublished page {p} is shared"))
                        }
                        _ => {}
                    }
                } else if meta.is_some() || self.pool.refcount(p) != 1 {
                    return Err(format!("request {h}: page {p} past the frozen prefix is published or shared"));
                }
            }
            self.check_state_slots(*h, r, in_step.contains(h), b, &mut owners)?;
            if self.ids.get(r.id()) != Some(h) {
                return Err(format!("request {h} is not registered under its id"));
            }
            let in_running = self.running.contains(h);
            let in_waiting = self.waiting.contains(h);
            let capacity = r.pages().capacity();
            match r.phase() {
                Phase::Prefilling { computed } => {
                    if !in_running || in_waiting {
                        return Err(format!("prefilling request {h} not exactly in running"));
                    }
                    if capacity < computed {
                        return Err(format!("request {h}: pages do not cover computed {computed}"));
                    }
                }
                Phase::Decoding => {
                    if !in_running || in_waiting {
                        return Err(format!("decoding request {h} not exactly in running"));
                    }
                    let committed = r.num_computed();
                    let need = if in_step.contains(h) { committed + b } else { committed };
                    if capacity < need {
                        return Err(format!("request {h}: pages cover {capacity} < {need}"));
                    }
                }
                Phase::Waiting | Phase::Preempted => {
                    if in_running || !in_waiting {
                        return Err(format!("queued request {h} not exactly in waiting"));
                    }
                    if !r.pages().is_empty() || in_step.contains(h) {
                        return Err(format!("queued request {h} holds pages or is in the outstanding step"));
                    }
                }
                Phase::Finished(_) => return Err(format!("finished request {h} still live")),
            }
        }
        if self.ids.len() != self.requests.len() {
            return Err("the id registry and the live requests differ".into());
        }
        for (p, &n) in owners.iter().enumerate() {
            if self.pool.refcount(p as u32) != n {
                return Err(format!("page {p} has refcount {} but {n} owners", self.pool.refcount(p as u32)));
            }
        }
        let owned = owners.iter().filter(|&&o| o != 0).count();
        if owned + self.pool.num_free() != self.pool.num_usable() {
            return Err("owned + free != usable pages".into());
        }
        if !self.cfg.enable_prefix_caching && self.pool.num_cached() > 0 {
            return Err("pages published with prefix caching off".into());
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err("more running requests than max_num_seqs".into());
        }
        self.draft_len.check(|h| self.requests.contains_key(&h))?;
        Ok(())
    }
}

impl Scheduler {
    /// The state-slot invariants of one request (module doc); counts its slots in `owners`.
    fn check_state_slots(
        &self,
        h: u64,
        r: &Request,
        in_step: bool,
        b: usize,
        owners: &mut [u32],
    ) -> Result<(), String> {
        let slots = r.state_slots();
        if !self.cfg.state_slots {
            return match (slots.is_empty(), r.committed_slot()) {
                (true, None) => Ok(()),
                _ => Err(format!("request {h} holds state slots without state_slots")),
            };
        }
        for (j, &p) in slots.iter().enumerate() {
            if p == NULL_PAGE || slots[..j].contains(&p) || r.pages().pages().contains(&p) {
                return Err(format!(
                    "request {h}: state slot {p} is the null page, held twice, or one of its KV pages"
                ));
            }
            if self.pool.cache_meta(p).is_some() {
                return Err(format!("request {h}: state slot {p} is published"));
            }
            owners[p as usize] += 1;
        }
        if let Some(c) = r.committed_slot() {
            if !slots.contains(&c) {
                return Err(format!("request {h}: committed state slot {c} is not one it owns"));
            }
        }
        if r.committed_slot().is_some() != (r.num_computed() > 0) {
            return Err(format!(
                "request {h}: committed slot {:?} with {} computed tokens",
                r.committed_slot(),
                r.num_computed()
            ));
        }
        let need = match r.phase() {
            Phase::Prefilling { .. } => self.cfg.prefill_state_slots(),
            Phase::Decoding if in_step => b + 1,
            Phase::Decoding => 1,
            _ => 0,
        };
        if slots.len() < need || (need == 0 && !slots.is_empty()) {
            return Err(format!("request {h} ({}) holds {} state slots, needs {need}", r.phase().name(), slots.len()));
        }
        Ok(())
    }
}

/// Slots of positions `start .. start+len`, walking pages instead of dividing per row.
fn push_slots(dst: &mut Vec<i64>, pages: &[u32], ps: usize, start: usize, len: usize) {
    let (mut page, mut off) = (start / ps, start % ps);
    for _ in 0..len {
        dst.push(pages[page] as i64 * ps as i64 + off as i64);
        off += 1;
        if off == ps {
            off = 0;
            page += 1;
        }
    }
}

fn push_table(dst: &mut Vec<i32>, pages: &[u32], width: usize) {
    dst.extend(pages.iter().map(|&p| p as i32));
    dst.extend(std::iter::repeat_n(NULL_PAGE as i32, width - pages.len()));
}

#[cfg(test)]
mod tests;
