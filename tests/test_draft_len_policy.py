"""The draft-length policy through the Python binding (issue 20): the core learns acceptance
from commits, takes the measured step costs once, picks each step's K by expected committed
tokens per second, and counts its choices. The rules themselves are tested in Rust
(rust/src/draft_len.rs, rust/tests/scheduler_props.rs); here: the surface the engine uses."""

from __future__ import annotations

import pytest

from dflash_engine import _core as core

K = 3


def make(**kw):
    args = dict(num_pages=128, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                num_speculative_tokens=K, mask_token_id=999)
    return core.Scheduler(**{**args, **kw})


def run_step(s, accept):
    """Schedule one step and commit fake results: `accept(handle, num_drafts)` drafts accepted."""
    p = s.schedule()
    accepted = [accept(int(h), int(d)) for h, d in zip(p.handles, p.num_drafts)]
    s.commit(p, accepted, [5] * len(p.sample_rows))
    return p


def test_fixed_is_the_default_and_counts_its_steps():
    s = make()
    assert s.draft_len_policy == "fixed"
    s.add_request("a", [1, 2, 3], 40)
    run_step(s, lambda h, d: 0)  # prefill: not a decode step
    for _ in range(3):
        assert run_step(s, lambda h, d: d).block_rows == K + 1
    assert s.draft_len_counts() == {K: 3}
    # Every draft accepted: the global estimates rose above the prior at every seen position.
    fresh = make().acceptance_estimates()
    est = s.acceptance_estimates()
    assert len(est) == K and all(0.0 <= p <= 1.0 for p in est)
    assert all(a > b for a, b in zip(est, fresh))


def test_a_schedule_keyword_still_means_the_schedule_policy():
    s = make(draft_len_schedule=[(1, 3), (4, 1)])
    assert s.draft_len_policy == "schedule"
    assert s.draft_len_counts() == {1: 0, 3: 0}
    assert core.draft_len_for([(1, 3), (4, 1)], 3, 2) == 1


def test_adaptive_follows_acceptance_and_costs():
    s = make(draft_len_policy="adaptive")
    assert s.draft_len_policy == "adaptive" and s.draft_len_counts() == {0: 0, 1: 0, 2: 0, 3: 0}
    s.add_request("a", [1, 2, 3], 200)
    s.add_request("b", [4, 5, 6], 200)
    run_step(s, lambda h, d: 0)
    # No costs yet: the largest block.
    assert s.next_draft_len() == K and run_step(s, lambda h, d: d).block_rows == K + 1
    # Cheap drafting, every draft accepted: keep the largest block.
    s.set_step_costs([1, 8], [0, 1, 2, 3], [[1.0, 1.05, 1.1, 1.15], [2.0, 2.2, 2.4, 2.6]])
    for _ in range(5):
        assert run_step(s, lambda h, d: d).block_rows == K + 1
    # Nothing accepted any more: drafting stops (B = 1, no draft pass) within a few steps.
    blocks = [run_step(s, lambda h, d: 0).block_rows for _ in range(30)]
    assert blocks[-1] == 1, blocks
    p = s.schedule()
    assert p.block_rows == 1 and p.draft_rows == 0 and p.num_drafts.tolist() == [0, 0]
    assert len(p.sample_rows) == 2
    s.commit(p, [0, 0], [5, 5])
    counts = s.draft_len_counts()
    assert sum(counts.values()) == 1 + 5 + 30 + 1 and counts[0] >= 2 and counts[K] >= 6
    assert s.acceptance_estimates()[0] < 0.3
    s.check_invariants()


def test_adaptive_candidates_restrict_the_choice():
    s = make(draft_len_policy="adaptive", draft_len_candidates=[0, 3])
    assert s.draft_len_counts() == {0: 0, 3: 0}
    with pytest.raises(ValueError):
        s.set_step_costs([1], [0, 2], [[1.0, 1.5]])  # candidate 3 unmeasured
    s.set_step_costs([1], [0, 3], [[1.0, 50.0]])
    s.add_request("a", [1, 2, 3], 20)
    run_step(s, lambda h, d: 0)
    assert run_step(s, lambda h, d: d).block_rows == 1
    assert s.draft_len_counts() == {0: 1, 3: 0}


@pytest.mark.parametrize(
    "kw",
    [
        dict(draft_len_policy="greedy"),
        dict(draft_len_policy="adaptive", draft_len_schedule=[(1, 3)]),
        dict(draft_len_policy="schedule"),
        dict(draft_len_candidates=[0, 3]),  # candidates without "adaptive"
        dict(draft_len_policy="adaptive", draft_len_candidates=[-1, 3]),
    ],
)
def test_bad_policy_arguments_raise_value_error(kw):
    with pytest.raises(ValueError):
        make(**kw)


@pytest.mark.parametrize("kw", [dict(draft_len_candidates=[0, 2]), dict(draft_len_candidates=[0, 4]),
                                dict(num_speculative_tokens=0)])
def test_invalid_adaptive_candidates_are_a_config_error(kw):
    with pytest.raises(core.InvalidConfigError):
        make(draft_len_policy="adaptive", **kw)


@pytest.mark.parametrize(
    "buckets, ks, seconds",
    [
        ([1, 4], [0, 1, 2, 3], [[1.0, 1.1, 1.2, 1.3]]),  # a row missing
        ([1], [0, 1, 2, 3], [[1.0, 1.1, 1.2]]),  # a row too short
        ([4, 1], [0, 1, 2, 3], [[1.0] * 4, [1.0] * 4]),  # buckets not ascending
        ([0], [0, 1, 2, 3], [[1.0] * 4]),  # bucket 0
        ([-1], [0, 1, 2, 3], [[1.0] * 4]),
        ([1], [0, 1, 2, 3, 4], [[1.0] * 5]),  # k past num_speculative_tokens
        ([1], [0, 1, 2, 3], [[1.0, 0.0, 1.0, 1.0]]),
        ([1], [0, 1, 2, 3], [[1.0, -2.0, 1.0, 1.0]]),
        ([1], [0, 1, 2, 3], [[1.0, float("nan"), 1.0, 1.0]]),
        ([1], [0, 1, 2, 3], [[1.0, float("inf"), 1.0, 1.0]]),
        ([], [], []),
    ],
)
def test_bad_step_costs_raise_value_error_and_change_nothing(buckets, ks, seconds):
    s = make(draft_len_policy="adaptive")
    with pytest.raises(ValueError):
        s.set_step_costs(buckets, ks, seconds)
    s.add_request("a", [1, 2, 3], 20)
    run_step(s, lambda h, d: 0)
    assert s.next_draft_len() == K  # still no costs: the largest block
