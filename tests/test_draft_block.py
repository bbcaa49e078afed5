"""Every decode step drafts the draft's whole block (D rows) and verifies K of its proposals
(the plan's draft pass, rust/src/plan.rs): a shorter K keeps the first K proposals of the
full block, on the eager path and in the decode step (interpreter kernels on CPU), and the
block's arrays agree with the scheduler's verify block and page tables."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_engine import LLM, SamplingParams, _core

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7, 3, 61, 8, 150, 33, 21]}
ONE_STEP = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


def test_draft_block_arrays_extend_the_verify_block():
    d, ps, mask = 8, 4, 999
    s = _core.Scheduler(num_pages=64, page_size=ps, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                        num_speculative_tokens=2, mask_token_id=mask, draft_block_rows=d)
    for i, n in enumerate([7, 10]):
        s.add_request(str(i), np.arange(3, 3 + n), 20)
    plan = s.schedule()
    s.commit(plan, np.zeros(len(plan), np.int64), np.full(len(plan.sample_rows), 9, np.int64))
    plan = s.schedule()
    assert plan.num_decode == 2 and plan.block_rows == 3
    b = plan.block_rows
    assert plan.draft_rows == d
    ids, pos, slots = (x.reshape(2, d) for x in (plan.draft_input_ids, plan.draft_positions, plan.draft_slot_mapping))
    assert (ids[:, 0] == 9).all() and (ids[:, 1:] == mask).all()
    for i in range(2):
        committed = plan.positions[plan.query_start_loc[i]]
        assert list(pos[i]) == list(range(committed, committed + d))
        # its first B rows are the verify block's rows, at the same slots
        q = plan.query_start_loc[i]
        assert list(slots[i, :b]) == list(plan.slot_mapping[q:q + b])
        table = plan.draft_page_tables[i]
        assert all(slots[i, j] == table[p // ps] * ps + p % ps for j, p in enumerate(pos[i]))
        assert plan.draft_seq_lens[i] == committed + d
    assert plan.draft_query_start_loc.tolist() == [0, d, 2 * d]
    assert plan.draft_proposal_rows.tolist() == [1, 2, d + 1, d + 2]
    with pytest.raises(Exception, match="draft_block_rows"):
        _core.Scheduler(num_pages=64, page_size=ps, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                        num_speculative_tokens=3, draft_block_rows=2)


def _first_proposals(llm) -> list[int]:
    """The proposals of the first decode step of PROMPT (eager or decode-graph step alike:
    both run worker/step.py's `run_step`)."""
    seen: list[list[int]] = []
    target = llm.engine.runner.target
    real_propose = target.propose

    def rec(h):
        out = real_propose(h)
        seen.append(out.tolist())
        return out

    target.propose = rec
    llm.generate(PROMPT, ONE_STEP, use_tqdm=False)
    assert seen, "a decode step drafted"
    return seen[0]


def _llm(qwen3_dir, draft, k, **kw):
    return LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=2,
               speculative_config={"method": "dflash", "model": str(draft), "num_speculative_tokens": k}, **kw)


def test_shorter_k_keeps_the_full_blocks_first_proposals(qwen3_dir, random_draft_dir):
    """Block-4 draft, exact CPU mode: K = 1 and 2 propose the first 1 and 2 tokens of K = 3."""
    full = _first_proposals(_llm(qwen3_dir, random_draft_dir, 3, batch_invariant=True))
    assert len(full) == 3
    for k in (1, 2):
        assert _first_proposals(_llm(qwen3_dir, random_draft_dir, k, batch_invariant=True)) == full[:k]


def test_shorter_k_in_the_decode_step_keeps_the_full_blocks_proposals(qwen3_dir, random_draft_dir, monkeypatch):
    """The decode step (interpreter kernels on CPU) builds the same D-row block on the device."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the interpreter mode is for machines without a GPU")
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    full = _first_proposals(_llm(qwen3_dir, random_draft_dir, 3))
    assert len(full) == 3
    short = _llm(qwen3_dir, random_draft_dir, 1)
    assert short.engine.runner.graphs[2].d == 4
    assert _first_proposals(short) == full[:1]
