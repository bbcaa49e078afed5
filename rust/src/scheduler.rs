//! Continuous-batching scheduler with one rule for every request: bring its computed tokens
//! up to its known tokens, plus (when decoding) a verify block of B rows. That one rule
//! covers chunked prefill, plain decode (B = 1) and DFlash speculation.
//!
//! Invariants (see `check_invariants`, exercised by the property tests):
//! - every page is free or owned by exactly one live request (no sharing yet);
//! - a running request is in `running` and nowhere else; waiting/preempted ones in `waiting`;
//! - a decoding request's pages cover `committed`; one holding a ticket covers `committed + B`
//!   (pages for the draft block are allocated before the step that drafts);
//! - at most one plan is outstanding, and only its tickets can change request state.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use crate::block_pool::{BlockPool, NULL_PAGE};
use crate::error::{CoreError, CoreResult};
use crate::plan::{EntryKind, PlanEntry, StepPlan};
use crate::request::{FinishReason, Phase, Request};

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Pages in the pool, the null page included.
    pub num_pages: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// 0 turns speculation off (B = 1).
    pub num_speculative_tokens: usize,
    pub mask_token_id: u32,
}

impl SchedulerConfig {
    /// B: rows of a verify block.
    pub fn block_rows(&self) -> usize {
        self.num_speculative_tokens + 1
    }

    fn validate(&self) -> CoreResult<()> {
        let bad = |m: String| Err(CoreError::InvalidConfig(m));
        if self.num_pages < 2 {
            return bad(format!("num_pages must be >= 2 (null page + one usable), got {}", self.num_pages));
        }
        if self.block_size == 0 {
            return bad("block_size must be >= 1".into());
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be >= 1".into());
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be >= 1".into());
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

/// What one commit did to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitOutput {
    pub handle: u64,
    pub new_tokens: Vec<u32>,
    pub finish: Option<FinishReason>,
}

/// The same, flat (one entry per plan request), ready to hand over as arrays.
#[derive(Debug, Clone, Default)]
pub struct CommitBatch {
    pub handles: Vec<u64>,
    /// R+1 offsets into `tokens`.
    pub offsets: Vec<i64>,
    pub tokens: Vec<i64>,
    /// 0 = still running, else `FinishReason::code`.
    pub finish: Vec<u8>,
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

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    requests: HandleMap<Request>,
    ids: HashMap<String, u64>,
    waiting: VecDeque<u64>,
    /// Admission order, oldest first; the newest is preempted first.
    running: Vec<u64>,
    next_handle: u64,
    next_step: u64,
    outstanding: Option<u64>,
    num_preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> CoreResult<Self> {
        cfg.validate()?;
        let pool = BlockPool::new(cfg.num_pages, cfg.block_size);
        Ok(Scheduler {
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
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
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
        let reject = |reason: String| Err(CoreError::Rejected { request_id: id.to_string(), reason });
        if prompt.is_empty() {
            return reject("the prompt is empty".into());
        }
        if max_tokens == 0 {
            return reject("max_tokens must be >= 1".into());
        }
        let total = prompt.len() + max_tokens;
        if total > self.cfg.max_model_len {
            return reject(format!(
                "prompt ({} tokens) + max_tokens ({max_tokens}) = {total} exceeds max_model_len ({})",
                prompt.len(),
                self.cfg.max_model_len
            ));
        }
        // The last verify block may reach B positions past the last token.
        let pages = self.pool.pages_for(total + self.cfg.block_rows());
        if pages > self.pool.num_usable() {
            return reject(format!(
                "needs {pages} KV pages at full length but the pool has {}",
                self.pool.num_usable()
            ));
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        let mut tokens = Vec::with_capacity(total);
        tokens.extend_from_slice(&prompt);
        let req = Request {
            handle,
            id: id.to_string(),
            prompt_len: prompt.len(),
            tokens,
            max_tokens,
            stop_token_ids,
            phase: Phase::Waiting,
            pages: self.pool.empty_list(),
            ticket: None,
            num_preemptions: 0,
        };
        self.requests.insert(handle, req);
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
        self.ids.remove(&req.id);
        if req.phase.is_running() {
            self.running.retain(|&h| h != handle);
        } else {
            self.waiting.retain(|&h| h != handle);
        }
        req.phase = std::mem::replace(&mut req.phase, Phase::Waiting).finish(reason);
        req.ticket = None;
        req.pages.clear();
        req
    }

    fn preempt(&mut self, handle: u64) {
        let req = self.requests.get_mut(&handle).expect("live request");
        req.phase = std::mem::replace(&mut req.phase, Phase::Waiting).preempt();
        req.pages.clear();
        req.ticket = None;
        req.num_preemptions += 1;
        self.running.retain(|&h| h != handle);
        self.waiting.push_front(handle);
        self.num_preemptions += 1;
    }

    /// Plan one step. Errors if the previous plan is still outstanding.
    pub fn schedule(&mut self) -> CoreResult<StepPlan> {
        if let Some(step_id) = self.outstanding {
            return Err(CoreError::PlanOutstanding { step_id });
        }
        let b = self.cfg.block_rows();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut chosen: Vec<(u64, EntryKind)> = Vec::with_capacity(self.running.len() + 8);
        let mut preempted = Vec::new();
        let mut max_pages = 0;

        let mut i = 0;
        while i < self.running.len() {
            let h = self.running[i];
            let req = &self.requests[&h];
            let (kind, rows, need_tokens) = match req.phase {
                Phase::Prefilling { computed } => {
                    let (target, sample) = req.prefill_target();
                    let len = (target - computed).min(budget);
                    let kind = EntryKind::Prefill { start: computed, len, sample: sample && computed + len == target };
                    (kind, len, computed + len)
                }
                Phase::Decoding { committed, .. } => (EntryKind::Decode { committed }, b, committed + b),
                ref p => unreachable!("{} request in running", p.name()),
            };
            if rows == 0 || rows > budget {
                i += 1;
                continue;
            }
            let need_pages = self.pool.pages_for(need_tokens);
            let mut fits = true;
            loop {
                let req = self.requests.get_mut(&h).expect("running request");
                if self.pool.grow_to(&mut req.pages, need_pages) {
                    max_pages = max_pages.max(req.pages.len());
                    break;
                }
                let victim = *self.running.last().expect("h is running");
                self.preempt(victim);
                preempted.push(victim);
                if victim == h {
                    fits = false;
                    break;
                }
            }
            if fits {
                chosen.push((h, kind));
                budget -= rows;
                i += 1;
            }
        }

        // FCFS admission; none in a step that had to preempt.
        while preempted.is_empty() && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&h) = self.waiting.front() else { break };
            let req = self.requests.get_mut(&h).expect("waiting request");
            let (target, sample) = req.prefill_target();
            let len = target.min(budget);
            if !self.pool.grow_to(&mut req.pages, self.pool.pages_for(len)) {
                break;
            }
            req.phase = std::mem::replace(&mut req.phase, Phase::Waiting).admit();
            max_pages = max_pages.max(req.pages.len());
            self.waiting.pop_front();
            self.running.push(h);
            chosen.push((h, EntryKind::Prefill { start: 0, len, sample: sample && len == target }));
            budget -= len;
        }

        let step_id = self.next_step;
        self.next_step += 1;
        // Decoding requests first: the draft pass is then a prefix of the target pass.
        chosen.sort_by_key(|(_, k)| matches!(k, EntryKind::Prefill { .. }));
        let mut plan = self.build_plan(step_id, &chosen, max_pages);
        plan.preempted = preempted;
        self.outstanding = Some(step_id);
        Ok(plan)
    }

    /// Lays out the arrays and hands each chosen request its ticket for this step.
    fn build_plan(&mut self, step_id: u64, chosen: &[(u64, EntryKind)], max_pages: usize) -> StepPlan {
        let b = self.cfg.block_rows();
        let mask = self.cfg.mask_token_id as i64;
        let mut plan = StepPlan { step_id, block_rows: b, ..Default::default() };
        let num_decode = chosen.iter().filter(|(_, k)| matches!(k, EntryKind::Decode { .. })).count();
        plan.num_decode = num_decode;
        let bs = self.cfg.block_size;
        let rows: usize = chosen
            .iter()
            .map(|(_, k)| match k {
                EntryKind::Prefill { len, .. } => *len,
                EntryKind::Decode { .. } => b,
            })
            .sum();
        plan.sample_rows.reserve(num_decode * b + chosen.len());
        plan.verify_target_rows.reserve(num_decode * b);
        let t = &mut plan.target;
        for v in [&mut t.input_ids, &mut t.positions, &mut t.slot_mapping] {
            v.reserve(rows);
        }
        t.max_pages = max_pages;
        t.query_start_loc.push(0);
        t.block_tables.reserve(chosen.len() * max_pages);

        for (h, kind) in chosen {
            let req = self.requests.get_mut(h).expect("scheduled");
            req.ticket = Some(step_id);
            let req = &*req;
            let q_start = t.input_ids.len();
            let sample_start = plan.sample_rows.len();
            let seq_len = match *kind {
                EntryKind::Prefill { start, len, sample } => {
                    t.input_ids.extend(req.tokens[start..start + len].iter().map(|&x| x as i64));
                    t.positions.extend((start..start + len).map(|p| p as i64));
                    push_slots(&mut t.slot_mapping, req.pages.pages(), bs, start, len);
                    if sample {
                        plan.sample_rows.push((q_start + len - 1) as i64);
                    }
                    start + len
                }
                EntryKind::Decode { committed } => {
                    let bonus = req.tokens[committed] as i64;
                    t.input_ids.push(bonus);
                    t.input_ids.extend(std::iter::repeat_n(mask, b - 1));
                    t.positions.extend((committed..committed + b).map(|p| p as i64));
                    push_slots(&mut t.slot_mapping, req.pages.pages(), bs, committed, b);
                    plan.sample_rows.extend((q_start..q_start + b).map(|r| r as i64));
                    plan.verify_target_rows.extend((q_start + 1..q_start + b).map(|r| r as i64));
                    committed + b
                }
            };
            t.query_start_loc.push(t.input_ids.len() as i32);
            t.seq_lens.push(seq_len as i32);
            push_table(&mut t.block_tables, req.pages.pages(), max_pages);
            plan.entries.push(PlanEntry {
                handle: *h,
                kind: *kind,
                q_start,
                sample_start,
                num_samples: plan.sample_rows.len() - sample_start,
            });
        }
        plan
    }

    /// Drop the outstanding plan without applying it: every request keeps the state it had
    /// before `schedule()` (KV written by the step is beyond `committed` and is rewritten).
    pub fn cancel(&mut self, plan: &StepPlan) -> CoreResult<()> {
        self.check_outstanding(plan)?;
        self.release_tickets(plan);
        Ok(())
    }

    /// Finish every still-live request of the outstanding plan with `reason` (a failed step).
    pub fn fail(&mut self, plan: &StepPlan, reason: FinishReason) -> CoreResult<Vec<u64>> {
        self.check_outstanding(plan)?;
        self.release_tickets(plan);
        let mut failed = Vec::new();
        for e in &plan.entries {
            if self.requests.contains_key(&e.handle) {
                self.remove(e.handle, reason);
                failed.push(e.handle);
            }
        }
        Ok(failed)
    }

    fn check_outstanding(&self, plan: &StepPlan) -> CoreResult<()> {
        match self.outstanding {
            Some(s) if s == plan.step_id => Ok(()),
            Some(s) => Err(CoreError::StalePlan(format!(
                "plan of step {} is not the outstanding plan (step {s})",
                plan.step_id
            ))),
            None => Err(CoreError::StalePlan(format!(
                "plan of step {} was already applied or cancelled",
                plan.step_id
            ))),
        }
    }

    fn release_tickets(&mut self, plan: &StepPlan) {
        for e in &plan.entries {
            if let Some(r) = self.requests.get_mut(&e.handle) {
                r.ticket = None;
            }
        }
        self.outstanding = None;
    }

    /// Apply a step's results: `accepted[i]` drafts accepted for entry i, `sampled[j]` the
    /// target's token at `sample_rows[j]`. Validates everything before changing anything.
    pub fn commit(&mut self, plan: &StepPlan, accepted: &[u32], sampled: &[u32]) -> CoreResult<Vec<CommitOutput>> {
        let b = self.commit_batch(plan, accepted, sampled)?;
        Ok((0..b.handles.len())
            .map(|i| CommitOutput {
                handle: b.handles[i],
                new_tokens: b.tokens[b.offsets[i] as usize..b.offsets[i + 1] as usize].iter().map(|&t| t as u32).collect(),
                finish: FinishReason::from_code(b.finish[i]),
            })
            .collect())
    }

    /// `commit`, returning flat arrays (no per-request allocation).
    pub fn commit_batch(&mut self, plan: &StepPlan, accepted: &[u32], sampled: &[u32]) -> CoreResult<CommitBatch> {
        self.check_outstanding(plan)?;
        if accepted.len() != plan.entries.len() {
            return Err(CoreError::InvalidCommit(format!(
                "accepted has {} entries, the plan has {} requests",
                accepted.len(),
                plan.entries.len()
            )));
        }
        if sampled.len() != plan.num_sample_rows() {
            return Err(CoreError::InvalidCommit(format!(
                "sampled has {} tokens, the plan samples {} rows",
                sampled.len(),
                plan.num_sample_rows()
            )));
        }
        for (e, &a) in plan.entries.iter().zip(accepted) {
            match self.requests.get(&e.handle) {
                None => {
                    return Err(CoreError::StalePlan(format!("request {} is no longer live (aborted)", e.handle)))
                }
                Some(r) if r.ticket != Some(plan.step_id) => {
                    return Err(CoreError::StalePlan(format!(
                        "request {} holds no ticket for step {} (preempted or rescheduled)",
                        e.handle, plan.step_id
                    )))
                }
                Some(_) => {}
            }
            if a as usize > e.num_drafts() {
                return Err(CoreError::InvalidCommit(format!(
                    "request {}: accepted {a} tokens but only {} were proposed",
                    e.handle,
                    e.num_drafts()
                )));
            }
        }

        // Validated: from here on nothing fails. Each ticket is spent as its entry is applied.
        self.outstanding = None;
        let n = plan.entries.len();
        let mut out = CommitBatch {
            handles: Vec::with_capacity(n),
            offsets: Vec::with_capacity(n + 1),
            tokens: Vec::with_capacity(sampled.len()),
            finish: Vec::with_capacity(n),
        };
        out.offsets.push(0);
        for (e, &a) in plan.entries.iter().zip(accepted) {
            let s = &sampled[e.sample_start..e.sample_start + e.num_samples];
            let req = self.requests.get_mut(&e.handle).expect("validated");
            req.ticket = None;
            let first = out.tokens.len();
            let mut finish = None;
            match e.kind {
                EntryKind::Prefill { start, len, sample } => {
                    let (target, _) = req.prefill_target();
                    let computed = start + len;
                    if computed < target {
                        req.phase = Phase::Prefilling { computed };
                    } else if sample {
                        out.tokens.push(s[0] as i64);
                        finish = req.push_token(s[0]);
                        req.phase = Phase::Decoding { committed: target, bonus: s[0] };
                    } else {
                        req.phase = Phase::Decoding { committed: target, bonus: req.tokens[target] };
                    }
                }
                EntryKind::Decode { committed } => {
                    // Commits bonus, d_1..d_a; the target's samples t_0..t_a are those tokens'
                    // successors, so the output grows by t_0..t_a and t_a is the new bonus.
                    for &tok in &s[..a as usize + 1] {
                        out.tokens.push(tok as i64);
                        finish = req.push_token(tok);
                        if finish.is_some() {
                            break;
                        }
                    }
                    let committed = committed + (out.tokens.len() - first);
                    req.phase = Phase::Decoding { committed, bonus: *req.tokens.last().expect("non-empty") };
                }
            }
            if let Some(reason) = finish {
                self.remove(e.handle, reason);
            }
            out.handles.push(e.handle);
            out.offsets.push(out.tokens.len() as i64);
            out.finish.push(finish.map_or(0, |f| f.code()));
        }
        Ok(out)
    }

    pub fn outstanding_step(&self) -> Option<u64> {
        self.outstanding
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
        let b = self.cfg.block_rows();
        let mut owner = vec![0u64; self.pool.num_pages()];
        for (h, r) in &self.requests {
            for &p in r.pages.pages() {
                if p == NULL_PAGE {
                    return Err(format!("request {h} owns the null page"));
                }
                if owner[p as usize] != 0 {
                    return Err(format!("page {p} owned by {} and {h}", owner[p as usize]));
                }
                owner[p as usize] = *h;
                if self.pool.refcount(p) != 1 {
                    return Err(format!("page {p} has refcount {} but one owner", self.pool.refcount(p)));
                }
            }
            let in_running = self.running.contains(h);
            let in_waiting = self.waiting.contains(h);
            match &r.phase {
                Phase::Prefilling { computed } => {
                    if !in_running || in_waiting {
                        return Err(format!("prefilling request {h} not exactly in running"));
                    }
                    if r.pages.capacity() < *computed {
                        return Err(format!("request {h}: pages do not cover computed {computed}"));
                    }
                }
                Phase::Decoding { committed, bonus } => {
                    if !in_running || in_waiting {
                        return Err(format!("decoding request {h} not exactly in running"));
                    }
                    if committed + 1 != r.tokens.len() || r.tokens.last() != Some(bonus) {
                        return Err(format!("request {h}: committed/bonus disagree with its tokens"));
                    }
                    let need = if r.ticket.is_some() { committed + b } else { *committed };
                    if r.pages.capacity() < need {
                        return Err(format!("request {h}: pages cover {} < {need}", r.pages.capacity()));
                    }
                }
                Phase::Waiting | Phase::Preempted => {
                    if in_running || !in_waiting {
                        return Err(format!("queued request {h} not exactly in waiting"));
                    }
                    if !r.pages.is_empty() || r.ticket.is_some() {
                        return Err(format!("queued request {h} holds pages or a ticket"));
                    }
                }
                Phase::Finished(_) => return Err(format!("finished request {h} still live")),
            }
            if r.ticket.is_some() && r.ticket != self.outstanding {
                return Err(format!("request {h} holds a ticket of a plan that is not outstanding"));
            }
        }
        let owned = owner.iter().filter(|&&o| o != 0).count();
        if owned + self.pool.num_free() != self.pool.num_usable() {
            return Err("owned + free != usable pages".into());
        }
        if self.running.len() > self.cfg.max_num_seqs {
            return Err("more running requests than max_num_seqs".into());
        }
        Ok(())
    }
}

/// Slots of positions `start .. start+len`, walking pages instead of dividing per row.
fn push_slots(dst: &mut Vec<i64>, pages: &[u32], bs: usize, start: usize, len: usize) {
    let (mut page, mut off) = (start / bs, start % bs);
    for _ in 0..len {
        dst.push(pages[page] as i64 * bs as i64 + off as i64);
        off += 1;
        if off == bs {
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
