//! The largest eager step the engine can plan, as a [`StepPlan`] over a 2-page KV cache:
//! the model runner runs it once at startup to measure peak activation memory (and prove
//! that the largest step fits) before it sizes the pool.
//!
//! `max_num_seqs - 1` decoding requests of B rows (draft pass of D rows each, verify block,
//! B sampled rows) as far as the token budget allows, then prefill chunks (one sampled row
//! each, at most `max_model_len` rows) filling the rest of it. Every context is
//! `max_model_len` long (the widest attention and page tables); every page-table entry is
//! the null page and every slot lies in page 1, in bounds of a 2-page cache. With
//! `state_slots` (hybrid targets) every request reads no state and keeps the states a real
//! step keeps (a prefill chunk's last row, every verify row) in slot 1.

use crate::error::{CoreError, CoreResult};
use crate::plan::{draft_pass_rows, EntryKind, PlanEntry, StepPlan};
use crate::scheduler::pages_per_seq;

#[allow(clippy::too_many_arguments)]
pub fn profile_plan(
    num_tokens: usize,
    max_num_seqs: usize,
    block_rows: usize,
    draft_block_rows: usize,
    reserve_rows: usize,
    max_model_len: usize,
    page_size: usize,
    mask_token_id: u32,
    state_slots: bool,
) -> CoreResult<StepPlan> {
    let (b, ps) = (block_rows, page_size);
    if b == 0 || ps == 0 || max_num_seqs == 0 || num_tokens == 0 || max_model_len < b || reserve_rows < b {
        return Err(CoreError::InvalidConfig(format!(
            "profile_plan: need block_rows, page_size, max_num_seqs, num_tokens >= 1, max_model_len >= block_rows \
             and reserve_rows >= block_rows (got {b}, {ps}, {max_num_seqs}, {num_tokens}, {max_model_len}, {reserve_rows})"
        )));
    }
    let n_dec = (max_num_seqs - 1).min(num_tokens / b);
    let mut q_lens = vec![b; n_dec];
    let mut rest = num_tokens - n_dec * b;
    while rest > 0 && q_lens.len() < max_num_seqs {
        let q = rest.min(max_model_len);
        q_lens.push(q);
        rest -= q;
    }
    let d = draft_pass_rows(b, draft_block_rows);
    let width = pages_per_seq(max_model_len, reserve_rows, ps);
    let mask = mask_token_id as i64;
    let slot = |i: usize| (ps + i % ps) as i64; // page 1, over and over
    let mut plan = StepPlan { block_rows: b, num_decode: n_dec, ..Default::default() };
    plan.draft.rows = d;
    let t = &mut plan.target;
    t.max_pages = width;
    t.query_start_loc.push(0);
    for (i, &q) in q_lens.iter().enumerate() {
        let q_start = t.input_ids.len();
        let sample_start = plan.sample_rows.len();
        let first = max_model_len - q;
        t.input_ids.extend(std::iter::repeat_n(0, q));
        t.positions.extend((first..max_model_len).map(|p| p as i64));
        t.slot_mapping.extend((q_start..q_start + q).map(slot));
        t.query_start_loc.push((q_start + q) as i32);
        t.seq_lens.push(max_model_len as i32);
        t.page_tables.extend(std::iter::repeat_n(0, width));
        let kind = if i < n_dec {
            plan.sample_rows.extend((q_start..q_start + b).map(|r| r as i64));
            plan.verify_target_rows.extend((q_start + 1..q_start + b).map(|r| r as i64));
            if d > 0 {
                let dp = &mut plan.draft;
                let at = dp.input_ids.len();
                dp.input_ids.push(0);
                dp.input_ids.extend(std::iter::repeat_n(mask, d - 1));
                dp.positions.extend((first..first + d).map(|p| p as i64));
                dp.slot_mapping.extend((at..at + d).map(slot));
                dp.seq_lens.push((first + d) as i32);
                dp.proposal_rows.extend((at + 1..at + b).map(|r| r as i64));
            }
            EntryKind::Decode { committed: first }
        } else {
            plan.sample_rows.push((q_start + q - 1) as i64);
            EntryKind::Prefill { start: first, len: q, sample: true }
        };
        let num_samples = plan.sample_rows.len() - sample_start;
        if state_slots {
            // Every request starts from no state; kept rows write slot 1 (page 1, as the KV).
            plan.state_read.push(-1);
            let keeps = |t: usize| matches!(kind, EntryKind::Decode { .. }) || t + 1 == q;
            plan.state_write.extend((0..q).map(|t| if keeps(t) { 1 } else { -1 }));
        }
        plan.entries.push(PlanEntry {
            handle: i as u64,
            kind,
            q_start,
            sample_start,
            num_samples,
            state_writes: Vec::new(),
        });
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_the_budget_with_decode_blocks_then_prefill_chunks() {
        let p = profile_plan(40, 4, 4, 8, 8, 32, 16, 9, false).unwrap();
        assert_eq!((p.num_decode, p.block_rows, p.draft.rows), (3, 4, 8));
        assert_eq!(p.target.num_rows(), 40); // 3 blocks of 4, one chunk of 28
        assert_eq!(p.target.query_start_loc, vec![0, 4, 8, 12, 40]);
        assert_eq!(p.sample_rows.len(), 3 * 4 + 1);
        assert_eq!(p.draft.input_ids.len(), 3 * 8);
        assert_eq!(&p.draft.input_ids[..8], &[0, 9, 9, 9, 9, 9, 9, 9]);
        assert_eq!(p.draft.proposal_rows, vec![1, 2, 3, 9, 10, 11, 17, 18, 19]);
        assert!(p.target.slot_mapping.iter().chain(&p.draft.slot_mapping).all(|&s| (16..32).contains(&s)));
        assert!(p.target.page_tables.iter().all(|&x| x == 0));
        assert_eq!(p.target.page_tables.len(), 4 * pages_per_seq(32, 8, 16));
    }

    #[test]
    fn spec_off_has_no_draft_pass_and_bad_shapes_are_refused() {
        let p = profile_plan(10, 4, 1, 0, 1, 32, 16, 0, false).unwrap();
        assert_eq!((p.num_decode, p.draft.rows, p.num_draft_rows()), (3, 0, 0));
        assert!(profile_plan(10, 4, 0, 0, 1, 32, 16, 0, false).is_err());
        assert!(profile_plan(10, 4, 4, 0, 2, 32, 16, 0, false).is_err());
        assert!(p.state_read.is_empty() && p.state_write.is_empty());
    }

    #[test]
    fn hybrid_profile_keeps_states_like_a_real_step() {
        let p = profile_plan(40, 4, 4, 8, 8, 32, 16, 9, true).unwrap();
        assert_eq!(p.state_read, vec![-1; 4]);
        assert_eq!(p.state_write.len(), 40);
        assert!(p.state_write[..12].iter().all(|&s| s == 1), "every verify row keeps its state");
        assert!(p.state_write[12..39].iter().all(|&s| s == -1) && p.state_write[39] == 1, "a chunk keeps its last");
    }
}
