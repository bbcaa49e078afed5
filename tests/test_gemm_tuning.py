"""ops/gemm_tuning.py: which few-row GEMMs run the skinny kernel. Recording notes the step's
shapes and the model's own weights; `tune` picks the skinny kernel only where it timed faster
than cuBLAS by the margin; `dispatch.linear` follows the picks (and only on the kernel path,
never in the exact mode). On CPU the kernels run under Triton's interpreter."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_engine import LLM, SamplingParams
from dflash_engine.kernels import skinny_gemm
from dflash_engine.kernels.skinny_gemm import SkinnyConfig
from dflash_engine.ops import dispatch, gemm_tuning

CUDA = torch.cuda.is_available()
FAST = SkinnyConfig(block_n=32, block_k=32, split_k=2)
SLOW = SkinnyConfig(block_n=16, block_k=32, split_k=1)


@pytest.fixture(autouse=True)
def fresh_picks():
    gemm_tuning.clear()
    yield
    gemm_tuning.clear()


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    if CUDA:
        pytest.skip("the interpreter mode is for machines without a GPU")
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")


@pytest.fixture
def skinny_calls(monkeypatch):
    calls: list[tuple[tuple[int, ...], SkinnyConfig]] = []
    real = skinny_gemm.skinny_matmul

    def spy(x, weight, bias=None, cfg=None, out=None):
        calls.append((tuple(x.shape), cfg))
        return real(x, weight, bias, cfg, out)

    monkeypatch.setattr(skinny_gemm, "skinny_matmul", spy)
    return calls


def _w(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_recording_notes_eligible_calls_and_their_weights(kernels_on_cpu):
    w1, w2, w3 = _w(24, 32, 1), _w(24, 32, 2), _w(8, 32, 3)
    x = torch.randn(5, 32)
    with gemm_tuning.recording() as seen:
        for w in (w1, w2, w1, w3):
            dispatch.linear(x, w, None, False)
        dispatch.linear(torch.randn(65, 32), w1, None, False)  # more rows than the kernel takes
        dispatch.linear(x, w1, None, True)  # the exact mode: never the skinny kernel
    assert set(seen) == {gemm_tuning.Key(-1, 24, 32, torch.float32, 5), gemm_tuning.Key(-1, 8, 32, torch.float32, 5)}
    by_id = seen[gemm_tuning.Key(-1, 24, 32, torch.float32, 5)]
    assert [w.data_ptr() for w in by_id.values()] == [w1.data_ptr(), w2.data_ptr()]  # each weight once, in order
    assert gemm_tuning.pick(x, w1) is None  # recorded, not tuned: cuBLAS


def test_tune_picks_skinny_only_past_the_margin_and_skips_failures(kernels_on_cpu):
    x = torch.randn(3, 32)
    wa, wb, wc = _w(24, 32, 1), _w(16, 32, 2), _w(40, 32, 3)
    broken = SkinnyConfig(block_n=8, block_k=32)
    cands = (SLOW, broken, FAST)
    with gemm_tuning.recording() as seen:
        for w in (wa, wb, wc):
            dispatch.linear(x, w, None, False)
    key = {w.shape[0]: k for k in seen for w in seen[k].values()}

    def timer_for(times):
        def timer(fn_for, copies, device):
            label = order.pop(0)
            if label == broken.label():
                raise RuntimeError("does not compile")
            fn_for(0)  # the timed function really runs
            return times[label]
        return timer

    order: list[str] = []
    cases = {24: ({"cublas": 100.0, SLOW.label(): 90.0, FAST.label(): 80.0}, FAST),
             16: ({"cublas": 100.0, SLOW.label(): 98.0, FAST.label(): 99.0}, None),  # inside the margin
             40: ({"cublas": 100.0, SLOW.label(): 50.0, FAST.label(): 60.0}, SLOW)}
    for n, (times, want) in cases.items():
        order[:] = ["cublas"] + [c.label() for c in cands]
        got = gemm_tuning.tune({key[n]: seen[key[n]]}, timer=timer_for(times), candidates=cands)
        assert got == {key[n]: want} and not order
    assert gemm_tuning.tune(seen, timer=None) == {}  # every key tuned already: nothing timed
    assert gemm_tuning.pick(x, wa) == FAST and gemm_tuning.pick(x, wb) is None and gemm_tuning.pick(x, wc) == SLOW
    assert gemm_tuning.pick(torch.randn(4, 32), wa) is None  # another row count: not tuned


def test_dispatch_follows_the_picks(kernels_on_cpu, skinny_calls, monkeypatch):
    x, w, b = torch.randn(6, 48), _w(40, 48, 4), torch.randn(40)
    gemm_tuning._picks[gemm_tuning.Key(-1, 40, 48, torch.float32, 6)] = FAST
    got = dispatch.linear(x, w, b, False)
    assert skinny_calls == [((6, 48), FAST)]
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    dispatch.linear(x, w, b, True)  # the exact mode: kernels/gemm.py
    dispatch.linear(x[:5], w, b, False)  # not tuned
    monkeypatch.setattr(dispatch, "SKINNY_GEMM", False)
    dispatch.linear(x, w, b, False)
    assert len(skinny_calls) == 1


def test_the_real_timer_tunes_on_cpu(kernels_on_cpu):
    x = torch.randn(2, 64)
    ws = [_w(32, 64, s) for s in range(3)]
    with gemm_tuning.recording() as seen:
        for w in ws:
            dispatch.linear(x, w, None, False)
    (key,) = seen
    got = gemm_tuning.tune(seen, candidates=(FAST,))
    assert set(got) == {key} and got[key] in (None, FAST)


def test_engine_step_records_its_shapes_and_runs_the_picks(qwen3_dir, random_draft_dir, kernels_on_cpu,
                                                           skinny_calls, monkeypatch):
    """The decode step's few-row GEMMs (target and draft) are what recording sees; with every
    shape tuned to the skinny kernel the engine's tokens still equal the reference path's."""
    rng = np.random.default_rng(3)
    ps = [{"prompt_token_ids": rng.integers(3, 250, size=int(rng.integers(3, 12))).tolist()} for _ in range(2)]
    # (3 tokens: the prefill's, then two decode steps through the picks; a kernel-path step costs
    # seconds under the interpreter)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    # (the default mode: the exact mode's GEMMs never come here)
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=4, max_mixed_graph_tokens=16, batch_invariant=False,
              speculative_config={"method": "dflash", "model": str(random_draft_dir), "draft_length": "fixed"})
    runner = llm.engine.runner
    assert runner.gemm_picks == {}  # CPU: no graphs are captured, so nothing was tuned at startup
    with gemm_tuning.recording() as seen:
        for g in runner.graphs.values():
            g.run_few_row_shapes(gemm_tuning.MAX_ROWS)
    cfg = llm.engine.model_config
    hidden, d = cfg.hidden_size, cfg.head_dim
    qkv_n = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    (g,) = runner.graphs.values()
    target_rows = {bs * g.b + p for bs in g.capture_buckets for p in (0, 16)}  # decode and mixed steps
    assert {k.m for k in seen if (k.n, k.k) == (qkv_n, hidden)} >= target_rows
    # every target layer's qkv weight, and the draft layer's (the target's attention shape)
    assert len(seen[next(k for k in seen if (k.n, k.k, k.m) == (qkv_n, hidden, g.b))]) == cfg.num_hidden_layers + 1

    def timer(fn_for, copies, device):  # cuBLAS first for each key, then FAST: FAST wins
        timer.n += 1
        return 100.0 if timer.n % 2 else 10.0
    timer.n = 0
    tuned = gemm_tuning.tune(seen, timer=timer, candidates=(FAST,))
    assert set(tuned) == set(seen) and all(c == FAST for c in tuned.values())
    fast = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert skinny_calls, "the step ran the skinny GEMM"
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    ref = LLM(model=str(qwen3_dir), device="cpu", overlap=False)
    assert fast == [o.outputs[0].token_ids for o in ref.generate(ps, params, use_tqdm=False)]


def test_tune_gemms_flag_reaches_the_runtime_config():
    import argparse

    from dflash_engine.cli_args import add_serve_args, engine_kwargs
    from dflash_engine.config import EngineConfig

    ap = argparse.ArgumentParser()
    add_serve_args(ap)
    assert engine_kwargs(ap.parse_args(["--tune-gemms"]))["tune_gemms"] is True
    assert engine_kwargs(ap.parse_args(["--no-tune-gemms"]))["tune_gemms"] is False
    assert "tune_gemms" not in engine_kwargs(ap.parse_args([]))
    assert EngineConfig().tune_gemms is False  # opt-in: startup time for a small gain (docs/perf.md)


def test_startup_report_line_names_the_skinny_shapes():
    from types import SimpleNamespace

    from dflash_engine.server.startup_report import _few_row_gemms

    key = gemm_tuning.Key
    picks = {key(0, 6144, 4096, torch.bfloat16, 16): FAST, key(0, 4096, 4096, torch.bfloat16, 16): None}
    engine = SimpleNamespace(runtime_config=SimpleNamespace(tune_gemms=True), runner=SimpleNamespace(gemm_picks=picks))
    line = _few_row_gemms(engine)
    assert "for 1 of 2" in line and "6144x4096@16" in line and "4096x4096" not in line
    engine.runtime_config.tune_gemms = False
    assert "few-row GEMMs: cuBLAS (--tune-gemms" in _few_row_gemms(engine)
