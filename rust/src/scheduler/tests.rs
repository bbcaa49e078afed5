use super::*;

fn cfg(num_pages: usize, k: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_pages,
        page_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 128,
        num_speculative_tokens: k,
        mask_token_id: 999,
        enable_prefix_caching: true,
        draft_len_policy: DraftLenPolicy::Fixed,
        draft_block_rows: 0,
        state_slots: false,
    }
}

fn sched(num_pages: usize, k: usize) -> Scheduler {
    Scheduler::new(cfg(num_pages, k)).unwrap()
}

/// One scheduled step (panics when there is nothing to run).
fn step(s: &mut Scheduler) -> (StepTicket, StepPlan) {
    s.schedule().unwrap().expect("a step to run")
}

/// (handle, new tokens, finish) per committed request.
type Out = Vec<(u64, Vec<u32>, Option<FinishReason>)>;

fn commit(s: &mut Scheduler, t: StepTicket, accepted: &[u32], sampled: &[u32]) -> Out {
    let b = s.commit(t, accepted, sampled).map_err(|r| r.error).unwrap();
    (0..b.handles.len())
        .map(|i| {
            let toks = b.tokens[b.offsets[i] as usize..b.offsets[i + 1] as usize].iter().map(|&t| t as u32).collect();
            (b.handles[i], toks, FinishReason::from_code(b.finish[i]))
        })
        .collect()
}

fn decoding_at(s: &Scheduler, h: u64) -> (Phase, usize, u32) {
    let r = s.request(h).unwrap();
    (r.phase(), r.num_computed(), *r.tokens().last().unwrap())
}

#[test]
fn prefill_then_speculative_decode_layout() {
    let mut s = sched(32, 3);
    let h = s.add_request("a", vec![1, 2, 3, 4, 5], 20, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(p.target.input_ids, vec![1, 2, 3, 4, 5]);
    assert_eq!(p.target.positions, vec![0, 1, 2, 3, 4]);
    assert_eq!(p.sample_rows, vec![4]);
    assert_eq!(p.num_draft_rows(), 0);
    let out = commit(&mut s, t, &[0], &[7]);
    assert_eq!(out[0].1, vec![7]);
    assert_eq!(decoding_at(&s, h), (Phase::Decoding, 5, 7));

    let (t, p) = step(&mut s);
    // Verify block [bonus, MASK x3] at positions 5..8; the draft pass is the same rows.
    assert_eq!(p.target.input_ids, vec![7, 999, 999, 999]);
    assert_eq!(p.target.positions, vec![5, 6, 7, 8]);
    assert_eq!(p.num_decode, 1);
    assert_eq!(p.num_draft_rows(), 4);
    assert_eq!(p.target.seq_lens, vec![9]);
    assert_eq!(p.sample_rows, vec![0, 1, 2, 3]);
    assert_eq!(p.verify_target_rows, vec![1, 2, 3]);
    assert_eq!(p.draft.input_ids, vec![7, 999, 999, 999]);
    assert_eq!(p.draft.positions, p.target.positions);
    assert_eq!(p.draft.slot_mapping, p.target.slot_mapping);
    assert_eq!((p.draft.seq_lens.clone(), p.draft.proposal_rows.clone()), (vec![9], vec![1, 2, 3]));
    assert_eq!(p.entries[0].num_rows(), 4);
    // Pages for committed + B = 9 positions exist before drafting.
    assert!(s.request(h).unwrap().pages().capacity() >= 9);
    let out = commit(&mut s, t, &[2], &[8, 9, 10, 11]);
    assert_eq!(out[0].1, vec![8, 9, 10]);
    assert_eq!(decoding_at(&s, h), (Phase::Decoding, 8, 10));
    s.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut c = cfg(64, 0);
    c.max_num_batched_tokens = 4;
    let mut s = Scheduler::new(c).unwrap();
    let h = s.add_request("a", (1..=10).collect(), 3, vec![]).unwrap();
    for (start, len) in [(0, 4), (4, 4), (8, 2)] {
        let (t, p) = step(&mut s);
        assert_eq!(p.entries[0].kind, EntryKind::Prefill { start, len, sample: start + len == 10 });
        let sampled: Vec<u32> = p.sample_rows.iter().map(|_| 42).collect();
        commit(&mut s, t, &[0], &sampled);
    }
    assert_eq!(decoding_at(&s, h), (Phase::Decoding, 10, 42));
}

#[test]
fn stop_token_and_max_tokens_cut_the_block() {
    let mut s = sched(32, 3);
    let a = s.add_request("a", vec![1, 2], 10, vec![50]).unwrap();
    let b = s.add_request("b", vec![1, 2], 3, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0, 0], &[5, 5]);
    let (t, _) = step(&mut s);
    // a: t1 is the stop token; b: only 2 more tokens allowed.
    let out = commit(&mut s, t, &[3, 3], &[6, 50, 7, 8, 6, 7, 8, 9]);
    assert_eq!(out[0], (a, vec![6, 50], Some(FinishReason::Stop)));
    assert_eq!(out[1], (b, vec![6, 7], Some(FinishReason::Length)));
    assert_eq!(s.num_live(), 0);
    assert_eq!(s.num_free_pages(), 31);
}

#[test]
fn misuse_returns_errors_and_changes_nothing() {
    let mut s = sched(32, 3);
    let h = s.add_request("a", vec![1, 2], 10, vec![]).unwrap();
    assert!(matches!(s.add_request("a", vec![1], 1, vec![]), Err(CoreError::DuplicateRequest(_))));
    let (t, _) = step(&mut s);
    assert!(matches!(s.schedule(), Err(CoreError::PlanOutstanding { .. })));
    let r = s.commit(t, &[1], &[3]).unwrap_err();
    assert!(matches!(r.error, CoreError::InvalidCommit(_)), "prefill proposes 0");
    let r = s.commit(r.ticket, &[0], &[]).unwrap_err();
    assert!(matches!(r.error, CoreError::InvalidCommit(_)));
    commit(&mut s, r.ticket, &[0], &[3]);
    let (t, _) = step(&mut s);
    let before = s.request(h).unwrap().tokens().to_vec();
    let r = s.commit(t, &[4], &[1, 2, 3, 4]).unwrap_err();
    assert!(matches!(r.error, CoreError::InvalidCommit(_)), "4 > 3 drafts");
    assert_eq!(s.request(h).unwrap().tokens(), &before[..]);
    s.cancel(r.ticket).unwrap();
    assert_eq!(s.outstanding_step(), None);
    s.check_invariants().unwrap();
}

// ---- forging: the plan is information, the ticket is the only authority --------------

#[test]
fn editing_the_plan_cannot_change_what_commit_applies() {
    let mut s = sched(32, 3);
    let h = s.add_request("a", vec![1, 2, 3, 4], 20, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[5]);
    let (t, mut p) = step(&mut s);
    // A caller rewrites its copy: pretend the verify block sits at 1 and proposes 10 drafts.
    p.entries[0].kind = EntryKind::Decode { committed: 1 };
    p.entries[0].num_samples = 11;
    p.sample_rows.truncate(1);
    let r = s.commit(t, &[10], &[9; 11]).unwrap_err();
    assert!(matches!(r.error, CoreError::InvalidCommit(_)), "the core's record has 4 rows, 3 drafts");
    let out = commit(&mut s, r.ticket, &[1], &[6, 7, 8, 9]);
    assert_eq!(out[0].1, vec![6, 7]);
    assert_eq!(decoding_at(&s, h), (Phase::Decoding, 6, 7));
    assert_eq!(s.request(h).unwrap().tokens(), &[1, 2, 3, 4, 5, 6, 7]);
    s.check_invariants().unwrap();
}

#[test]
fn a_ticket_of_another_scheduler_is_refused() {
    let mut s1 = sched(32, 3);
    let mut s2 = sched(32, 3);
    s1.add_request("a", vec![1, 2], 10, vec![]).unwrap();
    s2.add_request("a", vec![1, 2], 10, vec![]).unwrap();
    let (t1, _) = step(&mut s1);
    let (t2, _) = step(&mut s2);
    assert_eq!(t1.step_id(), t2.step_id(), "same step number in both");
    let r = s2.commit(t1, &[0], &[3]).unwrap_err();
    assert!(matches!(r.error, CoreError::StalePlan(_)));
    assert!(matches!(s2.cancel(r.ticket), Err(CoreError::StalePlan(_))));
    assert_eq!(s2.outstanding_step(), Some(t2.step_id()), "nothing changed in s2");
    commit(&mut s2, t2, &[0], &[3]);
}

#[test]
fn a_request_aborted_mid_step_is_skipped_and_the_others_commit() {
    let mut s = sched(32, 3);
    let a = s.add_request("a", vec![1, 2], 10, vec![]).unwrap();
    let b = s.add_request("b", vec![1, 2], 10, vec![]).unwrap();
    let (t, _) = step(&mut s);
    s.finish(a, FinishReason::Abort).unwrap();
    let out = commit(&mut s, t, &[0, 0], &[3, 4]);
    assert_eq!(out, vec![(b, vec![4], None)]);
    assert!(s.request(a).is_none() && s.handle_of("a").is_none());
    assert_eq!(s.num_free_pages(), 31 - s.request(b).unwrap().pages().len());
    s.check_invariants().unwrap();
}

#[test]
fn an_empty_step_needs_no_commit() {
    let mut s = sched(32, 3);
    assert!(s.schedule().unwrap().is_none());
    assert_eq!(s.outstanding_step(), None);
    s.add_request("a", vec![1, 2], 10, vec![]).unwrap();
    assert!(s.schedule().unwrap().is_some());
}

#[test]
fn admission_rejects_what_can_never_fit_naming_the_parameter() {
    let mut s = sched(4, 3); // 3 usable pages of 4 = 12 slots
    let param = |r: CoreResult<u64>| match r {
        Err(CoreError::Rejected { param, .. }) => param,
        other => panic!("expected a rejection, got {other:?}"),
    };
    assert_eq!(param(s.add_request("e", vec![], 4, vec![])), Param::Prompt);
    assert_eq!(param(s.add_request("long", vec![1; 200], 40, vec![])), Param::Prompt);
    assert_eq!(param(s.add_request("long", vec![1; 100], 40, vec![])), Param::MaxTokens);
    assert_eq!(param(s.add_request("zero", vec![1], 0, vec![])), Param::MaxTokens);
    // 6 + 4 + B(4) = 14 slots > 12
    assert_eq!(param(s.add_request("pages", vec![1; 6], 4, vec![])), Param::Prompt);
    s.add_request("ok", vec![1; 4], 4, vec![]).unwrap();
    assert_eq!(pages_per_seq(8, 4, 4), 3);
}

#[test]
fn preemption_evicts_the_newest_and_resumes_without_resampling() {
    let mut s = sched(5, 0); // 4 usable pages of 4 slots
    let a = s.add_request("a", vec![1; 4], 8, vec![]).unwrap();
    let b = s.add_request("b", vec![2; 4], 8, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0, 0], &[10, 20]);
    // Each decode step needs committed+1 slots: both grow into a second page; the pool has 4.
    for _ in 0..4 {
        let (t, p) = step(&mut s);
        let sampled: Vec<u32> = p.sample_rows.iter().map(|_| 11).collect();
        commit(&mut s, t, &vec![0; p.entries.len()], &sampled);
        s.check_invariants().unwrap();
    }
    // a: committed 8 (needs 3 pages next), b: committed 8 -> a's growth evicts b.
    let (t, p) = step(&mut s);
    assert_eq!(s.num_preemptions(), 1);
    assert_eq!(p.entries.iter().map(|e| e.handle).collect::<Vec<_>>(), vec![a]);
    assert_eq!(s.request(b).unwrap().phase(), Phase::Preempted);
    let sampled: Vec<u32> = p.sample_rows.iter().map(|_| 12).collect();
    commit(&mut s, t, &vec![0; p.entries.len()], &sampled);
    s.finish(a, FinishReason::Abort).unwrap();
    // b resumes: recompute all tokens but the bonus, sample nothing, keep the bonus. Its
    // first page (published when b was preempted, freed last) is still cached: a's growth
    // evicted b's second page, which was freed first.
    let tokens_b = s.request(b).unwrap().tokens().to_vec();
    let (t, p) = step(&mut s);
    assert_eq!(p.entries[0].kind, EntryKind::Prefill { start: 4, len: tokens_b.len() - 5, sample: false });
    assert_eq!(s.request(b).unwrap().num_cached_tokens(), 0, "cached tokens count the first admission");
    assert!(p.sample_rows.is_empty());
    let out = commit(&mut s, t, &[0], &[]);
    assert!(out[0].1.is_empty());
    assert_eq!(decoding_at(&s, b), (Phase::Decoding, tokens_b.len() - 1, *tokens_b.last().unwrap()));
    assert_eq!(s.num_preemptions(), 1);
    s.check_invariants().unwrap();
}

#[test]
fn max_num_seqs_caps_running() {
    let mut c = cfg(64, 0);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(c).unwrap();
    for i in 0..4 {
        s.add_request(&format!("r{i}"), vec![1, 2, 3], 5, vec![]).unwrap();
    }
    let (_, p) = step(&mut s);
    assert_eq!(p.entries.len(), 2);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn failed_step_finishes_its_requests_and_frees_pages() {
    let mut s = sched(32, 2);
    s.add_request("a", vec![1, 2, 3], 5, vec![]).unwrap();
    s.add_request("b", vec![1, 2, 3], 5, vec![]).unwrap();
    let (t, _) = step(&mut s);
    let failed = s.fail(t, FinishReason::Error).unwrap();
    assert_eq!(failed.len(), 2);
    assert_eq!(s.num_free_pages(), 31);
    assert!(s.schedule().unwrap().is_none());
}

#[test]
fn config_is_validated() {
    let mut c = cfg(32, 15);
    c.max_num_batched_tokens = 8;
    assert!(matches!(Scheduler::new(c), Err(CoreError::InvalidConfig(_))));
}

#[test]
fn decoding_requests_lead_the_plan_so_the_draft_pass_is_a_prefix() {
    let mut s = sched(64, 3);
    let a = s.add_request("a", vec![1, 2, 3], 10, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[5]);
    let b = s.add_request("b", vec![4, 5, 6, 7, 8], 10, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(p.entries.iter().map(|e| e.handle).collect::<Vec<_>>(), vec![a, b]);
    let c = s.add_request("c", vec![9; 6], 10, vec![]).unwrap();
    commit(&mut s, t, &[1, 0], &[6, 7, 8, 9, 10]);
    // Running order is a, b, then c is admitted; b and a decode, c prefills.
    let (_, p) = step(&mut s);
    assert_eq!(p.num_decode, 2);
    assert!(matches!(p.entries[2].kind, EntryKind::Prefill { .. }) && p.entries[2].handle == c);
    assert_eq!(p.num_draft_rows(), 8);
    assert_eq!(&p.target.input_ids[..8], &[7, 999, 999, 999, 10, 999, 999, 999]);
    assert_eq!(p.verify_target_rows, vec![1, 2, 3, 5, 6, 7]);
    assert_eq!(p.draft.proposal_rows, vec![1, 2, 3, 5, 6, 7]);
}

#[test]
fn draft_block_longer_than_the_verify_block_lies_in_reserved_pages() {
    // K = 3 verified of a draft trained on blocks of 8 rows: the draft pass runs 8 rows per
    // request, at committed..committed+7, in slots the scheduler reserved for it.
    let mut c = cfg(64, 3);
    c.draft_block_rows = 8;
    let mut s = Scheduler::new(c).unwrap();
    let h = s.add_request("a", vec![1, 2, 3, 4, 5, 6], 30, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[7]);
    let (_, p) = step(&mut s);
    assert_eq!((p.block_rows, p.draft.rows, p.num_draft_rows()), (4, 8, 8));
    assert_eq!(p.draft.input_ids, vec![7, 999, 999, 999, 999, 999, 999, 999]);
    assert_eq!(p.draft.positions, (6..14).collect::<Vec<i64>>());
    assert_eq!(p.draft.seq_lens, vec![14]);
    assert_eq!(p.draft.proposal_rows, vec![1, 2, 3]);
    let pages = s.request(h).unwrap().pages().pages().to_vec();
    let ps = s.config().page_size as i64;
    let want: Vec<i64> = (6..14).map(|q: i64| pages[(q / ps) as usize] as i64 * ps + q % ps).collect();
    assert_eq!(p.draft.slot_mapping, want);
    assert_eq!(&p.draft.slot_mapping[..4], &p.target.slot_mapping[..]);
}

#[test]
fn schedule_only_plans_one_running_request_and_admits_nobody() {
    let mut s = sched(64, 3);
    let a = s.add_request("a", vec![1, 2, 3], 10, vec![]).unwrap();
    let b = s.add_request("b", vec![4, 5], 10, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0, 0], &[7, 8]);
    let c = s.add_request("c", vec![6], 10, vec![]).unwrap();
    let (t, p) = s.schedule_only(b).unwrap().unwrap();
    assert_eq!(p.entries.iter().map(|e| e.handle).collect::<Vec<_>>(), vec![b]);
    assert_eq!(p.target.input_ids, vec![8, 999, 999, 999]);
    commit(&mut s, t, &[0], &[1, 1, 1, 1]);
    assert!(s.schedule_only(c).unwrap().is_none(), "a waiting request is not admitted");
    assert_eq!(s.request(a).unwrap().num_computed(), 3, "a did not run");
    s.check_invariants().unwrap();
}

// ---- prefix caching ------------------------------------------------------------------

/// Runs every request to completion with sampled token `tok` and full rejection.
fn drain(s: &mut Scheduler, tok: u32) {
    while let Some((t, p)) = s.schedule().unwrap() {
        let sampled = vec![tok; p.sample_rows.len()];
        commit(s, t, &vec![0; p.entries.len()], &sampled);
        s.check_invariants().unwrap();
    }
}

fn prefill_of(p: &StepPlan, h: u64) -> EntryKind {
    p.entries.iter().find(|e| e.handle == h).expect("planned").kind
}

#[test]
fn admission_shares_the_longest_cached_run_of_equal_full_pages() {
    let mut s = sched(32, 3);
    let a = s.add_request("a", (1..=10).collect(), 1, vec![]).unwrap();
    let (t, _) = step(&mut s);
    let pages_a = s.request(a).unwrap().pages().pages().to_vec();
    commit(&mut s, t, &[0], &[50]); // a finishes (max_tokens 1); its 2 full pages stay cached
    assert_eq!(s.pool().num_cached(), 2);
    assert_eq!(s.num_free_pages(), 31, "cached pages are free");
    // b shares tokens 1..=8 and then differs; c differs inside the second page.
    let mut pb: Vec<u32> = (1..=8).collect();
    pb.extend([70, 71, 72]);
    let b = s.add_request("b", pb, 4, vec![]).unwrap();
    let c = s.add_request("c", vec![1, 2, 3, 4, 5, 6, 99, 8, 9], 4, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(prefill_of(&p, b), EntryKind::Prefill { start: 8, len: 3, sample: true });
    assert_eq!(prefill_of(&p, c), EntryKind::Prefill { start: 4, len: 5, sample: true });
    // Rows start past the hit: b's first row is token 70 at position 8, in a fresh page.
    let eb = p.entries.iter().find(|e| e.handle == b).unwrap();
    assert_eq!((p.target.input_ids[eb.q_start], p.target.positions[eb.q_start]), (70, 8));
    assert_eq!(&s.request(b).unwrap().pages().pages()[..2], &pages_a[..2]);
    assert_eq!(&s.request(c).unwrap().pages().pages()[..1], &pages_a[..1]);
    assert_eq!(s.pool().refcount(pages_a[0]), 2);
    assert_eq!((s.request(b).unwrap().num_cached_tokens(), s.request(c).unwrap().num_cached_tokens()), (8, 4));
    assert_eq!((s.prefix_cache_queries(), s.prefix_cache_hits()), (10 + 11 + 9, 12));
    s.check_invariants().unwrap();
    let out = s.commit(t, &[0, 0], &[5, 6]).map_err(|r| r.error).unwrap();
    assert_eq!(out.num_cached_tokens, vec![8, 4]);
    drain(&mut s, 7);
    assert_eq!(s.num_free_pages(), 31);
    s.pool().check_integrity().unwrap();
}

#[test]
fn at_least_one_prompt_token_is_computed() {
    let mut s = sched(32, 0);
    s.add_request("a", (1..=8).collect(), 1, vec![]).unwrap();
    drain(&mut s, 9);
    // The same 8-token prompt: both pages are cached, but the last one ends the prompt, so
    // it is recomputed (its last row's logits give the first token).
    let b = s.add_request("b", (1..=8).collect(), 1, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(p.entries[0].kind, EntryKind::Prefill { start: 4, len: 4, sample: true });
    assert_eq!(p.sample_rows, vec![3]);
    commit(&mut s, t, &[0], &[9]);
    assert!(s.request(b).is_none());
    // A 9-token prompt sharing both pages computes only its ninth token.
    let c = s.add_request("c", (1..=9).collect(), 2, vec![]).unwrap();
    let (_, p) = step(&mut s);
    assert_eq!(p.entries[0].kind, EntryKind::Prefill { start: 8, len: 1, sample: true });
    assert_eq!(s.request(c).unwrap().num_cached_tokens(), 8);
}

#[test]
fn pages_are_published_only_once_the_committed_prefix_covers_them() {
    let mut s = sched(32, 3);
    let a = s.add_request("a", vec![1, 2, 3, 4, 5, 6], 20, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[7]);
    // committed 6: page 0 published, page 1 (positions 4..8) not: its draft context and
    // target KV for positions 6, 7 do not exist yet.
    assert_eq!(s.request(a).unwrap().num_frozen_pages(), 1);
    let (t, p) = step(&mut s);
    // The verify block (and the draft block: same slots) writes positions 6..10, past page 0.
    assert_eq!(p.target.positions, vec![6, 7, 8, 9]);
    // A request arriving now shares only page 0 even though its prompt equals a's tokens.
    let b = s.add_request("b", vec![1, 2, 3, 4, 5, 6, 7, 8, 9], 4, vec![]).unwrap();
    // Accept 1 of 3 drafts: committed 6 -> 8 (tokens 7, 8 committed) covers page 1.
    commit(&mut s, t, &[1], &[8, 9, 0, 0]);
    assert_eq!(s.request(a).unwrap().tokens(), &[1, 2, 3, 4, 5, 6, 7, 8, 9]);
    assert_eq!(s.request(a).unwrap().num_frozen_pages(), 2);
    let (_, p) = step(&mut s);
    assert_eq!(prefill_of(&p, b), EntryKind::Prefill { start: 8, len: 1, sample: true });
    let pa = s.request(a).unwrap().pages().pages().to_vec();
    assert_eq!(&s.request(b).unwrap().pages().pages()[..2], &pa[..2], "b shares a's committed pages");
    s.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_publishes_each_chunk_for_the_next_request() {
    let mut c = cfg(64, 3);
    c.max_num_batched_tokens = 8;
    let mut s = Scheduler::new(c).unwrap();
    let prompt: Vec<u32> = (100..120).collect();
    let a = s.add_request("a", prompt.clone(), 4, vec![]).unwrap();
    let b = s.add_request("b", prompt.clone(), 4, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(p.entries.len(), 1, "the budget is a's first chunk");
    commit(&mut s, t, &[0], &[]);
    // Each chunk's pages are published at its commit. a's second chunk takes the whole budget
    // again, so b waits; beside a's last chunk, b shares the 4 pages a's chunks computed.
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[]);
    let (_, p) = step(&mut s);
    assert_eq!(prefill_of(&p, a), EntryKind::Prefill { start: 16, len: 4, sample: true });
    assert_eq!(prefill_of(&p, b), EntryKind::Prefill { start: 16, len: 4, sample: true });
    s.check_invariants().unwrap();
}

#[test]
fn with_prefix_caching_off_nothing_is_shared_or_published() {
    let mut c = cfg(32, 3);
    c.enable_prefix_caching = false;
    let mut s = Scheduler::new(c).unwrap();
    s.add_request("a", (1..=10).collect(), 1, vec![]).unwrap();
    drain(&mut s, 5);
    let b = s.add_request("b", (1..=10).collect(), 1, vec![]).unwrap();
    let (_, p) = step(&mut s);
    assert_eq!(p.entries[0].kind, EntryKind::Prefill { start: 0, len: 10, sample: true });
    assert_eq!((s.pool().num_cached(), s.request(b).unwrap().num_cached_tokens()), (0, 0));
    assert_eq!((s.prefix_cache_queries(), s.prefix_cache_hits()), (0, 0));
    s.check_invariants().unwrap();
}

#[test]
fn cached_pages_are_evicted_least_recently_freed_first() {
    let mut s = sched(9, 0); // 8 usable pages of 4
    let old: Vec<u32> = (10..19).collect();
    let new: Vec<u32> = (30..39).collect();
    s.add_request("old", old.clone(), 1, vec![]).unwrap();
    drain(&mut s, 1);
    s.add_request("new", new.clone(), 1, vec![]).unwrap();
    drain(&mut s, 1);
    assert_eq!(s.pool().num_cached(), 4);
    // A 20-token prompt of other tokens takes 5 pages: the 4 never-used/uncached ones, then
    // the least recently freed cached page: old's deepest page (freed before its first).
    let big = s.add_request("big", (50..70).collect(), 1, vec![]).unwrap();
    let (t, _) = step(&mut s);
    assert_eq!(s.pool().num_evictions(), 1);
    commit(&mut s, t, &[0], &[1]);
    assert!(s.request(big).is_none());
    // big's 5 pages are cached too, freed after new's. old's first page survives; taking 2
    // fresh pages for "o" then evicts the least recently freed cached pages: new's two.
    let o = s.add_request("o", old, 1, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(prefill_of(&p, o), EntryKind::Prefill { start: 4, len: 5, sample: true });
    assert_eq!(s.pool().num_evictions(), 3);
    commit(&mut s, t, &[0], &[1]);
    let n = s.add_request("n", new, 1, vec![]).unwrap();
    let (_, p) = step(&mut s);
    assert_eq!(prefill_of(&p, n), EntryKind::Prefill { start: 0, len: 9, sample: true }, "new's pages are gone");
    s.check_invariants().unwrap();
}

#[test]
fn abort_and_failed_steps_leave_only_committed_pages_cached() {
    let mut s = sched(32, 3);
    let a = s.add_request("a", (1..=9).collect(), 20, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[10]);
    // A verify step is planned (writes positions 9..13), then a is aborted before commit.
    let (t, _) = step(&mut s);
    s.finish(a, FinishReason::Abort).unwrap();
    commit(&mut s, t, &[3], &[11, 12, 13, 14]);
    assert_eq!(s.pool().num_cached(), 2, "only the pages of the committed prefix");
    // A failed step commits nothing: b's rows past its hit are never published.
    let b = s.add_request("b", (1..=12).collect(), 5, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(prefill_of(&p, b), EntryKind::Prefill { start: 8, len: 4, sample: true });
    s.fail(t, FinishReason::Error).unwrap();
    assert_eq!(s.pool().num_cached(), 2);
    assert_eq!(s.num_free_pages(), 31);
    s.check_invariants().unwrap();
}

#[test]
fn equal_prefixes_computed_side_by_side_publish_once_and_chain_on() {
    let mut s = sched(32, 0);
    let prompt: Vec<u32> = (1..=9).collect();
    let a = s.add_request("a", prompt.clone(), 6, vec![]).unwrap();
    let b = s.add_request("b", prompt, 6, vec![]).unwrap();
    let (t, _) = step(&mut s); // both prefill the same 9 tokens in one step: no hit possible
    commit(&mut s, t, &[0, 0], &[20, 20]);
    // a published pages 0, 1; b found them published: duplicates, b's pages stay private.
    let (ra, rb) = (s.request(a).unwrap(), s.request(b).unwrap());
    assert_eq!(ra.frozen_entries(), rb.frozen_entries());
    assert!(rb.pages().pages().iter().all(|&p| s.pool().cache_meta(p).is_none()));
    for _ in 0..3 {
        let (t, _) = step(&mut s);
        commit(&mut s, t, &[0, 0], &[21, 21]);
    }
    // committed 12: page 2 (tokens 9, 20, 21, 21) of a is published; b's is a duplicate.
    assert_eq!(s.request(a).unwrap().num_frozen_pages(), 3);
    assert_eq!(s.request(a).unwrap().frozen_entries(), s.request(b).unwrap().frozen_entries());
    assert_eq!(s.pool().num_cached(), 3);
    s.check_invariants().unwrap();
}

#[test]
fn draft_len_schedule_shortens_the_block_as_the_batch_grows() {
    let mut c = cfg(64, 7);
    c.draft_len_policy = DraftLenPolicy::Schedule(vec![(1, 7), (2, 3)]);
    assert_eq!((c.block_rows_for(0), c.block_rows_for(1), c.block_rows_for(2), c.block_rows_for(9)), (8, 8, 4, 4));
    let mut s = Scheduler::new(c).unwrap();
    let a = s.add_request("a", vec![1, 2, 3], 30, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[5]);
    let (t, p) = step(&mut s); // one decoding request: 7 drafts
    assert_eq!((p.block_rows, p.draft.rows, p.entries[0].num_drafts()), (8, 8, 7));
    commit(&mut s, t, &[7], &[6; 8]);
    assert_eq!(decoding_at(&s, a).1, 3 + 1 + 7);
    let b = s.add_request("b", vec![4, 5], 30, vec![]).unwrap();
    let (t, p) = step(&mut s); // a decodes (7 drafts: only one request was decoding), b prefills
    assert_eq!(p.block_rows, 8);
    let n = p.num_sample_rows();
    commit(&mut s, t, &[2, 0], &vec![6; n]);
    let (t, p) = step(&mut s); // two decoding: 3 drafts each
    assert_eq!((p.block_rows, p.num_decode, p.entries[1].num_drafts()), (4, 2, 3));
    // An acceptance past the step's own block is refused, though the largest block allows it.
    let n = p.num_sample_rows();
    let refused = s.commit(t, &[4, 0], &vec![6; n]).unwrap_err();
    let t = refused.ticket;
    commit(&mut s, t, &[3, 1], &vec![6; n]);
    assert_eq!(decoding_at(&s, b).1, 2 + 1 + 1);
    s.check_invariants().unwrap();
}

#[test]
fn draft_len_schedule_is_validated() {
    for bad in [vec![(4, 3), (2, 1)], vec![(2, 0)], vec![(2, 8)]] {
        let mut c = cfg(64, 7);
        c.draft_len_policy = DraftLenPolicy::Schedule(bad);
        assert!(Scheduler::new(c).is_err());
    }
    let mut c = cfg(64, 0);
    c.draft_len_policy = DraftLenPolicy::Schedule(vec![(2, 1)]);
    assert!(Scheduler::new(c).is_err());
}

#[test]
fn draft_block_rows_reserve_kv_for_the_longer_draft_block() {
    // K = 3 verified rows of an 8-row draft block: admission and each decode step reserve 8.
    let mut c = cfg(64, 3);
    c.draft_block_rows = 8;
    assert_eq!(c.reserve_rows(), 8);
    let mut s = Scheduler::new(c.clone()).unwrap();
    let h = s.add_request("a".into(), vec![5; 7], 4, vec![]).unwrap();
    let (t, p) = s.schedule().unwrap().unwrap();
    let sampled = vec![9u32; p.num_sample_rows()];
    s.commit(t, &vec![0; p.entries.len()], &sampled).unwrap();
    let (_, p) = s.schedule().unwrap().unwrap();
    assert_eq!(p.block_rows, 4);
    let committed = s.request(h).unwrap().num_computed();
    assert!(s.request(h).unwrap().pages().capacity() >= committed + 8);
    for bad in [(3, 2), (0, 8)] {
        let mut c = cfg(64, bad.0);
        c.draft_block_rows = bad.1;
        assert!(matches!(Scheduler::new(c), Err(CoreError::InvalidConfig(_))));
    }
}

fn adaptive_cfg(k: usize) -> SchedulerConfig {
    let mut c = cfg(64, k);
    c.draft_len_policy = DraftLenPolicy::Adaptive { candidates: (0..=k).collect() };
    c
}

/// Costs of one bucket (batch 8): `seconds[k]` for k = 0..=K.
fn one_bucket(seconds: Vec<f64>) -> StepCosts {
    StepCosts::new(vec![8], (0..seconds.len()).collect(), vec![seconds]).unwrap()
}

#[test]
fn adaptive_block_rows_follow_the_choice_down_to_a_plain_decode_step() {
    let mut s = Scheduler::new(adaptive_cfg(3)).unwrap();
    let h = s.add_request("a", vec![1, 2, 3], 50, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[5]);
    // No costs yet: the largest block.
    assert_eq!(s.next_draft_len(), 3);
    let (t, p) = step(&mut s);
    assert_eq!((p.block_rows, p.draft.rows), (4, 4));
    commit(&mut s, t, &[3], &[6; 4]);
    // Drafting is cheap: still the largest block.
    s.set_step_costs(one_bucket(vec![1.0, 1.01, 1.02, 1.03])).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(p.block_rows, 4);
    commit(&mut s, t, &[3], &[6; 4]);
    // Drafting costs 5x a plain step: B = 1, no draft pass, one sampled row, one new token.
    s.set_step_costs(one_bucket(vec![1.0, 5.0, 5.0, 5.0])).unwrap();
    assert_eq!(s.next_draft_len(), 0);
    let committed = s.request(h).unwrap().num_computed();
    let (t, p) = step(&mut s);
    assert_eq!((p.block_rows, p.draft.rows, p.num_draft_rows(), p.entries[0].num_drafts()), (1, 0, 0, 0));
    assert_eq!((p.target.input_ids.clone(), p.sample_rows.clone()), (vec![6], vec![0]));
    assert!(p.verify_target_rows.is_empty() && p.draft.input_ids.is_empty());
    // A plain step can accept nothing.
    let refused = s.commit(t, &[1], &[7]).unwrap_err();
    assert!(matches!(refused.error, CoreError::InvalidCommit(_)));
    commit(&mut s, refused.ticket, &[0], &[7]);
    assert_eq!(decoding_at(&s, h), (Phase::Decoding, committed + 1, 7));
    // The KV reservation stays sized for the largest block.
    let (_, p) = step(&mut s);
    assert_eq!(p.block_rows, 1);
    assert!(s.request(h).unwrap().pages().capacity() >= committed + 1 + s.config().reserve_rows());
    // Counted: steps with decoding requests, by K (the prefill step is not one).
    assert_eq!(s.draft_len().counts(), vec![(0, 2), (1, 0), (2, 0), (3, 2)]);
    s.check_invariants().unwrap();
}

#[test]
fn commit_teaches_acceptance_and_prefill_teaches_nothing() {
    let mut s = Scheduler::new(adaptive_cfg(3)).unwrap();
    let fresh = DraftLen::new(s.config().draft_len_policy.clone(), 3);
    let a = s.add_request("a", vec![1, 2, 3], 50, vec![]).unwrap();
    let b = s.add_request("b", vec![4, 5, 6], 50, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0, 0], &[5, 5]);
    assert_eq!(s.draft_len().global_estimates(), fresh.global_estimates());
    assert_eq!(s.draft_len().num_tracked(), 0);
    // a accepts 1 of 3 drafts, b all 3: the same as feeding the estimator directly.
    let (t, p) = step(&mut s);
    let order: Vec<u64> = p.entries.iter().map(|e| e.handle).collect();
    let acc: Vec<u32> = order.iter().map(|&h| if h == a { 1 } else { 3 }).collect();
    commit(&mut s, t, &acc, &[6; 8]);
    let mut want = fresh.clone();
    want.observe_step(order.iter().zip(&acc).map(|(&h, &x)| (h, 3, x as usize)));
    assert_eq!(s.draft_len().global_estimates(), want.global_estimates());
    for h in [a, b] {
        assert_eq!(s.draft_len().request_estimates(h), want.request_estimates(h));
    }
    assert!(s.draft_len().request_estimates(b)[2] > s.draft_len().request_estimates(a)[2]);
    assert_eq!(s.draft_len().num_tracked(), 2);
}

#[test]
fn acceptance_counts_die_with_the_request() {
    let mut s = Scheduler::new(adaptive_cfg(3)).unwrap();
    // a: finished by max_tokens inside a commit; b: aborted; c: failed step; d: aborted mid-step.
    let a = s.add_request("a", vec![1, 2, 3], 3, vec![]).unwrap();
    let b = s.add_request("b", vec![1, 2, 4], 50, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0, 0], &[5, 5]);
    let (t, p) = step(&mut s);
    assert_eq!(p.num_decode, 2);
    let out = commit(&mut s, t, &[3, 3], &[6; 8]);
    assert!(out.iter().any(|(h, _, f)| *h == a && *f == Some(FinishReason::Length)));
    assert_eq!(s.draft_len().num_tracked(), 1, "a finished: its counts are gone");
    s.finish(b, FinishReason::Abort).unwrap();
    assert_eq!(s.draft_len().num_tracked(), 0);

    let c = s.add_request("c", vec![7, 8], 50, vec![]).unwrap();
    let d = s.add_request("d", vec![7, 9], 50, vec![]).unwrap();
    for _ in 0..2 {
        let (t, p) = step(&mut s);
        let n = p.num_sample_rows();
        commit(&mut s, t, &vec![0; p.entries.len()], &vec![6; n]);
    }
    assert_eq!(s.draft_len().num_tracked(), 2);
    let (t, _) = step(&mut s);
    s.finish(d, FinishReason::Abort).unwrap();
    assert_eq!(s.fail(t, FinishReason::Error).unwrap(), vec![c]);
    assert_eq!(s.draft_len().num_tracked(), 0);
    s.check_invariants().unwrap();
    // A request aborted between schedule and commit learns nothing at commit.
    let e = s.add_request("e", vec![3, 3], 50, vec![]).unwrap();
    let f = s.add_request("f", vec![3, 4], 50, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0, 0], &[6, 6]);
    let (t, p) = step(&mut s);
    s.finish(e, FinishReason::Abort).unwrap();
    let n = p.num_sample_rows();
    commit(&mut s, t, &[2, 2], &vec![6; n]);
    assert_eq!(s.draft_len().num_tracked(), 1);
    assert_ne!(s.draft_len().request_estimates(f), s.draft_len().global_estimates());
    s.check_invariants().unwrap();
}

#[test]
fn schedule_only_chooses_for_its_request_alone() {
    let mut s = Scheduler::new(adaptive_cfg(3)).unwrap();
    let good = s.add_request("good", vec![1, 2, 3], 100, vec![]).unwrap();
    let bad = s.add_request("bad", vec![1, 2, 4], 100, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0, 0], &[5, 5]);
    // Before costs: the largest block. `good` accepts every draft, `bad` none.
    for _ in 0..8 {
        let (t, p) = step(&mut s);
        let acc: Vec<u32> = p.entries.iter().map(|e| if e.handle == good { 3 } else { 0 }).collect();
        commit(&mut s, t, &acc, &vec![6; p.num_sample_rows()]);
    }
    s.set_step_costs(one_bucket(vec![1.0, 1.2, 1.4, 1.6])).unwrap();
    let (t, p) = s.schedule_only(good).unwrap().unwrap();
    assert_eq!((p.entries.len(), p.block_rows), (1, 4));
    s.cancel(t).unwrap();
    let (t, p) = s.schedule_only(bad).unwrap().unwrap();
    assert_eq!((p.entries.len(), p.block_rows), (1, 1));
    s.cancel(t).unwrap();
    // Cancelled steps are still counted as planned.
    assert_eq!(s.draft_len().counts().iter().map(|&(_, c)| c).sum::<u64>(), 8 + 2);
    s.check_invariants().unwrap();
}

fn hybrid_cfg(num_pages: usize, k: usize) -> SchedulerConfig {
    let mut c = cfg(num_pages, k);
    c.enable_prefix_caching = false;
    c.state_slots = true;
    c
}

#[test]
fn hybrid_state_slots_follow_the_committed_row() {
    let mut s = Scheduler::new(hybrid_cfg(32, 3)).unwrap();
    let h = s.add_request("a", vec![1, 2, 3, 4, 5, 6], 20, vec![]).unwrap();
    s.cfg.max_num_batched_tokens = 4; // two prefill chunks
                                      // Chunk 1: no state yet (read -1); the last row keeps its state in a fresh slot.
    let (t, p) = step(&mut s);
    assert_eq!(p.state_read, vec![-1]);
    assert_eq!(p.state_write[..3], [-1, -1, -1]);
    let w1 = p.state_write[3];
    let slots = s.request(h).unwrap().state_slots().to_vec();
    assert_eq!(slots.len(), 2, "a prefilling request holds 2 state slots");
    assert!(slots.contains(&(w1 as u32)) && !s.request(h).unwrap().pages().pages().contains(&(w1 as u32)));
    commit(&mut s, t, &[0], &[]);
    assert_eq!(s.request(h).unwrap().committed_slot(), Some(w1 as u32));
    // Chunk 2 reads it and writes the other slot.
    let (t, p) = step(&mut s);
    assert_eq!(p.state_read, vec![w1]);
    let w2 = p.state_write[1];
    assert!(w2 >= 0 && w2 != w1 && p.state_write[0] == -1);
    commit(&mut s, t, &[0], &[7]);
    assert_eq!(s.request(h).unwrap().committed_slot(), Some(w2 as u32));
    s.cfg.max_num_batched_tokens = 64;
    // A verify block: B + 1 = 5 slots; every row keeps a state, none in the committed slot.
    let (t, p) = step(&mut s);
    assert_eq!(s.request(h).unwrap().state_slots().len(), 5);
    assert_eq!(p.state_read, vec![w2]);
    assert!(p.state_write.iter().all(|&w| w >= 0 && w != w2));
    let rows = p.state_write.clone();
    commit(&mut s, t, &[2], &[8, 9, 10, 11]);
    assert_eq!(s.request(h).unwrap().committed_slot(), Some(rows[2] as u32), "accepted 2: row 2's state");
    s.check_invariants().unwrap();
    // A second request under pressure preempts it: every slot goes back; it resumes from no state.
    let free_before = s.num_free_pages();
    let held = s.request(h).unwrap().pages().len() + 5;
    s.preempt(h);
    assert_eq!(s.num_free_pages(), free_before + held);
    assert_eq!((s.request(h).unwrap().committed_slot(), s.request(h).unwrap().state_slots().len()), (None, 0));
    let (t, p) = step(&mut s);
    assert_eq!(p.state_read, vec![-1], "resumed after preemption: recomputed from no state");
    commit(&mut s, t, &[0], &[]);
    s.check_invariants().unwrap();
    s.finish(h, FinishReason::Abort).unwrap();
    assert_eq!(s.num_free_pages(), 31, "abort frees every page and slot");
}

#[test]
fn hybrid_plain_decode_steps_read_through_the_committed_slot() {
    let mut c = hybrid_cfg(32, 3);
    c.draft_len_policy = DraftLenPolicy::Adaptive { candidates: vec![0, 3] };
    let mut s = Scheduler::new(c).unwrap();
    // Drafting never pays: every step verifies no drafts (B = 1).
    s.set_step_costs(StepCosts::new(vec![8], vec![0, 3], vec![vec![1.0, 100.0]]).unwrap()).unwrap();
    let h = s.add_request("a", vec![1, 2, 3], 20, vec![]).unwrap();
    let (t, _) = step(&mut s);
    commit(&mut s, t, &[0], &[5]);
    for i in 0..4 {
        let c = s.request(h).unwrap().committed_slot().unwrap();
        let (t, p) = step(&mut s);
        assert_eq!(p.block_rows, 1);
        assert_eq!(p.state_read, vec![c as i64]);
        assert_eq!(p.state_write.len(), 1);
        assert_ne!(p.state_write[0], c as i64);
        commit(&mut s, t, &[0], &[6 + i]);
        assert_eq!(s.request(h).unwrap().committed_slot(), Some(p.state_write[0] as u32));
        s.check_invariants().unwrap();
    }
}

#[test]
fn hybrid_admission_counts_state_slots_and_refuses_prefix_caching() {
    let mut c = hybrid_cfg(32, 3);
    c.enable_prefix_caching = true;
    assert!(matches!(Scheduler::new(c), Err(CoreError::InvalidConfig(m)) if m.contains("prefix caching")));
    // 7 usable pages: 4 KV pages at full length (8 + 4 tokens, 4 reserved) + 5 state slots do not fit.
    let mut s = Scheduler::new(hybrid_cfg(8, 3)).unwrap();
    assert_eq!(s.config().state_slots_per_seq(), 5);
    let err = s.add_request("a", vec![1; 8], 4, vec![]).unwrap_err();
    assert!(matches!(err, CoreError::Rejected { .. }) && err.to_string().contains("state slots"), "{err}");
    let mut s = Scheduler::new(hybrid_cfg(10, 3)).unwrap(); // 9 usable: 4 + 5
    assert!(s.add_request("a", vec![1; 8], 4, vec![]).is_ok());
}

#[test]
fn mixed_step_limit_caps_prefill_beside_decoding_only() {
    let mut s = sched(64, 3);
    s.set_mixed_step_limit(Some(MixedStepLimit { tokens: 6, requests: 2 })).unwrap();
    // No request decodes yet: the first step is not limited (budget 64).
    let a = s.add_request("a", (1..=10).collect(), 20, vec![]).unwrap();
    let (t, p) = step(&mut s);
    assert_eq!(p.entries[0].kind, EntryKind::Prefill { start: 0, len: 10, sample: true });
    commit(&mut s, t, &[0], &[7]);
    // Three arrivals beside a decoding request: 6 prefill tokens in at most 2 chunks.
    for (i, id) in ["b", "c", "d"].into_iter().enumerate() {
        let base = 100 * (i as u32 + 1);
        s.add_request(id, (base..base + 5).collect(), 5, vec![]).unwrap();
    }
    let (t, p) = step(&mut s);
    assert_eq!(p.num_decode, 1);
    assert_eq!(p.entries[0].handle, a);
    let kinds: Vec<EntryKind> = p.entries[1..].iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        vec![
            EntryKind::Prefill { start: 0, len: 5, sample: true },
            EntryKind::Prefill { start: 0, len: 1, sample: false }
        ]
    );
    let sampled: Vec<u32> = p.sample_rows.iter().map(|_| 8).collect();
    commit(&mut s, t, &[0, 0, 0], &sampled);
    // Next step: c's remaining 4 tokens, then d's first 2 (6 in all, 2 chunks).
    let (t, p) = step(&mut s);
    let kinds: Vec<EntryKind> = p.entries[p.num_decode..].iter().map(|e| e.kind).collect();
    assert_eq!(
        kinds,
        vec![
            EntryKind::Prefill { start: 1, len: 4, sample: true },
            EntryKind::Prefill { start: 0, len: 2, sample: false }
        ]
    );
    s.cancel(t).unwrap();
    // Lifted: the whole remainder in one step.
    s.set_mixed_step_limit(None).unwrap();
    let (_, p) = step(&mut s);
    let rows: usize = p.entries[p.num_decode..].iter().map(|e| e.num_rows()).sum();
    assert_eq!(rows, 4 + 5);
    assert!(s.set_mixed_step_limit(Some(MixedStepLimit { tokens: 0, requests: 1 })).is_err());
    assert!(s.set_mixed_step_limit(Some(MixedStepLimit { tokens: 4, requests: 0 })).is_err());
}
