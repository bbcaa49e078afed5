"""Deferred draft-context writes of plain steps (worker/deferred_context.py): when kept rows
are written, in which order, and that the engine's draft context ends as if every step had
written its own rows."""
from __future__ import annotations

import torch

from dflash_engine import LLM, SamplingParams
from dflash_engine.worker.deferred_context import DeferredContext


class FakeDraft:
    def __init__(self):
        self.calls = []

    def write_context(self, taps, positions, slots, kv):
        self.calls.append((taps.clone(), positions.clone(), slots.clone(), kv))


def rows(first: int, n: int, slot0: int | None = None):
    pos = torch.arange(first, first + n)
    slots = pos + (1000 if slot0 is None else slot0 - first)
    return torch.randn(n, 6), pos, slots


def test_kept_rows_are_written_once_in_order_before_a_drafting_step():
    d = FakeDraft()
    deferred = DeferredContext(d, lambda: "pool")
    kept = []
    for step in range(3):  # three plain steps of requests 1 and 2
        assert deferred.before_step([1, 2], drafts=False)
        kept.append(rows(10 * step, 2))
        deferred.keep(*kept[-1])
    assert d.calls == []  # nothing written while only plain steps run
    assert not deferred.before_step([1, 2], drafts=True)  # a drafting step writes its own rows
    [(taps, pos, slots, kv)] = d.calls
    assert kv == "pool" and deferred.flushes == 1 and deferred.num_rows == 0
    assert torch.equal(taps, torch.cat([k[0] for k in kept])) and torch.equal(pos, torch.cat([k[1] for k in kept]))
    deferred.before_step([1, 2], drafts=True)  # nothing kept: no second write
    assert len(d.calls) == 1


def test_a_request_that_left_forces_the_write_before_its_pages_can_be_reused():
    d = FakeDraft()
    deferred = DeferredContext(d, lambda: None)
    deferred.before_step([1, 2], drafts=False)
    deferred.keep(*rows(0, 2))
    deferred.before_step([1, 2, 3], drafts=False)  # a superset: keeps going
    deferred.keep(*rows(2, 3))
    assert d.calls == []
    deferred.before_step([2, 3], drafts=False)  # request 1 finished, was aborted or preempted
    assert len(d.calls) == 1 and d.calls[0][0].shape[0] == 5


def test_a_slot_kept_twice_is_written_with_its_later_row_only():
    d = FakeDraft()
    deferred = DeferredContext(d, lambda: None)
    first = rows(0, 4)
    again = rows(2, 2)  # positions 2, 3 recomputed (a cancelled step): the same slots
    for r in (first, again):
        deferred.before_step([7], drafts=False)
        deferred.keep(*r)
    deferred.flush()
    [(taps, pos, slots, _)] = d.calls
    assert slots.tolist() == [1000, 1001, 1002, 1003]
    assert torch.equal(taps[:2], first[0][:2]) and torch.equal(taps[2:], again[0])


def test_the_kept_rows_are_bounded():
    d = FakeDraft()
    deferred = DeferredContext(d, lambda: None)
    deferred.MAX_ROWS = 5
    for step in range(4):
        deferred.before_step([1], drafts=False)
        deferred.keep(*rows(2 * step, 2))
    assert len(d.calls) == 1 and d.calls[0][0].shape[0] == 6  # written once past 5 rows
    assert deferred.num_rows == 2


def test_fast_cpu_engine_defers_plain_steps_and_ends_with_the_same_draft_context(qwen3_dir, random_draft_dir):
    """The CPU's fast mode keeps plain steps' rows (runner.deferred) and writes them in batches;
    after the same requests, every draft-context slot the requests wrote holds what per-step
    writes give (within float32 GEMM rounding: a batched GEMM is not the row-wise one)."""
    ps = [{"prompt_token_ids": p} for p in ([5, 9, 14, 3, 7], [21, 8, 30, 30, 2, 6, 17], [4, 4, 9])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "dflash", "model": str(random_draft_dir), "num_speculative_tokens": 3, "draft_length": "adaptive"}
    pools, outs = [], []
    for defer in (True, False):
        llm = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=False, max_num_seqs=2, speculative_config=spec,
                  enable_prefix_caching=False)
        runner = llm.engine.runner
        assert runner.deferred is not None
        if not defer:
            runner.deferred = None
        # Plain steps only (the adaptive policy's K = 0, as on chat traffic): the costs say drafting never pays.
        c = runner.step_costs
        llm.engine.scheduler.set_step_costs(c.buckets, c.ks, [[1e-3 if k == 0 else 1.0 for k in c.ks] for _ in c.buckets])
        llm.engine._live_costs = None
        outs.append([o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)])
        if defer:
            assert runner.deferred.flushes > 0  # a request left: its rows were written before its pages moved on
            runner.deferred.flush()
        pools.append([t.clone() for layer in runner.kv.draft for t in layer])
    written = [(a != 0).any(dim=tuple(range(1, a.dim()))) | (b != 0).any(dim=tuple(range(1, b.dim())))
               for a, b in zip(pools[0], pools[1])]
    for a, b, used in zip(pools[0], pools[1], written):
        assert used.any()
        torch.testing.assert_close(a[used], b[used], rtol=1e-4, atol=1e-5)
    assert outs[0] == outs[1]  # the target never reads the draft context
