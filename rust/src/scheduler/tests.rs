use super::*;

fn cfg(num_pages: usize, k: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_pages,
        block_size: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 128,
        num_speculative_tokens: k,
        mask_token_id: 999,
    }
}

fn sched(num_pages: usize, k: usize) -> Scheduler {
    Scheduler::new(cfg(num_pages, k)).unwrap()
}

#[test]
fn prefill_then_speculative_decode_layout() {
    let mut s = sched(32, 3);
    let h = s.add_request("a", vec![1, 2, 3, 4, 5], 20, vec![]).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(p.target.input_ids, vec![1, 2, 3, 4, 5]);
    assert_eq!(p.target.positions, vec![0, 1, 2, 3, 4]);
    assert_eq!(p.sample_rows, vec![4]);
    assert_eq!(p.num_draft_rows(), 0);
    assert_eq!(p.context_rows(&[0]).unwrap(), vec![0, 1, 2, 3, 4]);
    let out = s.commit(&p, &[0], &[7]).unwrap();
    assert_eq!(out[0].new_tokens, vec![7]);
    assert_eq!(s.request(h).unwrap().phase, Phase::Decoding { committed: 5, bonus: 7 });

    let p = s.schedule().unwrap();
    // Verify block [bonus, MASK x3] at positions 5..8; the draft pass is the same rows.
    assert_eq!(p.target.input_ids, vec![7, 999, 999, 999]);
    assert_eq!(p.target.positions, vec![5, 6, 7, 8]);
    assert_eq!(p.num_decode, 1);
    assert_eq!(p.num_draft_rows(), 4);
    assert_eq!(p.target.seq_lens, vec![9]);
    assert_eq!(p.sample_rows, vec![0, 1, 2, 3]);
    assert_eq!(p.verify_target_rows, vec![1, 2, 3]);
    // Pages for committed + B = 9 positions exist before drafting.
    assert!(s.request(h).unwrap().pages.capacity() >= 9);
    assert_eq!(p.context_rows(&[2]).unwrap(), vec![0, 1, 2]);
    let out = s.commit(&p, &[2], &[8, 9, 10, 11]).unwrap();
    assert_eq!(out[0].new_tokens, vec![8, 9, 10]);
    assert_eq!(s.request(h).unwrap().phase, Phase::Decoding { committed: 8, bonus: 10 });
    s.check_invariants().unwrap();
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut c = cfg(64, 0);
    c.max_num_batched_tokens = 4;
    let mut s = Scheduler::new(c).unwrap();
    let h = s.add_request("a", (1..=10).collect(), 3, vec![]).unwrap();
    for (start, len) in [(0, 4), (4, 4), (8, 2)] {
        let p = s.schedule().unwrap();
        assert_eq!(p.entries[0].kind, EntryKind::Prefill { start, len, sample: start + len == 10 });
        let sampled: Vec<u32> = p.sample_rows.iter().map(|_| 42).collect();
        s.commit(&p, &[0], &sampled).unwrap();
    }
    assert_eq!(s.request(h).unwrap().phase, Phase::Decoding { committed: 10, bonus: 42 });
}

#[test]
fn stop_token_and_max_tokens_cut_the_block() {
    let mut s = sched(32, 3);
    let a = s.add_request("a", vec![1, 2], 10, vec![50]).unwrap();
    let b = s.add_request("b", vec![1, 2], 3, vec![]).unwrap();
    let p = s.schedule().unwrap();
    s.commit(&p, &[0, 0], &[5, 5]).unwrap();
    let p = s.schedule().unwrap();
    // a: t1 is the stop token; b: only 2 more tokens allowed.
    let out = s.commit(&p, &[3, 3], &[6, 50, 7, 8, 6, 7, 8, 9]).unwrap();
    assert_eq!(out[0], CommitOutput { handle: a, new_tokens: vec![6, 50], finish: Some(FinishReason::Stop) });
    assert_eq!(out[1], CommitOutput { handle: b, new_tokens: vec![6, 7], finish: Some(FinishReason::Length) });
    assert_eq!(s.num_live(), 0);
    assert_eq!(s.num_free_pages(), 31);
}

#[test]
fn misuse_returns_errors_and_changes_nothing() {
    let mut s = sched(32, 3);
    let h = s.add_request("a", vec![1, 2], 10, vec![]).unwrap();
    assert!(matches!(s.add_request("a", vec![1], 1, vec![]), Err(CoreError::DuplicateRequest(_))));
    let p = s.schedule().unwrap();
    assert!(matches!(s.schedule(), Err(CoreError::PlanOutstanding { .. })));
    assert!(matches!(s.commit(&p, &[1], &[3]), Err(CoreError::InvalidCommit(_))), "prefill proposes 0");
    assert!(matches!(s.commit(&p, &[0], &[]), Err(CoreError::InvalidCommit(_))));
    s.commit(&p, &[0], &[3]).unwrap();
    assert!(matches!(s.commit(&p, &[0], &[3]), Err(CoreError::StalePlan(_))), "applied twice");
    let p = s.schedule().unwrap();
    let before = s.request(h).unwrap().tokens.clone();
    assert!(matches!(s.commit(&p, &[4], &[1, 2, 3, 4]), Err(CoreError::InvalidCommit(_))), "4 > 3 drafts");
    assert_eq!(s.request(h).unwrap().tokens, before);
    s.finish(h, FinishReason::Abort).unwrap();
    assert!(matches!(s.commit(&p, &[0], &[1, 2, 3, 4]), Err(CoreError::StalePlan(_))), "after abort");
    s.cancel(&p).unwrap();
    assert_eq!(s.num_free_pages(), 31);
    s.check_invariants().unwrap();
}

#[test]
fn admission_rejects_what_can_never_fit() {
    let mut s = sched(4, 3); // 3 usable pages of 4 = 12 slots
    assert!(matches!(s.add_request("e", vec![], 4, vec![]), Err(CoreError::Rejected { .. })));
    assert!(matches!(s.add_request("long", vec![1; 100], 40, vec![]), Err(CoreError::Rejected { .. })));
    // 6 + 4 + B(4) = 14 slots > 12
    assert!(matches!(s.add_request("pages", vec![1; 6], 4, vec![]), Err(CoreError::Rejected { .. })));
    s.add_request("ok", vec![1; 4], 4, vec![]).unwrap();
}

#[test]
fn preemption_evicts_the_newest_and_resumes_without_resampling() {
    let mut s = sched(5, 0); // 4 usable pages of 4 slots
    let a = s.add_request("a", vec![1; 4], 8, vec![]).unwrap();
    let b = s.add_request("b", vec![2; 4], 8, vec![]).unwrap();
    let p = s.schedule().unwrap();
    s.commit(&p, &[0, 0], &[10, 20]).unwrap();
    // Each decode step needs committed+1 slots: both grow into a second page; the pool has 4.
    for _ in 0..4 {
        let p = s.schedule().unwrap();
        let sampled: Vec<u32> = p.sample_rows.iter().map(|_| 11).collect();
        let acc = vec![0; p.entries.len()];
        s.commit(&p, &acc, &sampled).unwrap();
        s.check_invariants().unwrap();
    }
    // a: committed 8 (needs 3 pages next), b: committed 8 -> a's growth evicts b.
    let p = s.schedule().unwrap();
    assert_eq!(p.preempted, vec![b]);
    assert_eq!(s.request(b).unwrap().phase, Phase::Preempted);
    let acc = vec![0; p.entries.len()];
    let sampled: Vec<u32> = p.sample_rows.iter().map(|_| 12).collect();
    s.commit(&p, &acc, &sampled).unwrap();
    s.finish(a, FinishReason::Abort).unwrap();
    // b resumes: recompute all tokens but the bonus, sample nothing, keep the bonus.
    let tokens_b = s.request(b).unwrap().tokens.clone();
    let p = s.schedule().unwrap();
    assert_eq!(p.entries[0].kind, EntryKind::Prefill { start: 0, len: tokens_b.len() - 1, sample: false });
    assert!(p.sample_rows.is_empty());
    let out = s.commit(&p, &[0], &[]).unwrap();
    assert!(out[0].new_tokens.is_empty());
    assert_eq!(
        s.request(b).unwrap().phase,
        Phase::Decoding { committed: tokens_b.len() - 1, bonus: *tokens_b.last().unwrap() }
    );
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
    let p = s.schedule().unwrap();
    assert_eq!(p.entries.len(), 2);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn failed_step_finishes_its_requests_and_frees_pages() {
    let mut s = sched(32, 2);
    s.add_request("a", vec![1, 2, 3], 5, vec![]).unwrap();
    s.add_request("b", vec![1, 2, 3], 5, vec![]).unwrap();
    let p = s.schedule().unwrap();
    let failed = s.fail(&p, FinishReason::Error).unwrap();
    assert_eq!(failed.len(), 2);
    assert_eq!(s.num_free_pages(), 31);
    assert!(s.schedule().unwrap().is_empty());
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
    let p = s.schedule().unwrap();
    s.commit(&p, &[0], &[5]).unwrap();
    let b = s.add_request("b", vec![4, 5, 6, 7, 8], 10, vec![]).unwrap();
    let p = s.schedule().unwrap();
    assert_eq!(p.entries.iter().map(|e| e.handle).collect::<Vec<_>>(), vec![a, b]);
    let c = s.add_request("c", vec![9; 6], 10, vec![]).unwrap();
    s.commit(&p, &[1, 0], &[6, 7, 8, 9, 10]).unwrap();
    // Running order is a, b, then c is admitted; b and a decode, c prefills.
    let p = s.schedule().unwrap();
    assert_eq!(p.num_decode, 2);
    assert!(matches!(p.entries[2].kind, EntryKind::Prefill { .. }) && p.entries[2].handle == c);
    assert_eq!(p.num_draft_rows(), 8);
    assert_eq!(&p.target.input_ids[..8], &[7, 999, 999, 999, 10, 999, 999, 999]);
    assert_eq!(p.verify_target_rows, vec![1, 2, 3, 5, 6, 7]);
}
