"""The step's sampling parameters kept per request (worker/sampling_batch.py) and their
staging into a graph's sample slots (`_core.stage_sampling`)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_engine import _core
from dflash_engine.worker.sampling_batch import FIELDS, RequestParams, SamplingBatch


def params(r: int, rng) -> dict[str, np.ndarray]:
    return {"greedy": rng.random(r) < 0.5, "temperature": rng.random(r) + 0.1, "top_k": rng.integers(1, 99, r),
            "top_p": rng.random(r), "min_p": rng.random(r), "seed": rng.integers(0, 1 << 50, r)}


def test_rows_are_each_requests_value_repeated_over_its_sample_rows():
    rng = np.random.default_rng(3)
    for _ in range(50):
        r = int(rng.integers(0, 9))
        counts = rng.integers(0, 5, r)
        ss = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        values = params(r, rng)
        plan = type("Plan", (), {"positions": rng.integers(0, 999, int(ss[-1]) + 3),
                                 "sample_rows": rng.permutation(int(ss[-1]) + 3)[:int(ss[-1])]})
        st = SamplingBatch(RequestParams(values, ss), plan)
        assert list(st) == [*FIELDS, "position"] and len(st) == 7
        for name in FIELDS:
            want = [v for v, c in zip(values[name].tolist(), counts.tolist()) for _ in range(c)]
            assert st[name].tolist() == pytest.approx(want), name
        assert st["greedy"].dtype == np.bool_ and st["temperature"].dtype == np.float32 and st["seed"].dtype == np.int64
        assert (st["position"] == plan.positions[plan.sample_rows] + 1).all()
        assert st.params.all_greedy == bool(values["greedy"].all())
        assert st["top_k"] is st["top_k"], "expanded once for the batch"


def test_bad_parameters_are_refused_by_name():
    ss = np.array([0, 2, 3])
    good = params(2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="lack \\['seed'\\]"):
        RequestParams({k: v for k, v in good.items() if k != "seed"}, ss)
    with pytest.raises(ValueError, match="one value for each of 2 requests"):
        RequestParams({**good, "top_p": np.ones(3)}, ss)
    with pytest.raises(KeyError):
        SamplingBatch(RequestParams(good, ss), None)["beam_width"]


def test_stage_sampling_checks_every_field_before_writing_any():
    ss = np.array([0, 4, 8], np.int64)
    a, b = np.zeros(8, np.int64), np.zeros(8, np.float32)
    _core.stage_sampling([(a, np.array([3, 5], np.int64), 1)], [(b, np.array([0.5, 2.0], np.float32), 1.0)], ss)
    assert a.tolist() == [3] * 4 + [5] * 4 and b.tolist() == [0.5] * 4 + [2.0] * 4
    short = np.zeros(6, np.float32)  # the float field does not fit: the int field must stay as it was
    with pytest.raises(ValueError, match="fall outside 6 slots"):
        _core.stage_sampling([(a, np.array([7, 7], np.int64), 1)], [(short, np.array([1, 1], np.float32), 1.0)], ss)
    assert a.tolist() == [3] * 4 + [5] * 4 and (short == 0).all()
    # a mixed step: prefill request 2 (one sample) lands in slot base + 0; its padding slots get the pad
    out = np.zeros(10, np.int64)
    _core.stage_sampling([(out, np.array([4, 6, 9], np.int64), -1)], [], np.array([0, 3, 6, 7], np.int64), (2, 8))
    assert out.tolist() == [4, 4, 4, 6, 6, 6, -1, -1, 9, -1]


def test_the_table_gathers_each_live_requests_parameters_through_random_adds_and_removes():
    """SamplingTable against a dict of rows: seats reused, the table grown past its capacity,
    every gather equal to RequestParams built from the rows (values, dtypes, greedy_i64)."""
    from dflash_engine.worker.sampling_batch import SamplingTable

    rng = np.random.default_rng(7)
    table, live, next_handle = SamplingTable(capacity=4), {}, 1
    for _ in range(400):
        if live and rng.random() < 0.45:
            h = int(rng.choice(list(live)))
            table.remove(h)
            del live[h]
            table.remove(h)  # (a second remove is a no-op)
        else:
            row = (bool(rng.random() < 0.5), float(rng.random() + 0.1), int(rng.integers(1, 99)), float(rng.random()),
                   float(rng.random()), int(rng.integers(0, 1 << 50)))
            table.add(next_handle, row)
            live[next_handle] = row
            next_handle += 1
        assert len(table) == len(live)
        if live:
            handles = rng.permutation(np.array(list(live), np.uint64))[:int(rng.integers(1, len(live) + 1))]
            counts = rng.integers(0, 4, len(handles))
            ss = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            got = table.params(handles, ss)
            want = RequestParams(dict(zip(FIELDS, zip(*[live[int(h)] for h in handles]))), ss)
            for name in FIELDS:
                assert got.values[name].dtype == want.values[name].dtype, name
                assert got.values[name].tolist() == want.values[name].tolist(), name
            assert got.greedy_i64.tolist() == want.greedy_i64.tolist() and got.all_greedy == want.all_greedy
            assert got.sample_start.tolist() == ss.tolist()
    table.add(10**9, (True, 1.0, 1, 1.0, 0.0, 0))
    with pytest.raises(ValueError, match="already has"):
        table.add(10**9, (True, 1.0, 1, 1.0, 0.0, 0))
