"""The Rust core through its Python bindings: plans, commits, and every misuse path."""

import random

import numpy as np
import pytest

from dflash_engine import _core as core


def make(num_pages=64, k=3, budget=64, max_num_seqs=8, max_model_len=256, block_size=4):
    return core.Scheduler(
        num_pages=num_pages,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        num_speculative_tokens=k,
        mask_token_id=999,
    )


def test_plan_arrays_describe_prefill_and_verify_blocks():
    s = make()
    h = s.add_request("a", [5, 6, 7], 10)
    p = s.schedule()
    assert p.input_ids.dtype == np.int64 and p.block_tables.dtype == np.int32
    assert p.input_ids.tolist() == [5, 6, 7]
    assert p.positions.tolist() == [0, 1, 2]
    assert p.query_start_loc.tolist() == [0, 3]
    assert p.sample_rows.tolist() == [2]
    page = int(p.block_tables[0, 0])
    assert page != core.NULL_PAGE
    assert p.slot_mapping.tolist() == [page * 4, page * 4 + 1, page * 4 + 2]
    s.commit(p, np.array([0]), np.array([42]))
    p = s.schedule()
    assert p.input_ids.tolist() == [42, 999, 999, 999]
    assert p.draft_input_ids.tolist() == [42, 999, 999, 999]
    assert p.positions.tolist() == [3, 4, 5, 6]
    assert p.seq_lens.tolist() == [7] and p.draft_seq_lens.tolist() == [7]
    assert np.array_equal(p.slot_mapping, p.draft_slot_mapping)
    assert p.num_drafts.tolist() == [3]
    assert p.verify_target_rows.tolist() == [1, 2, 3]
    assert p.context_rows([1]).tolist() == [0, 1]
    out = s.commit(p, np.array([1]), np.array([8, 9, 10, 11]))
    assert out.items() == [(h, [8, 9], None)]
    assert s.request_state(h) == ("decoding", 5, [5, 6, 7, 42, 8, 9])
    s.check_invariants()


def test_every_misuse_raises_a_typed_error_and_changes_nothing():
    with pytest.raises(core.InvalidConfigError):
        make(k=15, budget=8)
    s = make()
    h = s.add_request("a", [1, 2], 10)
    with pytest.raises(core.DuplicateRequestError):
        s.add_request("a", [1], 1)
    with pytest.raises(core.RequestRejectedError, match="empty"):
        s.add_request("e", [], 4)
    with pytest.raises(core.RequestRejectedError, match="max_model_len"):
        s.add_request("long", [1] * 250, 10)
    with pytest.raises(core.RequestRejectedError):
        s.add_request("neg", [1, -5], 3)
    with pytest.raises(core.UnknownRequestError):
        s.abort(12345)
    p1 = s.schedule()
    with pytest.raises(core.PlanOutstandingError):
        s.schedule()
    with pytest.raises(core.InvalidCommitError):
        s.commit(p1, [0, 0], [1])  # wrong length
    with pytest.raises(core.InvalidCommitError):
        s.commit(p1, [1], [1])  # a prefill proposes no drafts
    s.commit(p1, [0], [3])
    with pytest.raises(core.StalePlanError):
        s.commit(p1, [0], [3])  # applied twice
    state = s.request_state(h)
    p2 = s.schedule()
    with pytest.raises(core.InvalidCommitError, match="proposed"):
        s.commit(p2, [4], [1, 2, 3, 4])  # more accepted than proposed
    assert s.request_state(h) == state
    with pytest.raises(core.StalePlanError):
        s.commit(p1, [0], [3])  # an old plan
    s.abort(h)
    with pytest.raises(core.StalePlanError):
        s.commit(p2, [0], [1, 2, 3, 4])  # stale after abort
    s.cancel(p2)
    with pytest.raises(core.StalePlanError):
        s.cancel(p2)
    with pytest.raises(ValueError):
        s.finish(1, "bogus")
    assert s.num_free_pages == s.num_usable_pages
    assert all(issubclass(e, core.CoreError) for e in (core.StalePlanError, core.RequestRejectedError))


def test_stale_plan_after_preemption():
    s = make(num_pages=5, k=0, block_size=4)  # 4 usable pages
    a = s.add_request("a", [1] * 4, 8)
    b = s.add_request("b", [2] * 4, 8)
    p = s.schedule()
    s.commit(p, [0, 0], [7, 7])
    preempted = []
    for _ in range(8):
        p = s.schedule()
        preempted += p.preempted.tolist()
        s.commit(p, [0] * len(p), [7] * len(p.sample_rows))
        s.check_invariants()
        if preempted:
            break
    assert preempted == [b]
    assert s.num_preemptions == 1
    # a plan issued before the preemption is stale now
    assert s.request_state(b)[0] == "preempted"
    s.abort(a)
    s.abort(b)
    assert s.num_free_pages == 4


def test_failed_step_frees_everything():
    s = make()
    for i in range(3):
        s.add_request(f"r{i}", [1, 2, 3], 4)
    p = s.schedule()
    assert sorted(s.fail(p)) == sorted(p.handles.tolist())
    assert s.num_live == 0 and s.num_free_pages == s.num_usable_pages


@pytest.mark.parametrize("seed", range(5))
def test_random_operations_keep_invariants_and_drain(seed):
    rng = random.Random(seed)
    s = make(num_pages=24, k=3, budget=20, max_num_seqs=6, max_model_len=64)
    expected = {}
    n = 0
    for _ in range(300):
        r = rng.random()
        if r < 0.25:
            n += 1
            try:
                prompt = [10 + i for i in range(rng.randint(1, 30))]
                h = s.add_request(f"r{n}", prompt, rng.randint(1, 20), [3])
                expected[h] = list(prompt)
            except core.RequestRejectedError:
                pass
        elif r < 0.3 and expected:
            h = rng.choice(sorted(expected))
            s.abort(h)
            del expected[h]
        else:
            p = s.schedule()
            s.check_invariants()
            acc = [rng.randint(0, int(d)) for d in p.num_drafts]
            smp = [rng.randint(3, 40) for _ in p.sample_rows]
            out = s.commit(p, acc, smp)
            for h, toks, reason in out.items():
                expected[h] += toks
                if reason is not None:
                    del expected[h]
        s.check_invariants()
        for h, toks in expected.items():
            assert s.request_state(h)[2] == toks
    for _ in range(2000):
        if s.num_live == 0:
            break
        p = s.schedule()
        s.commit(p, [0] * len(p), [5] * len(p.sample_rows))
    assert s.num_live == 0
    assert s.num_free_pages == s.num_usable_pages
