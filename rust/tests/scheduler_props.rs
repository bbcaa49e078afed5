//! Random interleavings of add / schedule / commit (random acceptance) / abort / cancel under
//! page pressure, checked against a simple reference model after every operation.

use std::collections::HashMap;

use _core::{pages_per_seq, CoreError, EntryKind, FinishReason, Phase, Scheduler, SchedulerConfig, StepPlan, StepTicket};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add { prompt_len: usize, max_tokens: usize, stop: bool },
    Step { seed: u64 },
    Abort { pick: usize },
    StepThenAbortBeforeCommit { seed: u64, pick: usize },
    StepThenCancel { seed: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1usize..40, 1usize..24, any::<bool>()).prop_map(|(p, m, s)| Op::Add { prompt_len: p, max_tokens: m, stop: s }),
        8 => any::<u64>().prop_map(|seed| Op::Step { seed }),
        1 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        1 => (any::<u64>(), any::<usize>()).prop_map(|(seed, pick)| Op::StepThenAbortBeforeCommit { seed, pick }),
        1 => any::<u64>().prop_map(|seed| Op::StepThenCancel { seed }),
    ]
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

struct Harness {
    s: Scheduler,
    model: HashMap<u64, Model>,
    next_id: u64,
    b: usize,
}

impl Harness {
    fn check(&self) {
        self.s.check_invariants().unwrap();
        assert_eq!(self.s.num_live(), self.model.len());
        for (h, m) in &self.model {
            let r = self.s.request(*h).expect("model request live in scheduler");
            assert_eq!(self.s.handle_of(&m.id), Some(*h), "one registry: id -> handle");
            assert_eq!(r.tokens(), &m.tokens[..], "request {h} tokens diverged from the model");
        }
    }

    fn add(&mut self, prompt_len: usize, max_tokens: usize, stop: bool) {
        let id = format!("r{}", self.next_id);
        self.next_id += 1;
        let prompt: Vec<u32> = (0..prompt_len as u32).map(|i| 10 + i).collect();
        let stop_ids = if stop { vec![STOP] } else { vec![] };
        match self.s.add_request(&id, prompt.clone(), max_tokens, stop_ids.clone()) {
            Ok(h) => {
                self.model.insert(h, Model { id: id.clone(), tokens: prompt, prompt_len, max_tokens, stop: stop_ids });
            }
            Err(CoreError::Rejected { .. }) => {
                let cfg = self.s.config();
                let too_long = prompt_len + max_tokens > cfg.max_model_len;
                let too_big = (prompt_len + max_tokens + self.b).div_ceil(cfg.page_size) > cfg.num_pages - 1;
                assert_eq!(too_big, pages_per_seq(prompt_len + max_tokens, self.b, cfg.page_size) > cfg.num_pages - 1);
                assert!(too_long || too_big, "rejected a request that fits");
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }

    /// (phase, committed) of a live request: the committed count as the model defines it.
    fn state(&self, h: u64) -> (Phase, usize) {
        let r = self.s.request(h).unwrap();
        (r.phase(), r.num_computed())
    }

    /// Schedule and produce random results. `None` when there is nothing to run.
    fn plan(&mut self, seed: u64) -> Option<(StepTicket, StepPlan, Vec<u32>, Vec<u32>)> {
        let before: HashMap<u64, (Phase, usize)> = self.model.keys().map(|h| (*h, self.state(*h))).collect();
        let Some((ticket, plan)) = self.s.schedule().unwrap() else {
            assert_eq!(self.s.num_running(), 0, "nothing scheduled while requests run");
            self.check();
            return None;
        };
        self.check();
        for e in &plan.entries {
            if let EntryKind::Decode { committed } = e.kind {
                assert!(self.s.request(e.handle).unwrap().pages().capacity() >= committed + self.b);
                assert_eq!(before[&e.handle], (Phase::Decoding, committed));
            }
        }
        let mut rng = Rng(seed);
        let accepted: Vec<u32> = plan.entries.iter().map(|e| rng.below(e.num_drafts() as u64 + 1) as u32).collect();
        let sampled: Vec<u32> = plan.sample_rows.iter().map(|_| 3 + rng.below(40) as u32).collect();
        Some((ticket, plan, accepted, sampled))
    }

    fn commit(&mut self, ticket: StepTicket, plan: &StepPlan, accepted: &[u32], sampled: &[u32]) {
        let before: HashMap<u64, (Phase, usize)> =
            plan.entries.iter().filter(|e| self.model.contains_key(&e.handle)).map(|e| (e.handle, self.state(e.handle))).collect();
        let out = self.s.commit(ticket, accepted, sampled).map_err(|r| r.error).unwrap();
        let live: Vec<_> = plan.entries.iter().zip(accepted).filter(|(e, _)| before.contains_key(&e.handle)).collect();
        assert_eq!(out.handles.len(), live.len(), "one result per still-live planned request");
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

fn run(ops: Vec<Op>, num_pages: usize, k: usize, budget: usize) {
    let cfg = SchedulerConfig {
        num_pages,
        page_size: 4,
        max_num_seqs: 6,
        max_num_batched_tokens: budget,
        max_model_len: 64,
        num_speculative_tokens: k,
        mask_token_id: 1,
    };
    let mut h = Harness { s: Scheduler::new(cfg).unwrap(), model: HashMap::new(), next_id: 0, b: k + 1 };
    for op in ops {
        match op {
            Op::Add { prompt_len, max_tokens, stop } => h.add(prompt_len, max_tokens, stop),
            Op::Step { seed } => {
                if let Some((t, p, a, s)) = h.plan(seed) {
                    h.commit(t, &p, &a, &s);
                }
            }
            Op::Abort { pick } => h.abort(pick),
            Op::StepThenAbortBeforeCommit { seed, pick } => {
                let Some((t, p, a, s)) = h.plan(seed) else { continue };
                // An abort between schedule and commit: the others still commit.
                let victim = p.entries[pick % p.entries.len()].handle;
                h.s.finish(victim, FinishReason::Abort).unwrap();
                h.model.remove(&victim);
                h.check();
                // A refused commit changes nothing and returns the ticket.
                let snapshot: Vec<(u64, Vec<u32>)> =
                    h.model.keys().map(|k| (*k, h.s.request(*k).unwrap().tokens().to_vec())).collect();
                let mut too_many = a.clone();
                too_many[0] = p.entries[0].num_drafts() as u32 + 1;
                let refused = h.s.commit(t, &too_many, &s).unwrap_err();
                assert!(matches!(refused.error, CoreError::InvalidCommit(_)));
                for (k, toks) in snapshot {
                    assert_eq!(h.s.request(k).unwrap().tokens(), &toks[..], "a refused commit changed state");
                }
                h.commit(refused.ticket, &p, &a, &s);
            }
            Op::StepThenCancel { seed } => {
                if let Some((t, _, _, _)) = h.plan(seed) {
                    h.s.cancel(t).unwrap();
                    assert_eq!(h.s.outstanding_step(), None);
                    h.check();
                }
            }
        }
    }
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
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn speculative_under_page_pressure(ops in prop::collection::vec(op(), 1..120), pages in 8usize..40) {
        run(ops, pages, 3, 24);
    }

    #[test]
    fn plain_decode_small_budget(ops in prop::collection::vec(op(), 1..120), pages in 20usize..40) {
        run(ops, pages, 0, 5);
    }

    #[test]
    fn wide_blocks(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, 48, 15, 64);
    }
}
