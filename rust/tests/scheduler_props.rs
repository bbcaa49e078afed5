//! Random interleavings of add / schedule / commit (random acceptance) / abort / cancel under
//! page pressure, with prompts that share prefixes (prefix caching on), checked against a
//! simple reference model after every operation:
//! - every request's tokens follow the model;
//! - the KV content model: every slot a step writes records the token prefix its KV is a
//!   function of; every position a step reads (the prefix before its first row) must hold
//!   exactly the request's own prefix, so a cache hit on unequal tokens, or a shared or
//!   published page overwritten, is caught the first time anyone reads it;
//! - no step writes a published or shared page;
//! - refcounts equal the number of page tables holding each page (counted here, not by the core);
//! - admission shares at least every page that a live request holds published with an equal
//!   token prefix (and never the page holding the last token to prefill);
//! - the pool is full again after every request finishes;
//! - draft length (the Adaptive policy under random cost tables): the acceptance estimates
//!   equal a reference recomputed here from the plans and results (what each commit teaches,
//!   counts gone with their request), every step drafts a k with the most expected tokens per
//!   second by the reference, the same operations choose the same k's, and the counters
//!   count every planned step with decoding requests.
//! - hybrid targets (state slots, prefix caching off): the state content model: every state
//!   slot a step keeps records (request, tokens covered); every step reads exactly the slot
//!   covering its request's computed prefix (-1 iff nothing is computed), writes only slots
//!   it owns other than that one, no slot twice in a step and no KV into a state slot; the
//!   pool is full again once everything finished.

use std::collections::HashMap;

use _core::{
    draft_len, pages_per_seq, state_slots_per_seq, CoreError, DraftLenPolicy, EntryKind, FinishReason, MixedStepLimit,
    Phase, Scheduler, SchedulerConfig, StepCosts, StepPlan, StepTicket,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// prompt = the first `shared` tokens of family `family` ++ `own` fresh tokens.
    Add {
        family: usize,
        shared: usize,
        own: usize,
        max_tokens: usize,
        stop: bool,
    },
    /// prompt = a live request's known tokens (prompt + output) ++ `own` fresh tokens: a
    /// second chat turn.
    AddFollowUp {
        pick: usize,
        own: usize,
        max_tokens: usize,
    },
    Step {
        seed: u64,
    },
    Abort {
        pick: usize,
    },
    StepThenAbortBeforeCommit {
        seed: u64,
        pick: usize,
    },
    StepThenCancel {
        seed: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..3, 0usize..40, 0usize..10, 1usize..24, any::<bool>())
            .prop_map(|(family, shared, own, max_tokens, stop)| Op::Add { family, shared, own, max_tokens, stop }),
        1 => (any::<usize>(), 1usize..6, 1usize..12).prop_map(|(pick, own, max_tokens)| Op::AddFollowUp { pick, own, max_tokens }),
        8 => any::<u64>().prop_map(|seed| Op::Step { seed }),
        1 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        1 => (any::<u64>(), any::<usize>()).prop_map(|(seed, pick)| Op::StepThenAbortBeforeCommit { seed, pick }),
        1 => any::<u64>().prop_map(|seed| Op::StepThenCancel { seed }),
    ]
}

/// Token `i` of family `f`: families 0 and 1 share their first 6 tokens, then diverge.
/// Family 2 is family 0 with its second token changed (+8): its first page differs but every
/// later page holds the same tokens as family 0's, and under the weak test hash (a sum mod 4)
/// every page hashes as family 0's does: only the parent check tells them apart.
fn family_token(f: usize, i: usize) -> u32 {
    match (f, i) {
        (2, 1) => 109,
        (2, _) => family_token(0, i),
        (_, i) if i < 6 => 100 + i as u32,
        _ => 200 + (f * 64 + i) as u32,
    }
}

/// splitmix64: deterministic per-op randomness for acceptance and sampled tokens.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The reference model: what each live request's known tokens must be.
#[derive(Debug, Clone)]
struct Model {
    id: String,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    stop: Vec<u32>,
}

const STOP: u32 = 3;

/// What one planned row will leave in its slot once the step ran.
#[derive(Debug, Clone, Copy)]
enum RowContent {
    /// KV of the known token at this position (prefill rows).
    Known(usize),
    /// Verify row `i` of a block at `committed`: the KV of the committed token there if the
    /// commit keeps it, else garbage.
    Verify { committed: usize, i: usize },
}

/// Decayed per-position (trials, accepts), index j - 1 for position j.
type Counts = (Vec<f64>, Vec<f64>);

/// draft_len.rs's estimator and choice, written again from its doc.
struct DraftLenRef {
    k: usize,
    /// (buckets, seconds[bucket][k] for k = 0..=K) once handed to the core.
    costs: Option<(Vec<usize>, Vec<Vec<f64>>)>,
    /// Acceptance by handle % 3 (uniform, every draft, none) instead of uniform.
    skew: bool,
    global: Counts,
    /// Handles stay after their request leaves (handles are never reused).
    requests: HashMap<u64, Counts>,
    /// K of every planned step with decoding requests.
    chosen: Vec<usize>,
    /// Per position j (index j - 1): decayed (predicted, observed) acceptances through j.
    calibration: Vec<(f64, f64)>,
    /// The adaptive policy: only it keeps per-request counts and the calibration.
    adaptive: bool,
    /// Committed steps with decode entries since the last that drafted.
    plain_since: i32,
}

impl DraftLenRef {
    fn new(k: usize, adaptive: bool) -> Self {
        let global = (vec![0.0; k], vec![0.0; k]);
        DraftLenRef {
            k,
            costs: None,
            skew: false,
            global,
            requests: HashMap::new(),
            chosen: Vec::new(),
            calibration: vec![(0.0, 0.0); k],
            adaptive,
            plain_since: 0,
        }
    }

    fn observe(c: &mut Counts, decay: f64, num_drafts: usize, accepted: usize) {
        c.0.iter_mut().chain(c.1.iter_mut()).for_each(|x| *x *= decay);
        // Positions 1..=accepted accepted; accepted+1 rejected if proposed; nothing past it.
        for j in 0..num_drafts.min(accepted + 1) {
            c.0[j] += 1.0;
            c.1[j] += (j < accepted) as u8 as f64;
        }
    }

    /// One commit: (handle, drafts, accepted) of its decode entries still live. The global
    /// counts age once if the step drafted (a plain step teaches nothing and ages nothing).
    fn commit(&mut self, results: &[(u64, usize, usize)]) {
        if results.is_empty() {
            return;
        }
        let k = self.k;
        // Calibration (a step that drafted ages every position's sums): per position j, the
        // probability the estimates (not yet taught by this step) gave each request with a
        // history of accepting through j, and whether it did.
        if self.adaptive && results.iter().any(|&(_, d, _)| d > 0) {
            let decay = draft_len::CALIBRATION_DECAY.powi(1 + self.plain_since);
            self.calibration.iter_mut().for_each(|c| *c = (c.0 * decay, c.1 * decay));
            for &(h, d, a) in results.iter().filter(|&&(h, d, _)| d > 0 && self.requests.contains_key(&h)) {
                let p = self.request_estimates(h);
                for j in 0..d {
                    let reach: f64 = p[..=j].iter().product();
                    let c = &mut self.calibration[j];
                    *c = (c.0 + reach, c.1 + (a > j) as u8 as f64);
                }
            }
        }
        // Global counts age per step with decoding requests; a plain step's aging waits for
        // the next step that drafts.
        if results.iter().any(|&(_, d, _)| d > 0) {
            let age = draft_len::GLOBAL_DECAY.powi(1 + self.plain_since);
            self.global.0.iter_mut().chain(self.global.1.iter_mut()).for_each(|x| *x *= age);
            self.plain_since = 0;
        } else {
            self.plain_since += 1;
        }
        for &(h, d, a) in results {
            Self::observe(&mut self.global, 1.0, d, a);
            if !self.adaptive {
                continue;
            }
            let own = self.requests.entry(h).or_insert_with(|| (vec![0.0; k], vec![0.0; k]));
            Self::observe(own, draft_len::REQUEST_DECAY, d, a);
        }
    }

    /// Expected accepted drafts of a block of k under estimates p, each position's term scaled
    /// by its calibration factor.
    fn drafts(&self, p: &[f64], k: usize) -> f64 {
        (1..=k).map(|j| self.factor(j) * p[..j].iter().product::<f64>()).sum()
    }

    fn factor(&self, j: usize) -> f64 {
        let (p, a) = self.calibration[j - 1];
        (a + draft_len::CALIBRATION_PRIOR) / (p + draft_len::CALIBRATION_PRIOR)
    }

    fn global_estimates(&self) -> Vec<f64> {
        let mut prior = draft_len::PRIOR_FIRST;
        (0..self.k)
            .map(|j| {
                let w = draft_len::PRIOR_WEIGHT;
                let p = (self.global.1[j] + w * prior) / (self.global.0[j] + w);
                prior = draft_len::PRIOR_DECAY * p;
                p
            })
            .collect()
    }

    fn request_estimates(&self, h: u64) -> Vec<f64> {
        let g = self.global_estimates();
        let Some((n, a)) = self.requests.get(&h) else {
            return g;
        };
        let n0 = draft_len::REQUEST_PRIOR_WEIGHT;
        let blend = |j: usize| {
            let w = n[j] / (n[j] + n0);
            if n[j] > 0.0 {
                w * a[j] / n[j] + (1.0 - w) * g[j]
            } else {
                g[j]
            }
        };
        (0..self.k).map(blend).collect()
    }

    /// The k's a step over `decoding` may draft (more than one only on a near tie).
    fn choices(&self, policy: &DraftLenPolicy, decoding: &[u64]) -> Vec<usize> {
        if let Some(k) = policy.static_draft_len(self.k, decoding.len()) {
            return vec![k];
        }
        let (DraftLenPolicy::Adaptive { candidates }, Some((buckets, secs))) = (policy, &self.costs) else {
            return vec![self.k];
        };
        if decoding.is_empty() {
            return vec![self.k];
        }
        let row = &secs[buckets.iter().position(|&b| b >= decoding.len()).unwrap_or(buckets.len() - 1)];
        let rate = |k: usize| {
            // n + Σ_i Σ_{j≤k} c_j · Π_{m≤j} p_i,m
            let drafts: f64 = decoding.iter().map(|&h| self.drafts(&self.request_estimates(h), k)).sum();
            (decoding.len() as f64 + drafts) / row[k]
        };
        let best = candidates.iter().map(|&k| rate(k)).fold(f64::NEG_INFINITY, f64::max);
        let set: Vec<usize> = candidates.iter().copied().filter(|&k| rate(k) >= best * (1.0 - 1e-9)).collect();
        // After PLAIN_AFTER steps in a row that drafted, a plain step (0 a candidate).
        let drafted = self.chosen.iter().rev().take_while(|&&k| k > 0).count() as u64;
        if drafted >= draft_len::PLAIN_AFTER && candidates.contains(&0) {
            return vec![0];
        }
        // After EXPLORE_AFTER steps in a row that drafted nothing, a step that would draft
        // nothing drafts the best k > 0 instead.
        let zeros = self.chosen.iter().rev().take_while(|&&k| k == 0).count() as u64;
        let drafting: Vec<usize> = candidates.iter().copied().filter(|&k| k > 0).collect();
        let best_d = drafting.iter().map(|&k| rate(k)).fold(f64::NEG_INFINITY, f64::max);
        // ... times the cost of the best drafting k over a plain step (the slowest of near ties).
        let ratio = drafting
            .iter()
            .filter(|&&k| rate(k) >= best_d * (1.0 - 1e-9))
            .map(|&k| row[k] / row[0])
            .fold(1.0_f64, f64::max);
        let ratio_lo = drafting
            .iter()
            .filter(|&&k| rate(k) >= best_d * (1.0 - 1e-9))
            .map(|&k| row[k] / row[0])
            .fold(f64::INFINITY, f64::min)
            .max(1.0);
        let threshold = _core::draft_len::EXPLORE_AFTER as f64;
        if set.contains(&0)
            && !drafting.is_empty()
            && zeros as f64 >= threshold * ratio_lo
            && (zeros as f64) < threshold * ratio
        {
            return candidates.to_vec(); // a near tie between drafting k's of different cost: either
        }
        if set.contains(&0) && zeros as f64 >= threshold * ratio && !drafting.is_empty() {
            let mut out: Vec<usize> = drafting.into_iter().filter(|&k| rate(k) >= best_d * (1.0 - 1e-9)).collect();
            out.extend(set.iter().copied().filter(|&k| k > 0));
            return out;
        }
        // Every PROBE_EVERY-th step drafts the runner-up when it is within PROBE_WITHIN of
        // the best (on a tie for the best, any of the tied).
        if self.chosen.len() as u64 % draft_len::PROBE_EVERY == draft_len::PROBE_EVERY - 1 && set.len() == 1 {
            let second =
                candidates.iter().filter(|&&k| k != set[0]).map(|&k| rate(k)).fold(f64::NEG_INFINITY, f64::max);
            if second >= draft_len::PROBE_WITHIN * best * (1.0 + 1e-9) {
                return candidates
                    .iter()
                    .copied()
                    .filter(|&k| k != set[0] && rate(k) >= second * (1.0 - 1e-9))
                    .collect();
            }
            if second >= draft_len::PROBE_WITHIN * best * (1.0 - 1e-9) {
                let mut out: Vec<usize> =
                    candidates.iter().copied().filter(|&k| rate(k) >= second * (1.0 - 1e-9)).collect();
                out.sort_unstable();
                return out; // on the threshold: either
            }
        }
        set
    }

    fn check(&self, s: &Scheduler, live: &HashMap<u64, Model>) {
        let close = |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9);
        let dl = s.draft_len();
        let (got, want) = (dl.global_estimates(), self.global_estimates());
        assert!(close(&got, &want), "global acceptance estimates {got:?}, the reference {want:?}");
        for h in live.keys() {
            assert!(close(&dl.request_estimates(*h), &self.request_estimates(*h)), "request {h}: acceptance estimates");
        }
        let tracked = self.requests.keys().filter(|h| live.contains_key(h)).count();
        assert_eq!(dl.num_tracked(), tracked, "acceptance counts of requests that are gone");
    }
}

struct Harness {
    s: Scheduler,
    dl: DraftLenRef,
    model: HashMap<u64, Model>,
    /// slot -> the token prefix its K/V (target and draft) were computed from; None = garbage.
    content: HashMap<i64, Option<Vec<u32>>>,
    next_id: u64,
    b: usize,
    /// Rows a decode step reserves past `committed`: max(B, the draft block D).
    reserve: usize,
    ps: usize,
    /// State slot (page) -> (request, tokens its state covers); None = garbage.
    state: HashMap<u32, Option<(u64, usize)>>,
}

impl Harness {
    fn check(&self) {
        self.s.check_invariants().unwrap();
        assert_eq!(self.s.num_live(), self.model.len());
        self.dl.check(&self.s, &self.model);
        let pool = self.s.pool();
        let mut owners: HashMap<u32, u32> = HashMap::new();
        for (h, m) in &self.model {
            let r = self.s.request(*h).expect("model request live in scheduler");
            assert_eq!(self.s.handle_of(&m.id), Some(*h), "one registry: id -> handle");
            assert_eq!(r.tokens(), &m.tokens[..], "request {h} tokens diverged from the model");
            for &p in r.pages().pages().iter().chain(r.state_slots()) {
                *owners.entry(p).or_default() += 1;
            }
            if let Some(c) = r.committed_slot() {
                assert!(r.state_slots().contains(&c), "request {h}: committed state slot {c} not its own");
            }
        }
        // Reference refcounts: the page tables and state slots, counted here.
        for p in 1..pool.num_pages() as u32 {
            let n = owners.get(&p).copied().unwrap_or(0);
            assert_eq!(pool.refcount(p), n, "page {p}: refcount vs page tables");
            if n > 1 {
                assert!(pool.cache_meta(p).is_some(), "shared page {p} is not published");
            }
        }
    }

    fn fresh_tokens(&mut self, n: usize) -> Vec<u32> {
        let base = 10_000 + self.next_id as u32 * 64;
        (0..n as u32).map(|i| base + i).collect()
    }

    fn add(&mut self, prompt: Vec<u32>, max_tokens: usize, stop: bool) {
        let id = format!("r{}", self.next_id);
        self.next_id += 1;
        let prompt_len = prompt.len();
        let stop_ids = if stop { vec![STOP] } else { vec![] };
        match self.s.add_request(&id, prompt.clone(), max_tokens, stop_ids.clone()) {
            Ok(h) => {
                self.model.insert(h, Model { id: id.clone(), tokens: prompt, prompt_len, max_tokens, stop: stop_ids });
            }
            Err(CoreError::Rejected { .. }) => {
                let cfg = self.s.config();
                let too_long = prompt_len + max_tokens > cfg.max_model_len;
                let slots = if cfg.state_slots { state_slots_per_seq(cfg.num_speculative_tokens) } else { 0 };
                let too_big =
                    (prompt_len + max_tokens + self.reserve).div_ceil(cfg.page_size) + slots > cfg.num_pages - 1;
                assert_eq!(
                    too_big,
                    pages_per_seq(prompt_len + max_tokens, self.reserve, cfg.page_size) + slots > cfg.num_pages - 1
                );
                assert!(prompt_len == 0 || too_long || too_big, "rejected a request that fits");
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }

    fn add_family(&mut self, family: usize, shared: usize, own: usize, max_tokens: usize, stop: bool) {
        let mut prompt: Vec<u32> = (0..shared).map(|i| family_token(family, i)).collect();
        prompt.extend(self.fresh_tokens(own));
        self.add(prompt, max_tokens, stop);
    }

    fn add_follow_up(&mut self, pick: usize, own: usize, max_tokens: usize) {
        let handles = self.s.handles();
        if handles.is_empty() {
            return;
        }
        let mut prompt = self.model[&handles[pick % handles.len()]].tokens.clone();
        prompt.extend(self.fresh_tokens(own));
        self.add(prompt, max_tokens, false);
    }

    /// (phase, committed) of a live request: the committed count as the model defines it.
    fn state(&self, h: u64) -> (Phase, usize) {
        let r = self.s.request(h).unwrap();
        (r.phase(), r.num_computed())
    }

    /// Pages a queued request must share when admitted now: the longest run of leading
    /// pages that some live request holds *published* with an equal token prefix, short of
    /// the page holding the last token to prefill.
    fn expected_hit_pages(&self, w: u64) -> usize {
        let ps = self.ps;
        let m = &self.model[&w];
        let target = if m.tokens.len() == m.prompt_len { m.prompt_len } else { m.tokens.len() - 1 };
        let cap = (target - 1) / ps;
        let mut best = 0;
        for (q, mq) in &self.model {
            let r = self.s.request(*q).unwrap();
            let mut j = 0;
            while j < cap
                && j < r.pages().len()
                && self.s.pool().cache_meta(r.pages().pages()[j]).is_some()
                && mq.tokens.len() >= (j + 1) * ps
                && mq.tokens[..(j + 1) * ps] == m.tokens[..(j + 1) * ps]
            {
                j += 1;
            }
            best = best.max(j);
        }
        best
    }

    /// Schedule and produce random results. `None` when there is nothing to run.
    #[allow(clippy::type_complexity)]
    fn plan(&mut self, seed: u64) -> Option<(StepTicket, StepPlan, Vec<u32>, Vec<u32>)> {
        let before: HashMap<u64, (Phase, usize)> = self.model.keys().map(|h| (*h, self.state(*h))).collect();
        let expected: HashMap<u64, usize> = before
            .iter()
            .filter(|(_, (ph, _))| matches!(ph, Phase::Waiting | Phase::Preempted))
            .map(|(h, _)| (*h, self.expected_hit_pages(*h)))
            .collect();
        // The step's K: the policy's for the requests decoding before it.
        let decoding: Vec<u64> =
            before.iter().filter(|(_, (ph, _))| matches!(ph, Phase::Decoding)).map(|(h, _)| *h).collect();
        let want_k = self.dl.choices(&self.s.config().draft_len_policy, &decoding);
        let next_k = self.s.next_draft_len();
        let Some((ticket, plan)) = self.s.schedule().unwrap() else {
            assert_eq!(self.s.num_running(), 0, "nothing scheduled while requests run");
            self.check();
            return None;
        };
        self.check();
        if plan.num_decode > 0 {
            assert_eq!(plan.block_rows, next_k + 1, "next_draft_len is what schedule() drafts");
            assert!(want_k.contains(&next_k), "drafted {next_k}, the reference picks {want_k:?}");
            self.dl.chosen.push(next_k);
        }
        let ps = self.ps;
        for e in &plan.entries {
            let r = self.s.request(e.handle).unwrap();
            let tokens = &self.model[&e.handle].tokens;
            let read_end = match e.kind {
                EntryKind::Decode { committed } => {
                    assert!(plan.block_rows <= self.b && e.num_samples == plan.block_rows);
                    // The verify block and the (possibly longer) draft block's scratch rows.
                    assert!(r.pages().capacity() >= committed + plan.block_rows);
                    assert!(r.pages().capacity() >= committed + self.s.config().draft_block_rows);
                    assert_eq!(before[&e.handle], (Phase::Decoding, committed));
                    // The draft pass: this request's block of D rows, in its own pages.
                    let d = plan.draft.rows;
                    assert_eq!(
                        d,
                        if plan.block_rows > 1 { plan.block_rows.max(self.s.config().draft_block_rows) } else { 0 }
                    ); // (the rule, written out)
                    let i = plan.entries.iter().position(|x| x.handle == e.handle).unwrap();
                    for (j, row) in (i * d..(i + 1) * d).enumerate() {
                        assert_eq!(plan.draft.positions[row], (committed + j) as i64);
                        assert_eq!(plan.draft.slot_mapping[row], r.pages().slot(committed + j));
                    }
                    committed
                }
                EntryKind::Prefill { start, .. } => {
                    if let Some(&want) = expected.get(&e.handle) {
                        // Admitted in this step: a whole number of shared pages, at least the
                        // live published run, and never the last token to prefill.
                        let target = if tokens.len() == self.model[&e.handle].prompt_len {
                            tokens.len()
                        } else {
                            tokens.len() - 1
                        };
                        assert_eq!(start % ps, 0);
                        assert!(start < target, "the whole prefill came from the cache");
                        assert!(
                            start >= want * ps,
                            "request {}: hit {start} tokens, a live request publishes {}",
                            e.handle,
                            want * ps
                        );
                        assert_eq!(r.num_frozen_pages(), start / ps);
                    }
                    start
                }
            };
            // Every position before the step's first row must hold this request's own prefix.
            for pos in 0..read_end {
                let slot = r.pages().slot(pos);
                match self.content.get(&slot) {
                    Some(Some(prefix)) => assert_eq!(
                        &prefix[..],
                        &tokens[..=pos],
                        "request {} reads slot {slot} (position {pos}) holding another prefix",
                        e.handle
                    ),
                    other => panic!("request {} reads slot {slot} (position {pos}): {other:?}", e.handle),
                }
            }
            // Every slot it writes is private and unpublished.
            for row in e.q_start..e.q_start + e.num_rows() {
                let slot = plan.target.slot_mapping[row];
                let page = (slot / ps as i64) as u32;
                assert_eq!(self.s.pool().refcount(page), 1, "step writes shared page {page}");
                assert!(self.s.pool().cache_meta(page).is_none(), "step writes published page {page}");
            }
        }
        self.check_state_plan(&plan);
        // Beside decoding requests, the prefill stays within the mixed-step limit.
        if let (Some(l), true) = (self.s.mixed_step_limit(), plan.num_decode > 0) {
            let prefill = &plan.entries[plan.num_decode..];
            assert!(
                prefill.len() <= l.requests,
                "{} prefill chunks beside decoding, limit {}",
                prefill.len(),
                l.requests
            );
            let rows: usize = prefill.iter().map(|e| e.num_rows()).sum();
            assert!(rows <= l.tokens, "{rows} prefill rows beside decoding, limit {}", l.tokens);
        }
        let mut rng = Rng(seed);
        let skew = self.dl.skew;
        let accepted: Vec<u32> = plan
            .entries
            .iter()
            .map(|e| {
                let (d, u) = (e.num_drafts() as u64, rng.below(e.num_drafts() as u64 + 1));
                (if !skew { u } else { [u, d, 0][(e.handle % 3) as usize] }) as u32
            })
            .collect();
        let sampled: Vec<u32> = plan.sample_rows.iter().map(|_| 3 + rng.below(40) as u32).collect();
        Some((ticket, plan, accepted, sampled))
    }

    /// The state slots of a plan (hybrid targets): what each request reads, where it writes.
    fn check_state_plan(&self, plan: &StepPlan) {
        if !self.s.config().state_slots {
            assert!(plan.state_read.is_empty() && plan.state_write.is_empty());
            return;
        }
        assert_eq!((plan.state_read.len(), plan.state_write.len()), (plan.entries.len(), plan.target.num_rows()));
        let mut written = Vec::new();
        for (i, e) in plan.entries.iter().enumerate() {
            let r = self.s.request(e.handle).unwrap();
            let computed = r.num_computed();
            let read = plan.state_read[i];
            if computed == 0 {
                assert_eq!(read, -1, "request {} with nothing computed reads a state", e.handle);
            } else {
                assert_eq!(read, r.committed_slot().unwrap() as i64);
                assert_eq!(
                    self.state.get(&(read as u32)).copied().flatten(),
                    Some((e.handle, computed)),
                    "request {} reads state slot {read} not covering its {computed} computed tokens",
                    e.handle
                );
            }
            let writes = &plan.state_write[e.q_start..e.q_start + e.num_rows()];
            let kept: Vec<i64> = writes.iter().copied().filter(|&w| w >= 0).collect();
            match e.kind {
                EntryKind::Prefill { .. } => {
                    assert_eq!(kept.len(), 1);
                    assert!(writes[writes.len() - 1] >= 0, "a prefill chunk keeps its last row's state");
                }
                EntryKind::Decode { .. } => assert_eq!(kept.len(), plan.block_rows, "every verify row keeps a state"),
            }
            for w in kept {
                assert_ne!(w, read, "a step overwrites the committed state it reads");
                assert!(
                    r.state_slots().contains(&(w as u32)),
                    "request {} writes state slot {w} it does not own",
                    e.handle
                );
                written.push(w);
            }
        }
        let n = written.len();
        written.sort_unstable();
        written.dedup();
        assert_eq!(written.len(), n, "a state slot written twice in one step");
        // No KV row (target or draft pass) lands in anyone's state slot.
        let slots: Vec<u32> =
            self.model.keys().flat_map(|h| self.s.request(*h).unwrap().state_slots().to_vec()).collect();
        for &kv in plan.target.slot_mapping.iter().chain(&plan.draft.slot_mapping) {
            assert!(!slots.contains(&((kv / self.ps as i64) as u32)), "KV slot {kv} lies in a state slot page");
        }
    }

    /// What a step's kept rows leave in their state slots: `covered(entry, row)` -> tokens
    /// covered (None: garbage, the step was not committed).
    fn write_states(&mut self, plan: &StepPlan, covered: impl Fn(&_core::PlanEntry, usize) -> Option<usize>) {
        if !self.s.config().state_slots {
            return;
        }
        for &kv in plan.target.slot_mapping.iter().chain(&plan.draft.slot_mapping) {
            self.state.insert((kv / self.ps as i64) as u32, None);
        }
        for e in &plan.entries {
            for row in 0..e.num_rows() {
                let w = plan.state_write[e.q_start + row];
                if w >= 0 {
                    self.state.insert(w as u32, covered(e, row).map(|n| (e.handle, n)));
                }
            }
        }
    }

    /// The rows of `plan` as (slot, what the row computes), for the content model.
    fn rows(plan: &StepPlan) -> Vec<(u64, Vec<(i64, RowContent)>)> {
        plan.entries
            .iter()
            .map(|e| {
                let rows = (0..e.num_rows())
                    .map(|i| {
                        let slot = plan.target.slot_mapping[e.q_start + i];
                        let c = match e.kind {
                            EntryKind::Prefill { start, .. } => RowContent::Known(start + i),
                            EntryKind::Decode { committed } => RowContent::Verify { committed, i },
                        };
                        (slot, c)
                    })
                    .collect();
                (e.handle, rows)
            })
            .collect()
    }

    /// The step ran but nothing was committed (cancelled, or its request aborted): its rows
    /// hold KV nobody may read as committed.
    fn scribble(&mut self, plan: &StepPlan) {
        self.write_states(plan, |_, _| None);
        for (_, rows) in Self::rows(plan) {
            for (slot, _) in rows {
                self.content.insert(slot, None);
            }
        }
    }

    fn commit(&mut self, ticket: StepTicket, plan: &StepPlan, accepted: &[u32], sampled: &[u32]) {
        let before: HashMap<u64, (Phase, usize)> = plan
            .entries
            .iter()
            .filter(|e| self.model.contains_key(&e.handle))
            .map(|e| (e.handle, self.state(e.handle)))
            .collect();
        let out = self.s.commit(ticket, accepted, sampled).map_err(|r| r.error).unwrap();
        // Row t of an entry keeps the state of its tokens through that row (rejected rows'
        // states are never read: the committed slot moves to the last accepted row's).
        let alive: HashMap<u64, u32> = plan
            .entries
            .iter()
            .zip(accepted)
            .filter(|(e, _)| before.contains_key(&e.handle))
            .map(|(e, &a)| (e.handle, a))
            .collect();
        self.write_states(plan, |e, row| match (alive.get(&e.handle), e.kind) {
            (Some(_), EntryKind::Prefill { start, .. }) => Some(start + row + 1),
            (Some(&a), EntryKind::Decode { committed }) if row <= a as usize => Some(committed + row + 1),
            _ => None, // aborted before commit, or a rejected row
        });
        let live: Vec<_> = plan.entries.iter().zip(accepted).filter(|(e, _)| before.contains_key(&e.handle)).collect();
        assert_eq!(out.handles.len(), live.len(), "one result per still-live planned request");
        // Acceptance: what each still-live decode entry proposed and accepted.
        let decoded: Vec<(u64, usize, usize)> = live
            .iter()
            .filter(|(e, _)| matches!(e.kind, EntryKind::Decode { .. }))
            .map(|(e, &a)| (e.handle, e.num_drafts(), a as usize))
            .collect();
        self.dl.commit(&decoded);
        // What the step wrote, in the model's terms (the committed tokens are known after the loop).
        let rows: HashMap<u64, Vec<(i64, RowContent)>> = Self::rows(plan).into_iter().collect();
        for (h, rs) in &rows {
            if !before.contains_key(h) {
                for (slot, _) in rs {
                    self.content.insert(*slot, None); // aborted before commit
                }
            }
        }
        for (i, (e, &a)) in live.into_iter().enumerate() {
            let h = out.handles[i];
            assert_eq!(h, e.handle);
            let new_tokens: Vec<u32> =
                out.tokens[out.offsets[i] as usize..out.offsets[i + 1] as usize].iter().map(|&t| t as u32).collect();
            let m = self.model.get_mut(&h).unwrap();
            let s = &sampled[e.sample_start..e.sample_start + e.num_samples];
            let offered: Vec<u32> = match e.kind {
                EntryKind::Prefill { sample: true, .. } => vec![s[0]],
                EntryKind::Prefill { .. } => vec![],
                EntryKind::Decode { .. } => s[..a as usize + 1].to_vec(),
            };
            let mut expect = Vec::new();
            let mut finish = None;
            for t in offered {
                expect.push(t);
                m.tokens.push(t);
                if m.stop.contains(&t) {
                    finish = Some(FinishReason::Stop);
                    break;
                }
                if m.tokens.len() - m.prompt_len >= m.max_tokens {
                    finish = Some(FinishReason::Length);
                    break;
                }
            }
            assert_eq!(new_tokens, expect);
            assert_eq!(FinishReason::from_code(out.finish[i]), finish);
            // The rows' KV: a prefill row holds its known token's prefix; verify row i holds
            // the committed token's prefix iff the commit kept row i (a request finished
            // mid-block keeps the rows up to its last committed token), else garbage.
            let tokens = &m.tokens;
            let committed_now = tokens.len() - 1;
            for &(slot, c) in &rows[&h] {
                let pos = match c {
                    RowContent::Known(pos) => Some(pos),
                    RowContent::Verify { committed, i } => Some(committed + i).filter(|&p| p < committed_now),
                };
                self.content.insert(slot, pos.map(|p| tokens[..=p].to_vec()));
            }
            if finish.is_some() {
                let m = self.model.remove(&h).unwrap();
                assert!(self.s.request(h).is_none() && self.s.handle_of(&m.id).is_none());
                continue;
            }
            // Committed grows by exactly accepted + 1 per verify step.
            if let ((Phase::Decoding, c0), (Phase::Decoding, c1)) = (before[&h], self.state(h)) {
                assert_eq!(c1, c0 + a as usize + 1);
            }
        }
        self.check();
    }

    fn abort(&mut self, pick: usize) {
        let handles = self.s.handles();
        if handles.is_empty() {
            return;
        }
        let h = handles[pick % handles.len()];
        self.s.finish(h, FinishReason::Abort).unwrap();
        self.model.remove(&h);
        self.check();
    }
}

fn run(ops: Vec<Op>, num_pages: usize, k: usize, budget: usize, weak_hash: bool) {
    run_with(ops, num_pages, k, budget, weak_hash, Vec::new(), 0)
}

fn run_with(
    ops: Vec<Op>,
    num_pages: usize,
    k: usize,
    budget: usize,
    weak_hash: bool,
    schedule: Vec<(usize, usize)>,
    draft_block_rows: usize,
) {
    let policy = if schedule.is_empty() { DraftLenPolicy::Fixed } else { DraftLenPolicy::Schedule(schedule) };
    run_policy(ops, num_pages, k, budget, weak_hash, policy, draft_block_rows, None, false);
}

/// Step costs handed to the core before operation `at` (or before draining): buckets and
/// `seconds[bucket][k]` for k = 0..=K.
type CostsAt = (usize, Vec<usize>, Vec<Vec<f64>>);

/// Returns the K of every planned step with decoding requests.
#[allow(clippy::too_many_arguments)]
fn run_policy(
    ops: Vec<Op>,
    num_pages: usize,
    k: usize,
    budget: usize,
    weak_hash: bool,
    policy: DraftLenPolicy,
    draft_block_rows: usize,
    costs: Option<CostsAt>,
    skew: bool,
) -> Vec<usize> {
    run_full(ops, num_pages, k, budget, weak_hash, policy, draft_block_rows, costs, skew, false, None)
}

/// `run_policy` for a hybrid target too (`state_slots`: recurrent-state slots from the pool,
/// prefix caching off).
#[allow(clippy::too_many_arguments)]
fn run_full(
    ops: Vec<Op>,
    num_pages: usize,
    k: usize,
    budget: usize,
    weak_hash: bool,
    policy: DraftLenPolicy,
    draft_block_rows: usize,
    costs: Option<CostsAt>,
    skew: bool,
    state_slots: bool,
    mixed: Option<MixedStepLimit>,
) -> Vec<usize> {
    let cfg = SchedulerConfig {
        num_pages,
        page_size: 4,
        max_num_seqs: 6,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        num_speculative_tokens: k,
        mask_token_id: 1,
        enable_prefix_caching: !state_slots,
        draft_len_policy: policy,
        draft_block_rows,
        state_slots,
    };
    let adaptive_policy = matches!(cfg.draft_len_policy, DraftLenPolicy::Adaptive { .. });
    let mut s = Scheduler::new(cfg).unwrap();
    s.set_mixed_step_limit(mixed).unwrap();
    if weak_hash {
        // Four hash values in all: nearly every lookup and publication meets a collision.
        s.pool().set_hash_fn(|_, parent, toks| (parent + toks.iter().map(|&t| t as u64).sum::<u64>()) % 4);
    }
    let reserve = (k + 1).max(draft_block_rows);
    let mut dl = DraftLenRef::new(k, adaptive_policy);
    dl.skew = skew;
    let mut h = Harness {
        s,
        dl,
        model: HashMap::new(),
        content: HashMap::new(),
        next_id: 0,
        b: k + 1,
        reserve,
        ps: 4,
        state: HashMap::new(),
    };
    let mut costs = costs;
    let mut hand_over_costs = |h: &mut Harness, now: bool| {
        if let Some((_, buckets, seconds)) = costs.take_if(|c| now || c.0 == 0) {
            let step_costs = StepCosts::new(buckets.clone(), (0..=k).collect(), seconds.clone()).unwrap();
            h.s.set_step_costs(step_costs).unwrap();
            h.dl.costs = Some((buckets, seconds));
        }
        if let Some(c) = costs.as_mut() {
            c.0 -= 1;
        }
    };
    for op in ops {
        hand_over_costs(&mut h, false);
        match op {
            Op::Add { family, shared, own, max_tokens, stop } => h.add_family(family, shared, own, max_tokens, stop),
            Op::AddFollowUp { pick, own, max_tokens } => h.add_follow_up(pick, own, max_tokens),
            Op::Step { seed } => {
                if let Some((t, p, a, s)) = h.plan(seed) {
                    h.commit(t, &p, &a, &s);
                }
            }
            Op::Abort { pick } => h.abort(pick),
            Op::StepThenAbortBeforeCommit { seed, pick } => {
                let Some((t, p, a, s)) = h.plan(seed) else {
                    continue;
                };
                // An abort between schedule and commit: the others still commit.
                let victim = p.entries[pick % p.entries.len()].handle;
                h.s.finish(victim, FinishReason::Abort).unwrap();
                h.model.remove(&victim);
                h.check();
                // A refused commit changes nothing and returns the ticket.
                let snapshot: Vec<(u64, Vec<u32>)> =
                    h.model.keys().map(|k| (*k, h.s.request(*k).unwrap().tokens().to_vec())).collect();
                let cached = h.s.pool().num_cached();
                let mut too_many = a.clone();
                too_many[0] = p.entries[0].num_drafts() as u32 + 1;
                let refused = h.s.commit(t, &too_many, &s).unwrap_err();
                assert!(matches!(refused.error, CoreError::InvalidCommit(_)));
                for (k, toks) in snapshot {
                    assert_eq!(h.s.request(k).unwrap().tokens(), &toks[..], "a refused commit changed state");
                }
                assert_eq!(h.s.pool().num_cached(), cached, "a refused commit published pages");
                h.commit(refused.ticket, &p, &a, &s);
            }
            Op::StepThenCancel { seed } => {
                if let Some((t, p, _, _)) = h.plan(seed) {
                    let cached = h.s.pool().num_cached();
                    h.s.cancel(t).unwrap();
                    assert_eq!(h.s.outstanding_step(), None);
                    assert_eq!(h.s.pool().num_cached(), cached, "a cancelled step published pages");
                    h.scribble(&p);
                    h.check();
                }
            }
        }
    }
    hand_over_costs(&mut h, true);
    // Drain: everything finishes (max_tokens bounds it) and the pool is full again.
    for i in 0..10_000u64 {
        if h.s.num_live() == 0 {
            break;
        }
        if let Some((t, p, a, s)) = h.plan(i) {
            h.commit(t, &p, &a, &s);
        }
    }
    assert_eq!(h.s.num_live(), 0, "requests left after draining");
    assert_eq!(h.s.num_free_pages(), num_pages - 1, "pool not full after all requests finished");
    assert!(h.s.prefix_cache_hits() <= h.s.prefix_cache_queries());
    h.s.pool().check_integrity().unwrap();
    // Every planned step with decoding requests is counted under its K.
    for (kk, n) in h.s.draft_len().counts() {
        assert_eq!(n as usize, h.dl.chosen.iter().filter(|&&c| c == kk).count(), "steps counted under k = {kk}");
    }
    assert_eq!(h.s.draft_len().counts().iter().map(|&(_, n)| n as usize).sum::<usize>(), h.dl.chosen.len());
    h.dl.chosen
}

/// A random Adaptive setup for K = k: candidates (k always among them), cost buckets, a cost
/// table with random seconds per (bucket, k), and when to hand it over.
fn adaptive_case(k: usize) -> impl Strategy<Value = (Vec<usize>, CostsAt)> {
    (
        prop::collection::vec(any::<bool>(), k),
        prop::sample::subsequence(vec![1usize, 2, 3, 4, 6, 8], 1..=6),
        prop::collection::vec(prop::collection::vec(0.05f64..4.0, k + 1), 6),
        0usize..80,
    )
        .prop_map(move |(mask, buckets, rows, at)| {
            let candidates: Vec<usize> = (0..k).filter(|&j| mask[j]).chain([k]).collect();
            let seconds = rows[..buckets.len()].to_vec();
            (candidates, (at, buckets, seconds))
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn speculative_under_page_pressure(ops in prop::collection::vec(op(), 1..120), pages in 8usize..40) {
        run(ops, pages, 3, 24, false);
    }

    #[test]
    fn plain_decode_small_budget(ops in prop::collection::vec(op(), 1..120), pages in 20usize..40) {
        run(ops, pages, 0, 5, false);
    }

    #[test]
    fn wide_blocks(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, 48, 15, 64, false);
    }

    #[test]
    fn draft_len_schedule_under_page_pressure(ops in prop::collection::vec(op(), 1..120), pages in 8usize..40) {
        // 7 drafts alone, 4 with two or three decoding, 2 with four or more.
        run_with(ops, pages, 7, 32, false, vec![(1, 7), (3, 4), (5, 2)], 0);
    }

    #[test]
    fn draft_block_longer_than_the_verify_block(ops in prop::collection::vec(op(), 1..120), pages in 8usize..40) {
        // K = 3 verified of an 8-row draft block; and a schedule under a 16-row draft block.
        run_with(ops.clone(), pages, 3, 24, false, Vec::new(), 8);
        run_with(ops, pages + 8, 7, 32, false, vec![(1, 7), (3, 4), (5, 2)], 16);
    }

    #[test]
    fn adaptive_draft_len_under_page_pressure(
        ops in prop::collection::vec(op(), 1..120),
        pages in 8usize..40,
        (candidates, costs) in adaptive_case(3),
        (candidates7, costs7) in adaptive_case(7),
    ) {
        let adaptive = |candidates: Vec<usize>| DraftLenPolicy::Adaptive { candidates };
        let first = run_policy(ops.clone(), pages, 3, 24, false, adaptive(candidates.clone()), 0, Some(costs.clone()), true);
        let again = run_policy(ops.clone(), pages, 3, 24, false, adaptive(candidates), 0, Some(costs), true);
        prop_assert_eq!(first, again, "the same operations chose different draft lengths");
        // K = 7 under a 16-row draft block, costs from the start or later.
        run_policy(ops, pages + 8, 7, 32, false, adaptive(candidates7), 16, Some(costs7), true);
    }

    #[test]
    fn hybrid_state_slots_under_page_pressure(
        ops in prop::collection::vec(op(), 1..120),
        pages in 12usize..44,
        (candidates, costs) in adaptive_case(3),
    ) {
        let fixed = DraftLenPolicy::Fixed;
        // Fixed K = 3 (5 slots a decoding request), plain decode (2 slots), a longer draft
        // block, and the adaptive policy (B = 1 steps included).
        run_full(ops.clone(), pages, 3, 24, false, fixed.clone(), 0, None, false, true, None);
        run_full(ops.clone(), pages, 0, 5, false, fixed.clone(), 0, None, false, true, None);
        run_full(ops.clone(), pages + 8, 3, 24, false, fixed, 8, None, false, true, None);
        let adaptive = DraftLenPolicy::Adaptive { candidates };
        run_full(ops, pages, 3, 24, false, adaptive, 0, Some(costs), true, true, None);
    }

    #[test]
    fn mixed_step_limit_under_page_pressure(
        ops in prop::collection::vec(op(), 1..120),
        pages in 8usize..40,
        tokens in 1usize..12,
        requests in 1usize..4,
        (candidates, costs) in adaptive_case(3),
    ) {
        let limit = Some(MixedStepLimit { tokens, requests });
        run_full(ops.clone(), pages, 3, 24, false, DraftLenPolicy::Fixed, 0, None, false, false, limit);
        run_full(ops.clone(), pages, 0, 5, false, DraftLenPolicy::Fixed, 0, None, false, false, limit);
        run_full(ops.clone(), pages + 8, 3, 24, false, DraftLenPolicy::Adaptive { candidates }, 8, Some(costs), true, false, limit);
        run_full(ops, pages + 4, 3, 24, false, DraftLenPolicy::Fixed, 0, None, false, true, limit);
    }

    #[test]
    fn colliding_hashes_only_cost_hits(ops in prop::collection::vec(op(), 1..120), pages in 10usize..40) {
        run(ops, pages, 3, 16, true);
    }
}

/// A reproducible check that the harness sees hits at all (the properties above would
/// pass vacuously if nothing were ever shared).
#[test]
fn shared_prefixes_hit_in_the_harness() {
    let ops = vec![
        Op::Add { family: 0, shared: 30, own: 2, max_tokens: 4, stop: false },
        Op::Step { seed: 1 },
        Op::Add { family: 0, shared: 30, own: 3, max_tokens: 4, stop: false },
        Op::Add { family: 1, shared: 20, own: 0, max_tokens: 4, stop: false },
        Op::Step { seed: 2 },
        Op::AddFollowUp { pick: 0, own: 2, max_tokens: 3 },
        Op::Step { seed: 3 },
        Op::Step { seed: 4 },
    ];
    let cfg = SchedulerConfig {
        num_pages: 40,
        page_size: 4,
        max_num_seqs: 6,
        max_num_batched_tokens: 64,
        max_model_len: 64,
        num_speculative_tokens: 3,
        mask_token_id: 1,
        enable_prefix_caching: true,
        draft_len_policy: DraftLenPolicy::Fixed,
        draft_block_rows: 0,
        state_slots: false,
    };
    let mut h = Harness {
        s: Scheduler::new(cfg).unwrap(),
        dl: DraftLenRef::new(3, false),
        model: HashMap::new(),
        content: HashMap::new(),
        next_id: 0,
        b: 4,
        reserve: 4,
        ps: 4,
        state: HashMap::new(),
    };
    for op in ops {
        match op {
            Op::Add { family, shared, own, max_tokens, stop } => h.add_family(family, shared, own, max_tokens, stop),
            Op::AddFollowUp { pick, own, max_tokens } => h.add_follow_up(pick, own, max_tokens),
            Op::Step { seed } => {
                if let Some((t, p, a, s)) = h.plan(seed) {
                    h.commit(t, &p, &a, &s);
                }
            }
            _ => unreachable!(),
        }
    }
    // Second request: 7 pages of family 0; third: page 0 holds 4 of the 6 common tokens, page 1
    // diverges at token 6; the follow-up shares everything its parent committed.
    assert!(h.s.prefix_cache_hits() >= 28 + 4, "hits: {}", h.s.prefix_cache_hits());
}

/// The Adaptive property above would pass vacuously if every step drafted K: with a cost
/// table where drafting pays only for good acceptance, these operations see several k's.
#[test]
fn adaptive_harness_sees_several_draft_lengths() {
    let mut ops = Vec::new();
    for i in 0..12 {
        ops.push(Op::Add { family: i % 3, shared: 0, own: 3, max_tokens: 20, stop: false });
        ops.extend((0..6).map(|s| Op::Step { seed: i as u64 * 10 + s }));
    }
    let seconds = vec![vec![1.0, 1.6, 1.9, 2.2], vec![1.0, 1.8, 2.4, 3.0]];
    let policy = DraftLenPolicy::Adaptive { candidates: vec![0, 1, 2, 3] };
    let chosen = run_policy(ops, 60, 3, 64, false, policy, 0, Some((0, vec![1, 4], seconds)), true);
    let seen: std::collections::BTreeSet<usize> = chosen.iter().copied().collect();
    assert!(seen.contains(&0) && seen.contains(&3) && seen.len() >= 3, "chosen: {chosen:?}");
}
