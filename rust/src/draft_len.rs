//! Draft length: how many drafts K a decode step proposes and verifies (B = K + 1).
//!
//! The policy is an input to the core (ARCHITECTURE.md): the scheduler asks [`DraftLen`] for
//! each step's K and tells it, at every commit, what each decoding request accepted.
//!
//! - [`DraftLenPolicy::Fixed`]: always `num_speculative_tokens` (K_max);
//! - [`DraftLenPolicy::Schedule`]: K keyed on the number of decoding requests ([`draft_len_for`]);
//! - [`DraftLenPolicy::Adaptive`]: each step, the candidate k that maximises expected committed
//!   tokens per second, `Σ_i E_i[tokens | k] / cost(bucket(n), k)` over the step's n decoding
//!   requests, with `E_i[tokens | k] = 1 + Σ_{j=1..k} Π_{m≤j} p_{i,m}` and the step costs
//!   measured by the runner ([`StepCosts`]); k = 0 is a plain decode step (B = 1, no draft
//!   pass). Before costs are set it drafts K_max.
//!
//! Acceptance is measured live: `p_j` = P(draft j accepted | drafts 1..j-1 were). A request that
//! was proposed `d` drafts and accepted `a` tells: positions 1..a accepted, position a+1 rejected
//! if a < d, nothing past a+1. Counts decay exponentially: the global ones by [`GLOBAL_DECAY`]
//! per committed step with decoding requests, applied when a step that drafted is committed (a
//! step with k = 0 learns nothing and leaves the estimates as they are: were they aged at once,
//! a stretch of plain steps would pull them back to the prior, and a prior below the break-even
//! of the measured costs would keep the policy from drafting on traffic whose measured
//! acceptance pays; aged at the next drafting step, the counts from before a long stretch of
//! plain steps weigh little beside what that step measures, so an exploring step after the
//! traffic changed, chat to code say, is heard: aged only per drafting step, a CPU engine that
//! served chat stayed at K = 0 on HumanEval, 0.69-0.78x of K = 3), a request's own once per
//! step of that request (so that a request that stopped drafting after a bad stretch returns
//! to the global estimate). After
//! [`EXPLORE_AFTER`] plain steps in a row one step drafts: how the estimates learn that traffic
//! changed while nothing was drafted. Every [`PROBE_EVERY`]-th step drafts the runner-up
//! when it is within [`PROBE_WITHIN`] of the best: its measured cost refines the table. After
//! [`PLAIN_AFTER`] drafting steps in a row one step is plain: its cost gets measured too.
//!
//! ```text
//!   global   g_j   = (accepts_j + W·prior_j) / (trials_j + W)        prior_1 = PRIOR_FIRST,
//!                                                                    prior_j = PRIOR_DECAY·g_{j-1}
//!   request  p_i,j = w·accepts_i,j/trials_i,j + (1 - w)·g_j          w = trials_i,j / (trials_i,j + N0)
//! ```
//!
//! Calibration: the estimates are noisy (a request's own history is a few steps), and a choice
//! that takes the best of several candidates picks the ones whose estimate ran high (a streak of
//! full acceptances makes every p_i,j of a request high at once, and the deep positions' product
//! of them most of all): measured on an H100, the policy chose K = 15 over K = 7 on 79% of the
//! steps of HumanEval at c = 32, where K = 15's extra drafts bought 5% more tokens for 12% more
//! time. So each committed step also records, per draft position j, the probability the
//! estimates gave its requests of accepting through j (`r_i,j = Π_{m≤j} p_i,m`, summed over the
//! requests that proposed j) and how many did, over the requests that have a history of their
//! own (a request's first step is predicted from the global estimates or the prior alone); the
//! sums decay by [`CALIBRATION_DECAY`] per committed step (aged like the global counts), and the
//! choice scales each position's term by `c_j = (reached + C) / (predicted + C)`
//! (C = [`CALIBRATION_PRIOR`]): `E[step tokens | K] = n + Σ_i Σ_{j≤K} c_j · r_i,j`. Per position,
//! not per K: a factor per K also scaled the positions that K = 7 and K = 15 share, so it could
//! turn a choice between them on positions 1..7 (replayed offline over HumanEval and chat traces,
//! bench/replay_draft_len.py, it lost 6% at batch 1 where the per-position factor lost nothing).
//!
//! Invariants (`check`, called by `Scheduler::check_invariants`): every count is finite,
//! non-negative, accepts <= trials (calibration sums: finite, non-negative); per-request counts
//! exist only for live requests (the scheduler forgets a request when it leaves); every estimate lies in [0, 1]. The choice is a
//! pure function of the history, the costs and the step's decoding requests (no RNG, no clock).

use std::collections::HashMap;

use crate::error::{CoreError, CoreResult};

/// Global counts decay by this factor once per committed step with decoding requests (plain
/// steps' aging applied at the next drafting step): a half-life of ~34 steps, enough samples at
/// batch 1, quick to follow a new workload.
pub const GLOBAL_DECAY: f64 = 0.98;
/// A request's counts decay by this factor once per step of that request (half-life ~7
/// steps): acceptance follows what the request is writing now (code, prose, a list).
pub const REQUEST_DECAY: f64 = 0.9;
/// W: pseudo-observations of the prior in a global estimate.
pub const PRIOR_WEIGHT: f64 = 2.0;
/// N0: a request's own estimate gets weight n / (n + N0) after n (decayed) observations.
pub const REQUEST_PRIOR_WEIGHT: f64 = 2.0;
/// Prior of p_1 before anything was observed.
pub const PRIOR_FIRST: f64 = 0.6;
/// Prior of p_j (j > 1): this factor times the estimate of p_{j-1}.
pub const PRIOR_DECAY: f64 = 0.9;
/// After this many consecutive steps that drafted nothing, times the cost of the best drafting
/// step over a plain one, the next step drafts the best k > 0 once: a step with k = 0 learns
/// nothing, so an estimate that is too pessimistic (or a noisy cost table) would otherwise
/// never be corrected. Costs at most ~1/65 of the time.
pub const EXPLORE_AFTER: u64 = 64;
/// Every PROBE_EVERY-th planned step with decoding requests drafts the runner-up (the
/// candidate with the second-highest expected rate) instead of the best, if the runner-up's
/// rate is at least PROBE_WITHIN of the best. The runner times every pure-decode step and
/// folds those times into the cost table (python: worker/step_costs.py LiveCosts), so the
/// cells next to the optimum are measured on the live traffic (its contexts, its batch) and
/// not only estimated from the startup probe: a cell whose startup cost was off gets
/// corrected, and the choice flips when the measurement says so. What a probe can cost while
/// the table is right is bounded: (1 - PROBE_WITHIN) / PROBE_EVERY of the rate (0.3%).
pub const PROBE_EVERY: u64 = 32;
/// After this many consecutive steps that drafted, the next step (if it has decoding
/// requests and 0 is a candidate) is a plain one: the mirror of [`EXPLORE_AFTER`]. A plain
/// step's cost is estimated from the drafting steps while none runs (their measured/startup
/// ratio), which overstates it where drafting runs slower live than in the startup probe (a
/// CPU): the policy would then never plain-step again. One plain step in 129 gets it measured;
/// it loses at most that step's expected gain from drafting.
pub const PLAIN_AFTER: u64 = 128;
pub const PROBE_WITHIN: f64 = 0.9;
/// The calibration sums decay by this factor once per committed step with decoding requests
/// (a plain stretch's aging applied at the next drafting step; half-life ~69 steps).
pub const CALIBRATION_DECAY: f64 = 0.99;
/// C: pseudo-observations at ratio 1 in a position's calibration factor (a position with few
/// observations keeps ~1).
pub const CALIBRATION_PRIOR: f64 = 16.0;

/// Drafts of a step with `num_decoding` decoding requests under a draft-length schedule of
/// `(max_decoding, k)` pairs (ascending): the k of the first pair with num_decoding <=
/// max_decoding, past the last pair its k; no schedule: `k_max`. The one place this rule is
/// written (exported to Python, which captures CUDA graphs per block length by it).
pub fn draft_len_for(schedule: &[(usize, usize)], k_max: usize, num_decoding: usize) -> usize {
    match schedule.iter().find(|&&(max_n, _)| num_decoding <= max_n) {
        Some(&(_, k)) => k,
        None => schedule.last().map_or(k_max, |&(_, k)| k),
    }
}

/// How each step's K is chosen (`SchedulerConfig::draft_len_policy`).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum DraftLenPolicy {
    /// Always `num_speculative_tokens`.
    #[default]
    Fixed,
    /// `(max_decoding, k)` pairs, ascending in `max_decoding` ([`draft_len_for`]); every k in
    /// 1..=num_speculative_tokens.
    Schedule(Vec<(usize, usize)>),
    /// The candidate with the most expected committed tokens per second; candidates are
    /// distinct, within 0..=num_speculative_tokens, and include num_speculative_tokens.
    Adaptive { candidates: Vec<usize> },
}

impl DraftLenPolicy {
    pub fn name(&self) -> &'static str {
        match self {
            DraftLenPolicy::Fixed => "fixed",
            DraftLenPolicy::Schedule(_) => "schedule",
            DraftLenPolicy::Adaptive { .. } => "adaptive",
        }
    }

    /// K of a step with `num_decoding` decoding requests when it depends on nothing else
    /// (Fixed, Schedule); `None` for Adaptive.
    pub fn static_draft_len(&self, k_max: usize, num_decoding: usize) -> Option<usize> {
        match self {
            DraftLenPolicy::Fixed => Some(k_max),
            DraftLenPolicy::Schedule(s) => Some(draft_len_for(s, k_max, num_decoding)),
            DraftLenPolicy::Adaptive { .. } => None,
        }
    }

    /// Every K this policy can choose, ascending.
    pub fn choices(&self, k_max: usize) -> Vec<usize> {
        let mut ks = match self {
            DraftLenPolicy::Fixed => vec![k_max],
            DraftLenPolicy::Schedule(s) if s.is_empty() => vec![k_max],
            DraftLenPolicy::Schedule(s) => s.iter().map(|&(_, k)| k).collect(),
            DraftLenPolicy::Adaptive { candidates } => candidates.clone(),
        };
        ks.sort_unstable();
        ks.dedup();
        ks
    }

    pub(crate) fn validate(&self, k_max: usize) -> Result<(), String> {
        match self {
            DraftLenPolicy::Fixed => Ok(()),
            DraftLenPolicy::Schedule(s) => {
                if !s.is_empty() && k_max == 0 {
                    return Err("draft_len_schedule needs speculation (num_speculative_tokens >= 1)".into());
                }
                if s.windows(2).any(|w| w[0].0 >= w[1].0) {
                    return Err(format!("draft_len_schedule must be ascending in batch size, got {s:?}"));
                }
                match s.iter().find(|&&(_, k)| k == 0 || k > k_max) {
                    Some(&(n, k)) => Err(format!("draft_len_schedule entry ({n}, {k}): k must be in 1..={k_max}")),
                    None => Ok(()),
                }
            }
            DraftLenPolicy::Adaptive { candidates } => {
                if k_max == 0 {
                    return Err(
                        "the adaptive draft-length policy needs speculation (num_speculative_tokens >= 1)".into()
                    );
                }
                if let Some(k) = candidates.iter().find(|&&k| k > k_max) {
                    return Err(format!("draft-length candidate {k} is past num_speculative_tokens ({k_max})"));
                }
                if !candidates.contains(&k_max) {
                    return Err(format!(
                        "draft-length candidates {candidates:?} must include num_speculative_tokens ({k_max})"
                    ));
                }
                if self.choices(k_max).len() != candidates.len() {
                    return Err(format!("draft-length candidates {candidates:?} repeat a value"));
                }
                Ok(())
            }
        }
    }
}

/// Measured seconds of a decode step, per (batch bucket, k); a step with n decoding requests
/// costs what the smallest bucket >= n costs (what the CUDA graphs pad to), past the largest
/// bucket what the largest costs (the choice compares k's within one n: a common factor
/// would not change it).
#[derive(Debug, Clone, PartialEq)]
pub struct StepCosts {
    /// Ascending batch sizes, each >= 1.
    buckets: Vec<usize>,
    /// Measured k's, ascending.
    ks: Vec<usize>,
    /// `seconds[b][j]`: bucket `buckets[b]`, `ks[j]` drafts; finite and > 0.
    seconds: Vec<Vec<f64>>,
}

impl StepCosts {
    pub fn new(buckets: Vec<usize>, ks: Vec<usize>, seconds: Vec<Vec<f64>>) -> CoreResult<Self> {
        let bad = |m: String| Err(CoreError::InvalidConfig(format!("step costs: {m}")));
        if buckets.is_empty() || ks.is_empty() {
            return bad("need at least one batch bucket and one k".into());
        }
        if buckets[0] == 0 || buckets.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!("batch buckets must be >= 1 and strictly ascending, got {buckets:?}"));
        }
        if ks.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!("k's must be strictly ascending, got {ks:?}"));
        }
        if seconds.len() != buckets.len() {
            return bad(format!("{} rows of seconds for {} buckets", seconds.len(), buckets.len()));
        }
        for (row, &n) in seconds.iter().zip(&buckets) {
            if row.len() != ks.len() {
                return bad(format!("bucket {n}: {} costs for {} k's", row.len(), ks.len()));
            }
            if let Some((&k, &c)) = ks.iter().zip(row).find(|&(_, &c)| !(c.is_finite() && c > 0.0)) {
                return bad(format!("bucket {n}, k {k}: cost {c} must be finite and > 0 seconds"));
            }
        }
        Ok(StepCosts { buckets, ks, seconds })
    }

    /// Index of the bucket a step with `n` decoding requests runs in.
    fn bucket_index(&self, n: usize) -> usize {
        self.buckets.iter().position(|&b| b >= n).unwrap_or(self.buckets.len() - 1)
    }

    /// Seconds of a step with `n` decoding requests drafting `k`, if k was measured.
    pub fn cost(&self, n: usize, k: usize) -> Option<f64> {
        let j = self.ks.iter().position(|&x| x == k)?;
        Some(self.seconds[self.bucket_index(n)][j])
    }

    pub fn ks(&self) -> &[usize] {
        &self.ks
    }
}

/// Exponentially decayed per-position counts. Index j - 1 holds position j.
#[derive(Debug, Clone, PartialEq)]
struct Counts {
    /// Drafts proposed at position j when 1..j-1 were accepted (the denominator of p_j).
    trials: Vec<f64>,
    accepts: Vec<f64>,
}

impl Counts {
    fn new(k_max: usize) -> Self {
        Counts { trials: vec![0.0; k_max], accepts: vec![0.0; k_max] }
    }

    fn decay(&mut self, factor: f64) {
        self.trials.iter_mut().chain(self.accepts.iter_mut()).for_each(|x| *x *= factor);
    }

    /// `num_drafts` proposed, `accepted` of them accepted (the leading ones).
    fn observe(&mut self, num_drafts: usize, accepted: usize) {
        let seen = (accepted + 1).min(num_drafts);
        for j in 0..seen {
            self.trials[j] += 1.0;
            if j < accepted {
                self.accepts[j] += 1.0;
            }
        }
    }

    fn check(&self) -> Result<(), String> {
        for (j, (&n, &a)) in self.trials.iter().zip(&self.accepts).enumerate() {
            if !(n.is_finite() && a.is_finite() && a >= 0.0 && a <= n + 1e-9) {
                return Err(format!("position {}: accepts {a} of trials {n}", j + 1));
            }
        }
        Ok(())
    }
}

/// The draft-length policy with its live state: acceptance estimates, step costs, counters.
#[derive(Debug, Clone)]
pub struct DraftLen {
    policy: DraftLenPolicy,
    k_max: usize,
    global: Counts,
    /// Requests with at least one decode step committed; removed when the request leaves.
    requests: HashMap<u64, Counts>,
    costs: Option<StepCosts>,
    /// `chosen[k]`: planned steps with decoding requests that drafted k.
    chosen: Vec<u64>,
    /// Planned steps with decoding requests since the last one that drafted (EXPLORE_AFTER).
    zero_run: u64,
    /// Planned steps with decoding requests (PROBE_EVERY).
    planned: u64,
    /// Planned steps with decoding requests since the last one that drafted nothing (PLAIN_AFTER).
    draft_run: u64,
    /// `calibration[j - 1]`: decayed (predicted, observed) acceptances through position j of
    /// the committed steps' requests that proposed j.
    calibration: Vec<(f64, f64)>,
    /// Committed steps with decoding requests since the last one that drafted: the global
    /// counts' aging still owed (applied by the next drafting step).
    plain_since: i32,
}

impl DraftLen {
    /// `policy` must have passed validation against `k_max` (the scheduler's config does it).
    pub fn new(policy: DraftLenPolicy, k_max: usize) -> Self {
        DraftLen {
            policy,
            k_max,
            global: Counts::new(k_max),
            requests: HashMap::new(),
            costs: None,
            chosen: vec![0; k_max + 1],
            zero_run: 0,
            planned: 0,
            draft_run: 0,
            calibration: vec![(0.0, 0.0); k_max],
            plain_since: 0,
        }
    }

    pub fn policy(&self) -> &DraftLenPolicy {
        &self.policy
    }

    /// Hand over the measured step costs (once, at startup; a later call replaces them).
    /// Every k must be within 0..=K_max; under Adaptive every candidate must be measured.
    pub fn set_step_costs(&mut self, costs: StepCosts) -> CoreResult<()> {
        if let Some(&k) = costs.ks.iter().find(|&&k| k > self.k_max) {
            return Err(CoreError::InvalidConfig(format!(
                "step costs: k {k} is past num_speculative_tokens ({})",
                self.k_max
            )));
        }
        if let DraftLenPolicy::Adaptive { candidates } = &self.policy {
            if let Some(k) = candidates.iter().find(|k| !costs.ks.contains(k)) {
                return Err(CoreError::InvalidConfig(format!(
                    "step costs: candidate k {k} was not measured (measured: {:?})",
                    costs.ks
                )));
            }
        }
        self.costs = Some(costs);
        Ok(())
    }

    pub fn step_costs(&self) -> Option<&StepCosts> {
        self.costs.as_ref()
    }

    /// K for a step whose decoding requests are `decoding` (in plan order).
    pub fn choose(&self, decoding: &[u64]) -> usize {
        if let Some(k) = self.policy.static_draft_len(self.k_max, decoding.len()) {
            return k;
        }
        let (DraftLenPolicy::Adaptive { candidates }, Some(costs)) = (&self.policy, &self.costs) else {
            return self.k_max;
        };
        if decoding.is_empty() {
            return self.k_max;
        }
        // tokens[k] = n + Σ_i Σ_{j≤k} c_j · r_i,j, for k = 0..=K_max.
        let g = self.global_estimates();
        let c: Vec<f64> = (1..=self.k_max).map(|j| self.calibration(j)).collect();
        let mut reach = vec![0.0; self.k_max]; // Σ_i r_i,j
        for &h in decoding {
            let mut r = 1.0;
            for (j, p) in self.request_estimates_with(&g, h).into_iter().enumerate() {
                r *= p;
                reach[j] += r;
            }
        }
        let n = decoding.len();
        let mut tokens = Vec::with_capacity(self.k_max + 1);
        tokens.push(n as f64);
        for j in 0..self.k_max {
            tokens.push(tokens[j] + c[j] * reach[j]);
        }
        if self.draft_run >= PLAIN_AFTER && candidates.contains(&0) {
            return 0;
        }
        let explore = self.zero_run >= EXPLORE_AFTER;
        let probe = self.planned % PROBE_EVERY == PROBE_EVERY - 1;
        let mut best = (f64::NEG_INFINITY, self.k_max);
        let mut second = (f64::NEG_INFINITY, self.k_max);
        let mut best_drafting = (f64::NEG_INFINITY, self.k_max);
        let mut ks = candidates.clone();
        ks.sort_unstable();
        for k in ks {
            let rate = tokens[k] / costs.cost(n, k).expect("candidates are measured (set_step_costs)");
            // Strictly better only: a tie goes to the shorter block.
            if rate > best.0 {
                second = best;
                best = (rate, k);
            } else if rate > second.0 {
                second = (rate, k);
            }
            if k > 0 && rate > best_drafting.0 {
                best_drafting = (rate, k);
            }
        }
        // The run of plain steps before a drafting one scales with what that step costs
        // over a plain one: exploring spends at most ~1/EXPLORE_AFTER of the time, not of the
        // steps (a drafting step of a batch on a CPU costs 3-4 plain ones).
        let explore = explore && {
            let ratio = costs.cost(n, best_drafting.1).zip(costs.cost(n, 0)).map_or(1.0, |(d, p)| d / p);
            self.zero_run as f64 >= EXPLORE_AFTER as f64 * ratio.max(1.0)
        };
        if best.1 == 0 && explore && best_drafting.0.is_finite() {
            return best_drafting.1;
        }
        if probe && second.0 >= PROBE_WITHIN * best.0 {
            return second.1;
        }
        best.1
    }

    /// Counts a planned step with decoding requests that drafts `k`.
    pub(crate) fn record_choice(&mut self, k: usize) {
        self.chosen[k] += 1;
        self.zero_run = if k == 0 { self.zero_run + 1 } else { 0 };
        self.planned += 1;
        self.draft_run = if k > 0 { self.draft_run + 1 } else { 0 };
    }

    /// Learn from one committed step: `(handle, drafts proposed, drafts accepted)` of each of
    /// its decoding requests still live. Global counts age if any of them drafted: once, and
    /// once more for every plain step since the last drafting one.
    pub(crate) fn observe_step(&mut self, results: impl IntoIterator<Item = (u64, usize, usize)>) {
        let results: Vec<(u64, usize, usize)> = results.into_iter().collect();
        if results.is_empty() {
            return;
        }
        if !results.iter().any(|&(_, d, _)| d > 0) {
            self.plain_since = self.plain_since.saturating_add(1); // aged at the next drafting step
        } else {
            // Calibration and global counts age alike: this step, and the plain ones since the last drafting one.
            let steps = 1 + self.plain_since;
            self.plain_since = 0;
            // Only the adaptive policy reads the calibration (its choice and its metric): the
            // others skip it (per request a vector of K estimates, on the commit's critical path).
            if matches!(self.policy, DraftLenPolicy::Adaptive { .. }) {
                // From the estimates the step was chosen with (nothing was learned since: a step
                // is committed before the next one is scheduled).
                let g = self.global_estimates();
                let seen: Vec<(Vec<f64>, usize, usize)> = results
                    .iter()
                    .filter(|&&(h, d, _)| d > 0 && self.requests.contains_key(&h))
                    .map(|&(h, d, a)| (self.request_estimates_with(&g, h), d, a))
                    .collect();
                let age = CALIBRATION_DECAY.powi(steps);
                self.calibration.iter_mut().for_each(|c| *c = (c.0 * age, c.1 * age));
                for (p, d, accepted) in seen {
                    let mut r = 1.0;
                    for (j, c) in self.calibration.iter_mut().enumerate().take(d) {
                        r *= p[j];
                        *c = (c.0 + r, c.1 + (accepted > j) as u8 as f64);
                    }
                }
            }
            self.global.decay(GLOBAL_DECAY.powi(steps));
        }
        // Per request counts feed only the adaptive choice (`request_estimates` falls back to
        // the global ones without them).
        let per_request = matches!(self.policy, DraftLenPolicy::Adaptive { .. });
        for (h, num_drafts, accepted) in results {
            debug_assert!(accepted <= num_drafts && num_drafts <= self.k_max);
            self.global.observe(num_drafts, accepted);
            if per_request {
                let own = self.requests.entry(h).or_insert_with(|| Counts::new(self.k_max));
                own.decay(REQUEST_DECAY);
                own.observe(num_drafts, accepted);
            }
        }
    }

    /// c_j for position j in 1..=K: observed over predicted acceptances through j (decayed,
    /// with CALIBRATION_PRIOR pseudo-observations at 1).
    pub fn calibration(&self, j: usize) -> f64 {
        let (p, a) = self.calibration[j - 1];
        (a + CALIBRATION_PRIOR) / (p + CALIBRATION_PRIOR)
    }

    /// Requests with acceptance counts of their own.
    pub fn num_tracked(&self) -> usize {
        self.requests.len()
    }

    /// Drop a request's counts (it finished, was aborted or failed).
    pub(crate) fn forget(&mut self, handle: u64) {
        self.requests.remove(&handle);
    }

    /// Global estimates p_1..p_K.
    pub fn global_estimates(&self) -> Vec<f64> {
        let mut g = Vec::with_capacity(self.k_max);
        let mut prior = PRIOR_FIRST;
        for (&n, &a) in self.global.trials.iter().zip(&self.global.accepts) {
            let p = (a + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT);
            g.push(p);
            prior = PRIOR_DECAY * p;
        }
        g
    }

    /// A request's estimates p_1..p_K (the global ones where it has no history).
    pub fn request_estimates(&self, handle: u64) -> Vec<f64> {
        self.request_estimates_with(&self.global_estimates(), handle)
    }

    fn request_estimates_with(&self, g: &[f64], handle: u64) -> Vec<f64> {
        let Some(own) = self.requests.get(&handle) else {
            return g.to_vec();
        };
        g.iter()
            .zip(own.trials.iter().zip(&own.accepts))
            // = w·a/n + (1 - w)·g_j with w = n / (n + N0); exactly g_j where n = 0.
            .map(|(&gj, (&n, &a))| (a + REQUEST_PRIOR_WEIGHT * gj) / (n + REQUEST_PRIOR_WEIGHT))
            .collect()
    }

    /// `E[tokens | k]` for k = 0..=K of a request: committed tokens a step drafting k yields.
    pub fn expected_tokens(&self, handle: u64) -> Vec<f64> {
        self.expected_tokens_with(&self.global_estimates(), handle)
    }

    fn expected_tokens_with(&self, g: &[f64], handle: u64) -> Vec<f64> {
        expected_tokens(&self.request_estimates_with(g, handle))
    }

    /// `(k, planned steps with decoding requests that drafted k)` for every k the policy can
    /// choose (zeros included), and any other k that was chosen.
    pub fn counts(&self) -> Vec<(usize, u64)> {
        let choices = self.policy.choices(self.k_max);
        self.chosen.iter().enumerate().filter(|&(k, &c)| c > 0 || choices.contains(&k)).map(|(k, &c)| (k, c)).collect()
    }

    pub(crate) fn check(&self, is_live: impl Fn(u64) -> bool) -> Result<(), String> {
        self.global.check().map_err(|m| format!("global acceptance counts: {m}"))?;
        if let Some((k, c)) = self
            .calibration
            .iter()
            .enumerate()
            .find(|(_, c)| !(c.0.is_finite() && c.1.is_finite() && c.0 >= 0.0 && c.1 >= 0.0))
        {
            return Err(format!("calibration sums of position {}: {c:?}", k + 1));
        }
        for (h, c) in &self.requests {
            if !is_live(*h) {
                return Err(format!("acceptance counts of request {h}, which is gone"));
            }
            c.check().map_err(|m| format!("acceptance counts of request {h}: {m}"))?;
            if let Some(p) = self.request_estimates(*h).into_iter().find(|p| !(0.0..=1.0).contains(p)) {
                return Err(format!("request {h}: acceptance estimate {p} outside [0, 1]"));
            }
        }
        if let Some(p) = self.global_estimates().into_iter().find(|p| !(0.0..=1.0).contains(p)) {
            return Err(format!("global acceptance estimate {p} outside [0, 1]"));
        }
        Ok(())
    }
}

/// `E[tokens | k] = 1 + Σ_{j=1..k} Π_{m≤j} p_m` for k = 0..=p.len(): the bonus token plus each
/// draft, which commits only if every draft before it did.
pub fn expected_tokens(p: &[f64]) -> Vec<f64> {
    let mut out = Vec::with_capacity(p.len() + 1);
    let (mut e, mut run) = (1.0, 1.0);
    out.push(e);
    for &pj in p {
        run *= pj;
        e += run;
        out.push(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    fn adaptive(k_max: usize, candidates: Vec<usize>) -> DraftLen {
        DraftLen::new(DraftLenPolicy::Adaptive { candidates }, k_max)
    }

    /// Global counts as if `p` had been measured on a million trials per position.
    fn measured(d: &mut DraftLen, p: &[f64]) {
        for (j, &pj) in p.iter().enumerate() {
            d.global.trials[j] = 1e6;
            d.global.accepts[j] = pj * 1e6;
        }
    }

    fn costs(buckets: Vec<usize>, ks: Vec<usize>, seconds: Vec<Vec<f64>>) -> StepCosts {
        StepCosts::new(buckets, ks, seconds).unwrap()
    }

    #[test]
    fn expected_tokens_count_the_bonus_and_each_draft_whose_prefix_was_accepted() {
        assert_eq!(expected_tokens(&[]), vec![1.0]);
        let e = expected_tokens(&[0.5, 0.5, 1.0]);
        assert!(close(e[0], 1.0) && close(e[1], 1.5) && close(e[2], 1.75) && close(e[3], 2.0));
        assert_eq!(expected_tokens(&[0.0, 1.0]), vec![1.0, 1.0, 1.0]);
    }

    #[test]
    fn a_step_teaches_positions_up_to_the_first_rejection_and_nothing_past_it() {
        let mut c = Counts::new(4);
        c.observe(3, 1); // draft 1 accepted, draft 2 rejected, draft 3 unseen
        assert_eq!((c.trials.clone(), c.accepts.clone()), (vec![1.0, 1.0, 0.0, 0.0], vec![1.0, 0.0, 0.0, 0.0]));
        c.observe(2, 2); // all accepted: nothing about position 3
        assert_eq!((c.trials.clone(), c.accepts.clone()), (vec![2.0, 2.0, 0.0, 0.0], vec![2.0, 1.0, 0.0, 0.0]));
        c.observe(0, 0); // a plain decode step proposes nothing
        assert_eq!(c.trials, vec![2.0, 2.0, 0.0, 0.0]);
        c.decay(0.5);
        assert_eq!((c.trials, c.accepts), (vec![1.0, 1.0, 0.0, 0.0], vec![1.0, 0.5, 0.0, 0.0]));
    }

    #[test]
    fn global_counts_age_once_per_step_and_unseen_positions_follow_the_decaying_prior() {
        let mut d = DraftLen::new(DraftLenPolicy::Fixed, 3);
        let g = d.global_estimates();
        assert!(close(g[0], PRIOR_FIRST) && close(g[1], PRIOR_DECAY * g[0]) && close(g[2], PRIOR_DECAY * g[1]));
        // Two requests in one step: one aging, then both observations.
        d.observe_step([(1, 1, 1), (2, 1, 1)]);
        assert_eq!(d.global.trials, vec![2.0, 0.0, 0.0]);
        d.observe_step([(1, 1, 0)]);
        assert!(close(d.global.trials[0], 2.0 * GLOBAL_DECAY + 1.0) && close(d.global.accepts[0], 2.0 * GLOBAL_DECAY));
        let g = d.global_estimates();
        let p1 = (2.0 * GLOBAL_DECAY + PRIOR_WEIGHT * PRIOR_FIRST) / (2.0 * GLOBAL_DECAY + 1.0 + PRIOR_WEIGHT);
        assert!(close(g[0], p1));
        // Position 2 was never proposed: the prior chained off p_1.
        assert!(close(g[1], PRIOR_DECAY * p1) && close(g[2], PRIOR_DECAY * PRIOR_DECAY * p1));
        // A step with no decoding requests changes nothing.
        let before = d.global.clone();
        d.observe_step([]);
        assert_eq!(d.global, before);
    }

    #[test]
    fn a_requests_own_history_dominates_once_it_has_some() {
        let mut d = adaptive(2, vec![1, 2]); // (per-request counts: the adaptive policy's)
        measured(&mut d, &[0.2, 0.2]);
        // No history: the global estimate.
        assert_eq!(d.request_estimates(7), d.global_estimates());
        // Request 7 accepts everything, step after step; request 8 shares its steps but not its counts.
        for _ in 0..30 {
            d.observe_step([(7, 2, 2)]);
        }
        let own = d.requests[&7].clone();
        let n: f64 = (0..30).map(|i| REQUEST_DECAY.powi(i)).sum();
        assert!(close(own.trials[0], n) && close(own.accepts[1], n));
        let g = d.global_estimates();
        let w = n / (n + REQUEST_PRIOR_WEIGHT);
        let p = d.request_estimates(7);
        assert!(close(p[0], w * 1.0 + (1.0 - w) * g[0]) && p[0] > 0.8, "{p:?}");
        assert!(close(d.request_estimates(8)[0], g[0]));
        // Its counts age per step of its own: another request's steps leave them alone.
        d.observe_step([(8, 2, 0)]);
        assert_eq!(d.requests[&7], own);
        d.forget(7);
        assert!(!d.requests.contains_key(&7));
        assert_eq!(d.request_estimates(7), d.global_estimates());
    }

    #[test]
    fn cheap_drafts_and_high_acceptance_draft_the_most() {
        let mut d = adaptive(7, (0..=7).collect());
        measured(&mut d, &[0.95; 7]);
        d.set_step_costs(costs(
            vec![1, 8],
            (0..=7).collect(),
            vec![(0..=7).map(|k| 1.0 + 0.02 * k as f64).collect(); 2],
        ))
        .unwrap();
        assert_eq!(d.choose(&[1]), 7);
        assert_eq!(d.choose(&[1, 2, 3]), 7);
    }

    #[test]
    fn expensive_drafts_or_no_acceptance_draft_nothing() {
        let mut d = adaptive(7, (0..=7).collect());
        measured(&mut d, &[0.95; 7]);
        // A step drafting k costs 3 + k plain steps: at 0.95 no block pays (k = 7: 6.7 tokens in 10x the time).
        let seconds = (0..=7).map(|k| if k == 0 { 1.0 } else { 3.0 + k as f64 }).collect();
        d.set_step_costs(costs(vec![4], (0..=7).collect(), vec![seconds])).unwrap();
        assert_eq!(d.choose(&[1, 2]), 0);
        let mut d = adaptive(7, (0..=7).collect());
        measured(&mut d, &[0.0; 7]);
        let seconds = (0..=7).map(|k| 1.0 + 0.01 * k as f64).collect();
        d.set_step_costs(costs(vec![4], (0..=7).collect(), vec![seconds])).unwrap();
        assert_eq!(d.choose(&[1]), 0);
    }

    #[test]
    fn a_long_run_of_plain_steps_drafts_once_to_learn_again() {
        let mut d = adaptive(7, vec![0, 3, 7]);
        measured(&mut d, &[0.0; 7]);
        let seconds = vec![1.0, 1.5, 2.0];
        d.set_step_costs(costs(vec![4], vec![0, 3, 7], vec![seconds])).unwrap();
        // The run before exploring scales with the drafting step's cost: 1.5x a plain one.
        for _ in 0..EXPLORE_AFTER * 3 / 2 {
            assert_eq!(d.choose(&[1]), 0);
            d.record_choice(0);
        }
        // The best drafting block (k = 3: the same expected tokens as 7, cheaper), once.
        assert_eq!(d.choose(&[1]), 3);
        d.record_choice(3);
        assert_eq!(d.choose(&[1]), 0);
    }

    #[test]
    fn a_middle_case_picks_a_middle_block_and_the_bucket_decides() {
        let mut d = adaptive(7, vec![0, 2, 4, 7]);
        measured(&mut d, &[0.8; 7]);
        // Rates at p = 0.8: k=0 1/1, k=2 2.44/1.2 = 2.03, k=4 3.36/1.5 = 2.24, k=7 4.16/3 = 1.39.
        // A batch past 2 runs in the second bucket, where drafting costs 4x a plain step.
        let small = vec![1.0, 1.2, 1.5, 3.0];
        let large = vec![1.0, 4.0, 5.0, 6.0];
        d.set_step_costs(costs(vec![2, 16], vec![0, 2, 4, 7], vec![small, large])).unwrap();
        assert_eq!(d.choose(&[1]), 4);
        assert_eq!(d.choose(&[1, 2]), 4);
        assert_eq!(d.choose(&[1, 2, 3]), 0);
        // Past the largest bucket: the largest bucket's costs.
        assert_eq!(d.choose(&(0..40).collect::<Vec<u64>>()), 0);
        // The sum runs over the step's requests: request 1 has its first draft rejected step
        // after step, so alone it drafts less; beside request 2 (no history) the batch drafts 4.
        let mut d2 = d.clone();
        for _ in 0..50 {
            d2.observe_step([(1, 7, 0)]);
        }
        assert!(d2.request_estimates(1)[0] < 0.2 && d2.global_estimates()[0] > 0.79);
        assert!(d2.choose(&[1]) < 4);
        assert_eq!(d2.choose(&[1, 2]), 4);
        assert_eq!(d.choose(&[1]), 4, "the choice is a pure function of the history");
    }

    #[test]
    fn adaptive_drafts_the_most_until_costs_are_known() {
        let mut d = adaptive(5, vec![0, 5]);
        measured(&mut d, &[0.0; 5]);
        assert_eq!(d.choose(&[1, 2]), 5);
        d.set_step_costs(costs(vec![1], vec![0, 5], vec![vec![1.0, 1.5]])).unwrap();
        assert_eq!(d.choose(&[1, 2]), 0);
        assert_eq!(d.choose(&[]), 5);
    }

    #[test]
    fn after_giving_up_on_drafting_the_policy_explores_again() {
        // Everything rejected: k = 0. Steps of k = 0 teach nothing and leave the global counts
        // alone; after EXPLORE_AFTER of them in a row one step drafts (what the scheduler
        // records through record_choice), then plain steps again while nothing is accepted.
        let mut d = adaptive(4, (0..=4).collect());
        // Drafting one costs 1.2x: its rate (1 + p_1) / 1.2 stays below PROBE_WITHIN of a plain
        // step's, so the runner-up probe never fires here.
        d.set_step_costs(costs(vec![1], (0..=4).collect(), vec![vec![1.0, 1.2, 1.3, 1.4, 1.5]])).unwrap();
        for _ in 0..50 {
            d.observe_step([(1, 4, 0)]);
        }
        let global = d.global.clone();
        let mut probes = vec![];
        for step in 0..3 * (EXPLORE_AFTER * 6 / 5 + 2) {
            let k = d.choose(&[1]);
            d.record_choice(k);
            if k > 0 {
                probes.push(step);
            }
            d.observe_step([(1, k, 0)]);
        }
        // The best drafting k is 1 (1.2x a plain step): the first probe after
        // ceil(1.2 * EXPLORE_AFTER) plain steps. The rejections from before have aged by then
        // (the plain steps' aging, applied at that drafting step), so k = 1 comes within
        // PROBE_WITHIN of a plain step and the runner-up probe drafts it now and then; while
        // nothing is accepted, drafting stays rare.
        let e = (EXPLORE_AFTER as f64 * 1.2).ceil() as u64;
        assert_eq!(probes[0], e, "the first probe after {e} plain steps");
        let steps = 3 * (EXPLORE_AFTER * 6 / 5 + 2);
        assert!(probes.len() as u64 <= steps / 8, "{probes:?}");
        assert!(probes.windows(2).all(|w| w[1] - w[0] >= 8), "{probes:?}");
        assert!(d.global_estimates()[0] < 0.35, "{:?}", d.global_estimates());
        assert!(
            d.global.trials[0] > 0.0 && d.global.accepts[0] == 0.0 && d.global != global,
            "the probes were learnt from"
        );
    }

    #[test]
    fn a_long_run_of_drafting_steps_plain_steps_once_to_measure_it() {
        let mut d = adaptive(7, vec![0, 3, 7]);
        measured(&mut d, &[0.9; 7]);
        // Drafting pays by far (k = 3: 3.44 tokens for 1.2x; k = 7 is not within 0.9 of it).
        d.set_step_costs(costs(vec![4], vec![0, 3, 7], vec![vec![1.0, 1.2, 3.0]])).unwrap();
        let mut plain = vec![];
        for step in 0..2 * (PLAIN_AFTER + 1) {
            let k = d.choose(&[1]);
            d.record_choice(k);
            if k == 0 {
                plain.push(step);
            }
        }
        assert_eq!(plain, vec![PLAIN_AFTER, 2 * PLAIN_AFTER + 1]);
        // Not without 0 among the candidates.
        let mut d = adaptive(7, vec![3, 7]);
        d.set_step_costs(costs(vec![4], vec![3, 7], vec![vec![1.2, 3.0]])).unwrap();
        for _ in 0..2 * PLAIN_AFTER {
            let k = d.choose(&[1]);
            d.record_choice(k);
            assert_eq!(k, 3);
        }
    }

    #[test]
    fn every_probe_every_th_step_measures_the_runner_up_when_it_is_close() {
        let mut d = adaptive(7, vec![0, 3, 7]);
        measured(&mut d, &[0.8; 7]);
        // p = 0.8: tokens k=0 1, k=3 2.95, k=7 4.16. Rates at these costs: 1.0, 2.46, 2.31:
        // k = 7 is within 0.9 of the best (k = 3), a plain step is not.
        d.set_step_costs(costs(vec![4], vec![0, 3, 7], vec![vec![1.0, 1.2, 1.8]])).unwrap();
        let mut picks = vec![];
        for _ in 0..2 * PROBE_EVERY {
            let k = d.choose(&[1]);
            d.record_choice(k);
            picks.push(k);
        }
        let probes: Vec<usize> = (0..picks.len()).filter(|&i| picks[i] != 3).collect();
        let e = PROBE_EVERY as usize;
        assert_eq!(probes, vec![e - 1, 2 * e - 1]);
        assert!(probes.iter().all(|&i| picks[i] == 7));
        // The runner-up far below the best (k = 7 at 3x the cost): no probe.
        d.set_step_costs(costs(vec![4], vec![0, 3, 7], vec![vec![1.0, 1.2, 3.0]])).unwrap();
        for _ in 0..2 * PROBE_EVERY {
            let k = d.choose(&[1]);
            d.record_choice(k);
            assert_eq!(k, 3);
        }
    }

    #[test]
    fn a_drafting_step_after_a_stretch_of_plain_steps_outweighs_the_counts_from_before_it() {
        // Chat-like acceptance learned, then a long stretch of plain steps, then one exploring
        // step on code-like traffic: the counts from before the stretch have aged by it.
        let mut d = adaptive(3, vec![0, 1, 3]);
        // The steady state of one request a step: ~1 / (1 - GLOBAL_DECAY) = 50 trials a position.
        d.global = Counts { trials: vec![50.0, 15.0, 4.5], accepts: vec![15.0, 4.5, 1.35] };
        let before = d.global.clone();
        for _ in 0..200 {
            d.observe_step([(1, 0, 0)]);
        }
        assert_eq!(d.global, before, "plain steps leave the estimates as they are");
        d.observe_step([(2, 3, 3)]);
        let aged = GLOBAL_DECAY.powi(201);
        assert!(close(d.global.trials[0], 50.0 * aged + 1.0), "{:?}", d.global.trials);
        assert!(d.global_estimates()[0] > 0.6, "{:?}", d.global_estimates());
        // Without the stretch the same step moves the estimate little.
        let mut e = adaptive(3, vec![0, 1, 3]);
        e.global = before;
        e.observe_step([(2, 3, 3)]);
        assert!(e.global_estimates()[0] < 0.35, "{:?}", e.global_estimates());
    }

    #[test]
    fn only_the_adaptive_policy_keeps_a_calibration_and_per_request_counts() {
        let mut fixed = DraftLen::new(DraftLenPolicy::Fixed, 15);
        let mut adapt = adaptive(15, vec![3, 15]);
        for d in [&mut fixed, &mut adapt] {
            for _ in 0..50 {
                d.observe_step([(1, 15, 2), (2, 15, 2)]);
            }
        }
        assert!((1..=15).all(|j| close(fixed.calibration(j), 1.0)), "fixed: the prior, untouched");
        assert_eq!(fixed.global_estimates(), adapt.global_estimates(), "both learn the acceptance alike");
        assert!((1..=15).any(|j| !close(adapt.calibration(j), 1.0)), "adaptive: calibrated from the commits");
        assert_eq!((fixed.num_tracked(), adapt.num_tracked()), (0, 2), "per-request counts: adaptive only");
        assert_eq!(fixed.request_estimates(1), fixed.global_estimates());
    }

    #[test]
    fn positions_accepted_less_often_than_predicted_are_scaled_down() {
        let mut d = adaptive(15, vec![3, 15]);
        measured(&mut d, &[0.9; 15]);
        // p = 0.9: tokens k=3 3.44, k=15 8.15 (for 1.3x the cost): 15.
        d.set_step_costs(costs(vec![1], vec![3, 15], vec![vec![1.0, 1.3]])).unwrap();
        assert_eq!(d.choose(&[1]), 15);
        assert!((1..=15).all(|j| close(d.calibration(j), 1.0)));
        // A request's first step teaches the estimates, not the calibration.
        d.observe_step([(99, 15, 3)]);
        assert!((1..=15).all(|j| close(d.calibration(j), 1.0)));
        // Steps of K = 15 whose requests (a long history of full acceptance: estimates ~0.96)
        // accept 3 drafts: positions 1..3 are reached more often than predicted, 4..15 never.
        let mut predicted = vec![0.0; 15];
        let mut reached = vec![0.0; 15];
        for i in 0..200 {
            d.requests.insert(100 + i, Counts { trials: vec![20.0; 15], accepts: vec![20.0; 15] });
            let p = d.request_estimates(100 + i);
            let mut r = 1.0;
            for j in 0..15 {
                r *= p[j];
                predicted[j] = predicted[j] * CALIBRATION_DECAY + r;
                reached[j] = reached[j] * CALIBRATION_DECAY + (j < 3) as u8 as f64;
            }
            d.observe_step([(100 + i, 15, 3)]);
        }
        for j in 1..=15 {
            let want = (reached[j - 1] + CALIBRATION_PRIOR) / (predicted[j - 1] + CALIBRATION_PRIOR);
            assert!((d.calibration(j) - want).abs() < 1e-9, "position {j}: {} vs {want}", d.calibration(j));
        }
        assert!(d.calibration(3) >= 1.0 && d.calibration(4) < 0.2, "{} {}", d.calibration(3), d.calibration(4));
        // A fresh request (the global 0.9, re-measured): k = 15's positions 4..15 now count
        // for < 0.2 of their estimate, and k = 3 is chosen.
        measured(&mut d, &[0.9; 15]);
        assert_eq!(d.choose(&[1]), 3);
        // Steps that draft only 3 teach positions 4..15 nothing: their sums age away, c returns
        // to 1, and K = 15 is chosen again.
        for _ in 0..600 {
            d.requests.insert(1000, Counts::new(15));
            d.observe_step([(1000, 3, 2)]);
            d.requests.remove(&1000);
        }
        assert!((4..=15).all(|j| (d.calibration(j) - 1.0).abs() < 0.05), "{}", d.calibration(4));
        measured(&mut d, &[0.9; 15]);
        assert_eq!(d.choose(&[1]), 15);
        d.requests.retain(|&h, _| (100..300).contains(&h));
        assert!(d.check(|h| (100..300).contains(&h)).is_ok());
    }

    #[test]
    fn plain_steps_keep_the_global_estimate_and_a_request_returns_to_it() {
        // Traffic that pays at its measured acceptance (p = 0.75: k = 3 gives 2.9 tokens for
        // 2.16x a plain step's cost, while the prior's 2.08 would not pay). One request has a
        // bad stretch and stops drafting; its plain steps fade its own counts, not the global
        // ones, so it drafts again long before the exploration rule would make it.
        let mut d = adaptive(3, vec![0, 1, 3]);
        measured(&mut d, &[0.75, 0.75, 0.75]);
        d.set_step_costs(costs(vec![1], vec![0, 1, 3], vec![vec![1.0, 1.5, 2.16]])).unwrap();
        assert_eq!(d.choose(&[1]), 3);
        for _ in 0..6 {
            d.observe_step([(1, 3, 0)]); // the bad stretch (the global counts learn it too)
        }
        assert_eq!(d.choose(&[1]), 0);
        let g = d.global_estimates();
        let mut plain = 0;
        while d.choose(&[1]) == 0 {
            d.record_choice(0);
            d.observe_step([(1, 0, 0)]);
            plain += 1;
            assert_eq!(d.global_estimates(), g, "a plain step leaves the global estimate");
            assert!(plain < EXPLORE_AFTER, "the request never returned to the global estimate");
        }
        assert!(plain >= 2, "drafted again at once: the bad stretch was not heeded");
    }

    #[test]
    fn step_costs_are_validated() {
        let ok = |b: Vec<usize>, k: Vec<usize>, s: Vec<Vec<f64>>| StepCosts::new(b, k, s).is_ok();
        assert!(ok(vec![1, 4], vec![0, 3], vec![vec![1.0, 2.0], vec![3.0, 4.0]]));
        assert!(!ok(vec![], vec![0], vec![]));
        assert!(!ok(vec![1], vec![], vec![vec![]]));
        assert!(!ok(vec![0, 4], vec![0], vec![vec![1.0], vec![1.0]]), "bucket 0");
        assert!(!ok(vec![4, 1], vec![0], vec![vec![1.0], vec![1.0]]), "descending buckets");
        assert!(!ok(vec![1], vec![3, 3], vec![vec![1.0, 1.0]]), "repeated k");
        assert!(!ok(vec![1, 2], vec![0], vec![vec![1.0]]), "missing row");
        assert!(!ok(vec![1], vec![0, 1], vec![vec![1.0]]), "short row");
        for c in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(!ok(vec![1], vec![0], vec![vec![c]]), "cost {c}");
        }
        let mut d = adaptive(3, vec![0, 3]);
        assert!(d.set_step_costs(costs(vec![1], vec![0, 4], vec![vec![1.0, 2.0]])).is_err(), "k past K");
        assert!(d.set_step_costs(costs(vec![1], vec![0, 2], vec![vec![1.0, 2.0]])).is_err(), "candidate 3 unmeasured");
        assert!(d.step_costs().is_none());
        assert!(d.set_step_costs(costs(vec![1], vec![0, 1, 3], vec![vec![1.0, 2.0, 3.0]])).is_ok());
    }

    #[test]
    fn policies_are_validated() {
        let v = |p: DraftLenPolicy, k: usize| p.validate(k).is_ok();
        assert!(v(DraftLenPolicy::Fixed, 0) && v(DraftLenPolicy::Fixed, 7));
        assert!(v(DraftLenPolicy::Schedule(vec![(1, 7), (4, 2)]), 7));
        assert!(!v(DraftLenPolicy::Schedule(vec![(4, 7), (1, 2)]), 7));
        assert!(!v(DraftLenPolicy::Schedule(vec![(1, 0)]), 7));
        assert!(!v(DraftLenPolicy::Schedule(vec![(1, 8)]), 7));
        assert!(!v(DraftLenPolicy::Schedule(vec![(1, 1)]), 0));
        assert!(v(DraftLenPolicy::Adaptive { candidates: vec![0, 3, 7] }, 7));
        assert!(v(DraftLenPolicy::Adaptive { candidates: vec![7, 0] }, 7));
        assert!(!v(DraftLenPolicy::Adaptive { candidates: vec![0, 3] }, 7), "must include K");
        assert!(!v(DraftLenPolicy::Adaptive { candidates: vec![0, 8, 7] }, 7), "past K");
        assert!(!v(DraftLenPolicy::Adaptive { candidates: vec![0, 7, 7] }, 7), "repeated");
        assert!(!v(DraftLenPolicy::Adaptive { candidates: vec![0] }, 0), "needs speculation");
    }

    #[test]
    fn counts_list_every_possible_k() {
        let mut d = adaptive(4, vec![0, 2, 4]);
        d.record_choice(2);
        d.record_choice(2);
        d.record_choice(4);
        assert_eq!(d.counts(), vec![(0, 0), (2, 2), (4, 1)]);
        let d = DraftLen::new(DraftLenPolicy::Schedule(vec![(1, 3), (4, 1)]), 3);
        assert_eq!(d.counts(), vec![(1, 0), (3, 0)]);
        assert_eq!(DraftLen::new(DraftLenPolicy::Fixed, 0).counts(), vec![(0, 0)]);
    }

    #[test]
    fn draft_len_for_follows_the_schedule() {
        let s = [(1, 7), (3, 4)];
        assert_eq!([0, 1, 2, 3, 4, 99].map(|n| draft_len_for(&s, 7, n)), [7, 7, 4, 4, 4, 4]);
        assert_eq!(draft_len_for(&[], 5, 9), 5);
    }
}
