"""Every decode step drafts the draft's whole block (D rows) and verifies K of its proposals
(draft_block.py): a shorter K keeps the first K proposals of the full block, on the eager
path and in the decode step (interpreter kernels on CPU), and the block's arrays agree with
the scheduler's verify block and page tables."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_engine import LLM, SamplingParams, _core
from dflash_engine.draft_block import draft_block

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
    first = plan.query_start_loc[:2]
    blk = draft_block(torch.tensor(plan.positions[first]), torch.tensor(plan.input_ids[first]),
                      torch.tensor(plan.page_tables[:2]), d, b, ps, mask)
    ids, pos, slots = (x.numpy().reshape(2, d) for x in (blk.input_ids, blk.positions, blk.slot_mapping))
    assert (ids[:, 0] == 9).all() and (ids[:, 1:] == mask).all()
    for i in range(2):
        committed = plan.positions[plan.query_start_loc[i]]
        assert list(pos[i]) == list(range(committed, committed + d))
        # its first B rows are the verify block's rows, at the same slots
        q = plan.query_start_loc[i]
        assert list(slots[i, :b]) == list(plan.slot_mapping[q:q + b])
        table = plan.page_tables[i]
        assert all(slots[i, j] == table[p // ps] * ps + p % ps for j, p in enumerate(pos[i]))
        assert blk.seq_lens[i] == committed + d
    assert blk.query_start_loc.tolist() == [0, d, 2 * d]
    assert blk.proposal_rows.tolist() == [1, 2, d + 1, d + 2]
    live = draft_block(torch.tensor(plan.positions[first]), torch.tensor(plan.input_ids[first]),
                       torch.tensor(plan.page_tables[:2]), d, b, ps, mask, live=torch.tensor([True, False]))
    assert (live.slot_mapping[d:] == -1).all() and live.seq_lens.tolist() == [blk.seq_lens[0], 0]
    with pytest.raises(Exception, match="draft_block_rows"):
        _core.Scheduler(num_pages=64, page_size=ps, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                        num_speculative_tokens=3, draft_block_rows=2)


def _first_proposals(llm, graph: bool) -> list[int]:
    """The proposals of the first decode step of PROMPT."""
    from dflash_engine.decode_graph import DecodeGraphRunner

    seen: list[list[int]] = []
    runner = llm.engine.runner
    if graph:
        real = DecodeGraphRunner._draft

        def rec(self, bs, x):
            ids, drafts = real(self, bs, x)
            seen.append(drafts.view(bs, -1)[0].tolist())
            return ids, drafts

        DecodeGraphRunner._draft = rec
    else:
        real_propose = runner.target.propose

        def rec_p(h):
            out = real_propose(h)
            seen.append(out.tolist())
            return out

        runner.target.propose = rec_p
    try:
        llm.generate(PROMPT, ONE_STEP, use_tqdm=False)
    finally:
        if graph:
            DecodeGraphRunner._draft = real
    assert seen, "a decode step drafted"
    return seen[0]


def _llm(qwen3_dir, draft, k, **kw):
    return LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=2,
               speculative_config={"method": "dflash", "model": str(draft), "num_speculative_tokens": k}, **kw)


def test_shorter_k_keeps_the_full_blocks_first_proposals(qwen3_dir, random_draft_dir):
    """Block-4 draft, exact CPU mode: K = 1 and 2 propose the first 1 and 2 tokens of K = 3."""
    full = _first_proposals(_llm(qwen3_dir, random_draft_dir, 3, batch_invariant=True), graph=False)
    assert len(full) == 3
    for k in (1, 2):
        assert _first_proposals(_llm(qwen3_dir, random_draft_dir, k, batch_invariant=True), graph=False) == full[:k]


def test_shorter_k_in_the_decode_step_keeps_the_full_blocks_proposals(qwen3_dir, random_draft_dir, monkeypatch):
    """The decode step (interpreter kernels on CPU) builds the same D-row block on the device."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the interpreter mode is for machines without a GPU")
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    full = _first_proposals(_llm(qwen3_dir, random_draft_dir, 3), graph=True)
    assert len(full) == 3
    short = _llm(qwen3_dir, random_draft_dir, 1)
    assert short.engine.runner.decode_graphs.d == 4
    assert _first_proposals(short, graph=True) == full[:1]
