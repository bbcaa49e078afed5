"""The adaptive draft length (the default): each step verifies the K (0 included) the core
picks from live acceptance and the measured step cost; every choice stays lossless."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from dflash_engine import LLM, SamplingParams
from dflash_engine.config import EngineConfig, SpeculativeConfig
from dflash_engine.runtime_config import resolve
from dflash_engine.server.metrics import ServerMetrics

PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def prompts(n: int) -> list[dict]:
    from draft_training import random_prompts

    return [{"prompt_token_ids": p} for p in random_prompts(n, 8, seed=4321).tolist()]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(trained):
    ps = prompts(8)
    return ps, tokens(LLM(model=str(trained.target), device="cpu").generate(ps, PARAMS, use_tqdm=False))


def adaptive(trained, max_num_seqs: int, draft_cost: float | None = None) -> LLM:
    """An adaptive engine; `draft_cost`: replace the measured cost table by one where a step
    verifying K > 0 drafts costs `draft_cost` x the plain decode step (None: as measured)."""
    llm = LLM(model=str(trained.target), device="cpu", max_num_seqs=max_num_seqs,
              speculative_config={"method": "dflash", "model": str(trained.draft)})
    c = llm.engine.runner.step_costs
    assert c is not None and c.ks == [0, 1, 3] and all(s > 0 for row in c.seconds for s in row)
    if draft_cost is not None:  # (and no live refinement, which would replace the table with measured costs)
        llm.engine._live_costs = None
        llm.engine.scheduler.set_step_costs(c.buckets, c.ks, [[1.0] + [draft_cost] * (len(c.ks) - 1)
                                                              for _ in c.buckets])
    return llm


def test_default_policy_is_adaptive_and_explicit_k_is_fixed(trained):
    draft = str(trained.draft)
    rc = resolve(EngineConfig(model=str(trained.target), device="cpu",
                              speculative_config={"method": "dflash", "model": draft}))
    assert (rc.draft_len_policy, rc.draft_len_candidates) == ("adaptive", (0, 1, 3))
    assert rc.draft_lengths == [3, 1, 0]
    fixed = resolve(EngineConfig(model=str(trained.target), device="cpu",
                                 speculative_config={"method": "dflash", "model": draft, "num_speculative_tokens": 2}))
    assert (fixed.draft_len_policy, fixed.draft_len_candidates, fixed.num_speculative_tokens) == ("fixed", (), 2)
    up_to_2 = resolve(EngineConfig(model=str(trained.target), device="cpu", speculative_config={
        "method": "dflash", "model": draft, "num_speculative_tokens": 2, "draft_length": "adaptive"}))
    assert up_to_2.draft_len_candidates == (0, 1, 2)
    assert SpeculativeConfig.parse({"model": draft, "draft_length": 2}).num_speculative_tokens == 2
    for bad in ("fast", -1, True, 0):
        with pytest.raises(ValueError, match="draft_length|speculation off"):
            SpeculativeConfig.parse({"model": draft, "draft_length": bad})
    with pytest.raises(ValueError, match="disagree"):
        SpeculativeConfig.parse({"model": draft, "draft_length": 2, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="two draft-length policies"):
        SpeculativeConfig.parse({"model": draft, "draft_length": "adaptive",
                                 "num_speculative_tokens_schedule": [[1, 3]], "num_speculative_tokens": 3})


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_adaptive_is_lossless_and_drafts_when_drafting_is_cheap(trained, reference, max_num_seqs):
    ps, ref = reference
    llm = adaptive(trained, max_num_seqs, draft_cost=1.0)
    assert tokens(llm.generate(ps, PARAMS, use_tqdm=False)) == ref
    st = llm.stats()
    counts = st.spec_draft_len_counts
    # A trained draft on free drafting: the longest block nearly always.
    assert counts[3] > 0.8 * sum(counts.values()), counts
    assert st.mean_acceptance_length > 2.0


def test_adaptive_stops_drafting_when_drafting_costs_more_than_it_commits(trained, reference):
    ps, ref = reference
    llm = adaptive(trained, 8, draft_cost=20.0)
    assert tokens(llm.generate(ps, PARAMS, use_tqdm=False)) == ref
    counts = llm.stats().spec_draft_len_counts
    total = sum(counts.values())
    # Plain steps, but for at most one exploring step after every 64 plain ones in a row
    # (rust/src/draft_len.rs, EXPLORE_AFTER): a plain step learns nothing.
    assert total > 0 and counts[0] >= total - (total // 65 + 1), counts
    assert llm.stats().spec_num_drafts <= 8 * (total // 65 + 1)


def test_adaptive_with_measured_costs_is_lossless_with_preemption(trained, reference):
    ps, ref = reference
    llm = LLM(model=str(trained.target), device="cpu", max_num_seqs=8, max_num_batched_tokens=12, max_model_len=96,
              num_gpu_blocks_override=8, speculative_config={"method": "dflash", "model": str(trained.draft)})
    assert tokens(llm.generate(ps, PARAMS, use_tqdm=False)) == ref
    st = llm.stats()
    assert st.num_preemptions > 0 and sum(st.spec_draft_len_counts.values()) > 0


def test_metrics_export_the_choices(trained, reference):
    ps, _ = reference
    llm = adaptive(trained, 4, draft_cost=1.0)
    llm.generate(ps[:2], PARAMS, use_tqdm=False)
    text = generate_latest(ServerMetrics("m", llm.engine.stats).registry).decode()
    chosen = {line.split('k="')[1].split('"')[0]: float(line.split()[-1])
              for line in text.splitlines() if line.startswith("dflash:draft_length_chosen_total")}
    assert set(chosen) == {"0", "1", "3"} and chosen["3"] > 0, chosen

    def by_k(name, suffix="_total"):
        return {line.split('k="')[1].split('"')[0]: float(line.split()[-1])
                for line in text.splitlines() if line.startswith(name + suffix + "{")}
    # Per K: the request-steps that drafted K and their accepted drafts add up to the totals.
    st = llm.stats()
    drafts = by_k("dflash:spec_decode_num_drafts_by_draft_length")
    accepted = by_k("dflash:spec_decode_num_accepted_tokens_by_draft_length")
    assert drafts.keys() == accepted.keys() and "0" not in drafts and drafts["3"] > 0, drafts
    assert sum(drafts.values()) == st.spec_num_drafts
    assert sum(accepted.values()) == st.spec_num_accepted_tokens
    assert sum(int(k) * n for k, n in drafts.items()) == st.spec_num_draft_tokens
    assert all(accepted[k] <= int(k) * drafts[k] for k in drafts)
    # The calibration of each draft position (0-based label, as the per-position counters):
    # positive, 1 where nothing was proposed.
    calibration = {line.split('position="')[1].split('"')[0]: float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("dflash:spec_decode_acceptance_calibration{")}
    assert calibration == {str(j): f for j, f in enumerate(st.spec_acceptance_calibration)}, calibration
    assert len(calibration) == 3 and all(f > 0 for f in calibration.values()), calibration
    if "1" in drafts and "3" not in drafts:
        assert calibration["1"] == calibration["2"] == 1.0  # positions 2, 3 never proposed


def test_live_costs_refine_the_startup_table_by_what_steps_cost():
    """LiveCosts: a measured cell takes its mean (then an average with later windows); cells
    outside the table are ignored; a cell that never ran is its startup value scaled by its
    bucket's measured / startup ratio over cells of its kind, drafting or plain (else that
    kind's overall one; else unscaled). (Cells with fewer than
    MIN_STEPS steps stay in the timer: test_step_timing.py.)"""
    from dflash_engine.worker.step_costs import LiveCosts, StepCosts

    startup = StepCosts(buckets=[1, 4], ks=[0, 1, 3], seconds=[[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]])
    live = LiveCosts(startup)
    assert live.seconds() == startup.seconds and live.seconds(0.5)[0] == [1.5, 2.5, 3.5]
    live.observe({(1, 3): (12.0, 4, 0.0, 0), (9, 0): (1.0, 9, 0.0, 0), (1, 2): (1.0, 9, 0.0, 0)})  # (9, *) / k=2: no cell
    assert live.measured == {(1, 3): 3.0}
    table = live.seconds()
    # Only K = 3 ran (at its startup cost): drafting cells keep ratio 1; the plain cell has
    # no measured plain cell to follow and keeps its startup value.
    assert table == [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]
    live.observe({(1, 3): (4 * 6.0, 4, 0.0, 0)})  # drafting now runs 2x its startup cost (average 4.5: 1.5x)
    assert live.seconds()[0] == [1.0, 3.0, 4.5], "a plain step is not scaled by the drafting steps"
    live.measured[(1, 3)] = 3.0
    live.observe({(1, 0): (5.0, 4, 0.0, 0)})
    assert live.measured == {(1, 3): 3.0, (1, 0): 1.25}
    table = live.seconds()
    # Each unmeasured cell follows the measured cells of its kind: bucket 1's K = 1 the
    # drafting K = 3 (ratio 1); bucket 4 ran nothing: each kind's overall ratio.
    assert table[0] == [1.25, 2.0, 3.0]
    assert table[1] == [2.0 * 1.25, 4.0, 6.0]
    live.observe({(1, 3): (20.0, 4, 0.0, 0)})  # a later window: averaged with the earlier mean
    assert live.measured[(1, 3)] == (1 - LiveCosts.ALPHA) * 3.0 + LiveCosts.ALPHA * 5.0


def test_live_costs_charge_each_cell_the_host_time_before_its_steps():
    """The host time the device waited before a cell's steps (their staging, the commit
    before them) is that cell's; a cell with too few measured gaps, or none, is charged the
    window's mean gap."""
    from dflash_engine.worker.step_costs import LiveCosts, StepCosts

    startup = StepCosts(buckets=[1, 32], ks=[0, 7, 15], seconds=[[1.0, 2.0, 2.1], [1.5, 3.0, 3.1]])
    live = LiveCosts(startup)
    n = LiveCosts.MIN_STEPS
    live.observe({(32, 7): (3.0 * n, n, 0.4 * n, n), (32, 15): (3.1 * n, n, 0.8 * n, n),
                  (32, 0): (1.5 * n, n, 0.1, 1)})  # K = 0: one gap only, not enough to charge it
    assert live.gaps == {(32, 7): 0.4, (32, 15): 0.8}
    table = live.seconds(gap=0.5)
    assert table[1] == [1.5 + 0.5, 3.0 + 0.4, 3.1 + 0.8]
    assert table[0] == [1.0 + 0.5, 2.0 + 0.5, 2.1 + 0.5]  # bucket 1 ran nothing: the mean gap
    # The device-only table had K = 15 cheaper per drafted token; with the host time it costs
    # 12% more a step than K = 7, which a τ-2 workload's extra drafts do not buy back.
    assert table[1][2] / table[1][1] > 1.1
    live.observe({(32, 15): (3.1 * n, n, 0.4 * n, n)})  # a later window: averaged
    assert live.gaps[(32, 15)] == (1 - LiveCosts.ALPHA) * 0.8 + LiveCosts.ALPHA * 0.4


def test_engine_refines_its_costs_from_its_own_decode_steps(trained):
    """After EVERY steps the engine hands the core a table refined by its own pure-decode
    steps: the cells it ran are measured, tagged (batch bucket, K) by the runner."""
    from dflash_engine.worker.step_costs import LiveCosts

    llm = adaptive(trained, 1)
    live = llm.engine._live_costs
    assert live is not None and not live.measured
    llm.generate(prompts(8), SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), use_tqdm=False)
    assert live.last[1] >= LiveCosts.EVERY, "the window closed"
    chosen = {k for k, n in llm.stats().spec_draft_len_counts.items() if n >= 4 * 2}
    assert live.measured and {k for b, k in live.measured} <= set(live.startup.ks)
    assert all(b == 1 for b, k in live.measured)  # max_num_seqs 1: bucket 1 only
    assert chosen & {k for b, k in live.measured}, (chosen, live.measured)
    assert all(s > 0 for s in live.measured.values())
