"""The Rust core through its Python bindings: plans, commits, and every misuse path."""

import random

import numpy as np
import pytest

from dflash_engine import _core as core


def make(num_pages=64, k=3, budget=64, max_num_seqs=8, max_model_len=256, page_size=4):
    return core.Scheduler(
        num_pages=num_pages,
        page_size=page_size,
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
    assert p.input_ids.dtype == np.int64 and p.page_tables.dtype == np.int32
    assert p.input_ids.tolist() == [5, 6, 7]
    assert p.positions.tolist() == [0, 1, 2]
    assert p.query_start_loc.tolist() == [0, 3]
    assert p.sample_rows.tolist() == [2] and p.sample_start.tolist() == [0, 1]
    assert p.num_rows == 3
    page = int(p.page_tables[0, 0])
    assert page != core.NULL_PAGE
    assert p.slot_mapping.tolist() == [page * 4, page * 4 + 1, page * 4 + 2]
    s.commit(p, np.array([0]), np.array([42]))
    p = s.schedule()
    assert p.input_ids.tolist() == [42, 999, 999, 999]
    assert p.draft_input_ids.tolist() == [42, 999, 999, 999]
    assert p.positions.tolist() == [3, 4, 5, 6]
    assert p.seq_lens.tolist() == [7] and p.draft_seq_lens.tolist() == [7]
    assert np.array_equal(p.slot_mapping, p.draft_slot_mapping)
    assert p.num_drafts.tolist() == [3] and p.num_decode == 1
    assert p.verify_target_rows.tolist() == [1, 2, 3]
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
    with pytest.raises(core.UnknownRequestError):
        s.abort(12345)
    p1 = s.schedule()
    with pytest.raises(core.PlanOutstandingError):
        s.schedule()
    with pytest.raises(core.InvalidCommitError):
        s.commit(p1, [0, 0], [1])  # wrong length
    with pytest.raises(core.InvalidCommitError):
        s.commit(p1, [1], [1])  # a prefill proposes no drafts
    with pytest.raises(core.InvalidCommitError):
        s.commit(p1, [0], [-1])  # not a token id
    s.commit(p1, [0], [3])  # a refused commit kept the ticket
    with pytest.raises(core.StalePlanError, match="spent"):
        s.commit(p1, [0], [3])  # applied twice
    state = s.request_state(h)
    p2 = s.schedule()
    with pytest.raises(core.InvalidCommitError, match="proposed"):
        s.commit(p2, [4], [1, 2, 3, 4])  # more accepted than proposed
    assert s.request_state(h) == state
    with pytest.raises(core.StalePlanError):
        s.commit(p1, [0], [3])  # an old plan
    s.cancel(p2)
    with pytest.raises(core.StalePlanError):
        s.cancel(p2)
    with pytest.raises(ValueError):
        s.finish(h, "bogus")
    s.abort(h)
    assert s.num_free_pages == s.num_usable_pages
    assert all(issubclass(e, core.CoreError) for e in (core.StalePlanError, core.RequestRejectedError))


@pytest.mark.parametrize(
    "args, param, match",
    [
        (("e", [], 4), "prompt", "empty"),
        (("long", [1] * 250, 10), "max_tokens", "max_model_len"),
        (("longer", [1] * 300, 10), "prompt", "max_model_len"),
        (("neg", [1, -5], 3), "prompt", "out of range"),
        (("big", [1, 2**40], 3), "prompt", "out of range"),
        (("str", ["a"], 3), "prompt", "integers"),
        (("zero", [1], 0), "max_tokens", ">= 1"),
        (("negmax", [1], -3), "max_tokens", "non-negative"),
        (("stop", [1], 3, [-1]), "stop_token_ids", "out of range"),
        (("stop2", [1], 3, [2**64]), "stop_token_ids", "integers"),
    ],
)
def test_rejections_are_typed_value_errors_naming_the_parameter(args, param, match):
    s = make()
    with pytest.raises(core.RequestRejectedError, match=match) as e:
        s.add_request(*args)
    assert isinstance(e.value, ValueError) and isinstance(e.value, core.CoreError)
    assert e.value.param == param
    assert s.num_live == 0 and s.handle_of(args[0]) is None


def test_forging_attempts_fail():
    s = make()
    h = s.add_request("a", [1, 2, 3], 10)
    p = s.schedule()
    # The plan's arrays are read-only: nothing flows back to the core through them.
    for name in ("input_ids", "positions", "slot_mapping", "page_tables", "sample_rows", "num_drafts",
                 "sample_start", "draft_input_ids", "draft_slot_mapping", "draft_proposal_rows", "verify_target_rows", "handles"):
        arr = getattr(p, name)
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError):
            arr[...] = 0
        assert getattr(p, name) is arr, "made once, on first read"
    assert p.max_pages == p.page_tables.shape[1] and len(p) == len(p.handles)
    assert p.num_rows == len(p.input_ids)
    with pytest.raises(AttributeError):
        p.step_id = 99  # frozen
    s.commit(p, [0], [4])
    # A plan of another scheduler is refused there, and stays good where it came from.
    other = make()
    other.add_request("a", [1, 2, 3], 10)
    q = other.schedule()
    p2 = s.schedule()
    with pytest.raises(core.StalePlanError, match="another scheduler"):
        s.commit(q, [0], [5])
    assert s.outstanding_step == p2.step_id and other.outstanding_step == q.step_id
    other.commit(q, [0], [5])
    s.commit(p2, [2], [5, 6, 7, 8])
    assert s.request_state(h) == ("decoding", 6, [1, 2, 3, 4, 5, 6, 7])
    s.check_invariants()


def test_abort_between_schedule_and_commit_skips_only_that_request():
    s = make()
    a = s.add_request("a", [1, 2], 10)
    b = s.add_request("b", [3, 4], 10)
    p = s.schedule()
    s.abort(a)
    out = s.commit(p, [0, 0], [7, 8])
    assert out.items() == [(b, [8], None)]
    assert s.handle_of("a") is None and s.handle_of("b") == b
    s.check_invariants()


def test_an_empty_step_is_none_and_needs_no_commit():
    s = make()
    assert s.schedule() is None
    assert s.outstanding_step is None
    s.add_request("a", [1], 3)
    assert s.schedule() is not None


def test_preemption_is_counted_and_the_victim_resumes():
    s = make(num_pages=5, k=0, page_size=4)  # 4 usable pages
    a = s.add_request("a", [1] * 4, 8)
    b = s.add_request("b", [2] * 4, 8)
    p = s.schedule()
    s.commit(p, [0, 0], [7, 7])
    for _ in range(8):
        p = s.schedule()
        s.commit(p, [0] * len(p), [7] * len(p.sample_rows))
        s.check_invariants()
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1
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
    with pytest.raises(core.StalePlanError):
        s.commit(p, [0, 0, 0], [1, 1, 1])


def test_pages_per_seq_is_the_admission_bound():
    assert core.pages_per_seq(100, 16, 16) == -(-(100 + 16) // 16)  # reserve_rows = B = 16
    s = make(num_pages=5, k=3, page_size=4, max_model_len=64)  # 4 usable pages = 16 slots
    s.add_request("fits", [1] * 6, 6)  # 12 + B 4 = 16 slots: 4 pages
    assert core.pages_per_seq(12, 4, 4) == 4
    with pytest.raises(core.RequestRejectedError, match="pages"):
        s.add_request("no", [1] * 6, 7)
    assert core.FINISH_REASONS == [None, "stop", "length", "abort", "error"]


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
            if p is None:
                continue
            acc = [rng.randint(0, int(d)) for d in p.num_drafts]
            smp = [rng.randint(3, 40) for _ in p.sample_rows]
            out = s.commit(p, acc, smp)
            # The arrays (made on first read, read-only) say what items() says.
            offsets, tokens, codes = out.offsets, out.new_tokens, out.finish_codes
            assert out.offsets is offsets and not tokens.flags.writeable and len(out) == len(out.handles)
            assert [(h, tokens[offsets[i]:offsets[i + 1]].tolist(), core.FINISH_REASONS[codes[i]] if codes[i] else None)
                    for i, h in enumerate(out.handles.tolist())] == out.items()
            for h, toks, reason in out.items():
                expected[h] += toks
                if reason is not None:
                    del expected[h]
        s.check_invariants()
        for h, toks in expected.items():
            assert s.request_state(h)[2] == toks
    for _ in range(2000):
        p = s.schedule()
        if p is None:
            break
        s.commit(p, [0] * len(p), [5] * len(p.sample_rows))
    assert s.num_live == 0
    assert s.num_free_pages == s.num_usable_pages


def stage_reference(plan, dst, fields, pages=None):
    """What `stage_into` must do, in numpy: each array padded into dst, the page tables as rows
    of `width` with what the previous staging covered and this one does not zeroed."""
    for name, at, total, pad in fields:
        a = getattr(plan, name)
        dst[at:at + len(a)] = a
        dst[at + len(a):at + total] = a[-1] if pad is None else pad
    if pages is not None:
        at, width, rows_before, cols_before = pages
        t = plan.page_tables
        r, w = t.shape
        table = dst[at:at + max(r, rows_before) * width].reshape(-1, width)
        table[:r, :w] = t
        table[r:rows_before, :cols_before] = 0
        table[:min(r, rows_before), w:cols_before] = 0


def test_stage_into_copies_and_pads_like_numpy():
    """StepPlan.stage_into (the graph runner's staging, one call) equals a numpy reference on
    random prefill + decode plans, and so does a tensor-parallel worker's copy of the plan
    (WirePlan: the same core function over its own arrays); it leaves everything outside its
    fields alone, and refuses a field that does not fit, an unknown name and a read-only buffer
    before writing anything."""
    from dflash_engine.distributed.step_message import WirePlan

    names = ["input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "sample_rows",
             "draft_input_ids", "draft_positions", "draft_slot_mapping", "draft_seq_lens",
             "state_read", "state_write", "verify_target_rows", "draft_proposal_rows"]
    rng = random.Random(3)
    s = make()
    for i in range(6):
        s.add_request(f"r{i}", [rng.randrange(1, 900) for _ in range(rng.randint(1, 9))], 40)
    for _ in range(12):
        p = s.schedule()
        fields, at = [], 0
        for name in rng.sample(names, 8):
            n = len(getattr(p, name))
            if n == 0:
                continue  # (state arrays: empty without a hybrid target)
            total = n + rng.randint(0, 5)
            fields.append((name, at, total, rng.choice([None, -1, 0, 7])))
            at += total + rng.randint(0, 3)
        width = p.page_tables.shape[1] + rng.randint(0, 3)
        pages = (at, width, rng.randint(0, 8), rng.randint(0, width))
        got = np.full(at + max(len(p), pages[2]) * width + 4, -99, np.int64)
        want = got.copy()
        p.stage_into(got, fields, pages)
        # The numpy staging of a tensor-parallel worker's copy of the plan: the reference.
        stage_reference(p, want, fields, pages)
        assert np.array_equal(got, want), (fields, pages)
        wire = WirePlan(len(p), {}, {name: getattr(p, name).copy() for name in [*names, "page_tables"]})
        got_wire = np.full_like(got, -99)
        wire.stage_into(got_wire, fields, pages)
        assert np.array_equal(got_wire, want), (fields, pages)
        got2 = got.copy()
        p.stage_into(got2, fields)  # without pages: the tables' region untouched
        assert np.array_equal(got2, got)
        s.commit(p, np.minimum(p.num_drafts, rng.randint(0, 3)), np.arange(len(p.sample_rows)) + 3)
    p = s.schedule()
    buf = np.zeros(64, np.int64)
    with pytest.raises(ValueError, match="does not fit"):
        p.stage_into(buf, [("positions", 0, 1, 0)] if len(p.positions) > 1 else [("positions", 63, 2, 0)])
    with pytest.raises(ValueError, match="does not fit"):
        p.stage_into(buf, [("input_ids", 0, len(p.input_ids), 0), ("positions", 60, len(p.positions) + 8, 0)])
    assert (buf == 0).all(), "nothing written when a field does not fit"
    with pytest.raises(ValueError, match="do not fit"):
        p.stage_into(buf, [], (0, p.page_tables.shape[1] - 1, 0, 0))
    with pytest.raises(ValueError, match="do not fit"):
        p.stage_into(buf, [], (60, p.page_tables.shape[1], 0, 0))
    assert (buf == 0).all()
    with pytest.raises(ValueError, match="no one-dimensional array"):
        p.stage_into(buf, [("page_tables", 0, 4, 0)])
    ro = np.zeros(64, np.int64)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="not writeable"):
        p.stage_into(ro, [("input_ids", 0, len(p.input_ids), 0)])
