"""The GPU step (Triton kernels, the padded decode step, CUDA graphs) against the reference.

On CPU, `DFLASH_KERNELS_ON_CPU=1` runs the kernel path under Triton's interpreter with the
decode step in eager mode: same kernels, same padding and staging as on the GPU, so CI
catches a broken GPU step. On a GPU (the device machine) the graph tests run too.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_engine import LLM, SamplingParams
from dflash_engine.worker.graph_runner import batch_buckets

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
CUDA = torch.cuda.is_available()


def prompts(n: int, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 250, size=int(rng.integers(3, 20))).tolist()} for _ in range(n)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def spec(draft_dir) -> dict:
    return {"method": "dflash", "model": str(draft_dir), "draft_length": "fixed"}


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    if CUDA:
        pytest.skip("the interpreter mode is for machines without a GPU")
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")


@pytest.mark.parametrize("n", [2, 3])
def test_kernel_step_on_cpu_matches_the_reference(qwen3_dir, random_draft_dir, kernels_on_cpu, decode_runs,
                                                  monkeypatch, n):
    """Spec on, through the decode step with the host/device overlap on (the default): 3
    requests (bucket 4: one padding request) and 2; the same tokens as the reference path
    with the overlap off."""
    ps = prompts(n)
    # 4 tokens: the prefill's, then 3 decode steps back to back (each ~2 s under the interpreter)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=4, speculative_config=spec(random_draft_dir))
    assert llm.engine.runner.graphs and llm.engine.overlap
    fast = tokens(llm.generate(ps, greedy, use_tqdm=False))
    assert len(decode_runs) >= 3, "the decode step ran, step after step"
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    ref = LLM(model=str(qwen3_dir), device="cpu", overlap=False)
    assert fast == tokens(ref.generate(ps, greedy, use_tqdm=False))


def test_kernel_step_on_cpu_spec_off_with_sampling(qwen3_dir, kernels_on_cpu, monkeypatch):
    ps = prompts(2, seed=5)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=6, ignore_eos=True, seed=7)
    fast = tokens(LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=2).generate(ps, params, use_tqdm=False))
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    ref = tokens(LLM(model=str(qwen3_dir), device="cpu").generate(ps, params, use_tqdm=False))
    assert fast == ref


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_equal_eager_and_spec_on_equals_spec_off(qwen3_dir, random_draft_dir, dtype):
    ps = prompts(12)
    kw = dict(model=str(qwen3_dir), device="cuda", dtype=dtype, max_num_seqs=8, num_gpu_blocks_override=256)
    graphs = LLM(**kw, speculative_config=spec(random_draft_dir))
    assert all(g.graphs for g in graphs.engine.runner.graphs.values()), "graphs were captured"
    on = tokens(graphs.generate(ps, GREEDY, use_tqdm=False))
    del graphs
    eager = tokens(LLM(**kw, speculative_config=spec(random_draft_dir), enforce_eager=True)
                   .generate(ps, GREEDY, use_tqdm=False))
    assert on == eager, "graph replay and eager mode give the same tokens"
    off = tokens(LLM(**kw).generate(ps, GREEDY, use_tqdm=False))
    same = sum(a == b for a, b in zip(on, off))
    assert same >= (len(ps) if dtype == "float32" else len(ps) - 2), (same, len(ps))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("draft", [True, False])
def test_small_batches_through_the_pdl_graphs_equal_eager(qwen3_dir, random_draft_dir, draft):
    """The small decode graphs are captured with PDL edges (kernels/pdl.py: spec on at one
    request, spec off up to four); requests replaying them give eager's tokens (bf16: the
    same kernels; only their launches overlap)."""
    seats = 1 if draft else 4
    ps = prompts(3 * seats, seed=11)
    kw = dict(model=str(qwen3_dir), device="cuda", dtype="bfloat16", max_num_seqs=seats, num_gpu_blocks_override=128,
              speculative_config=spec(random_draft_dir) if draft else None)
    llm = LLM(**kw)
    runners = list(llm.engine.runner.graphs.values())
    if torch.cuda.get_device_capability()[0] >= 9:
        want = {(1, 0, True)} if draft else {(1, 0, True), (2, 0, True), (4, 0, True)}
        assert all(want <= g.pdl_graphs for g in runners), [g.pdl_graphs for g in runners]
    on = tokens(llm.generate(ps, GREEDY, use_tqdm=False))
    del llm
    assert on == tokens(LLM(**kw, enforce_eager=True).generate(ps, GREEDY, use_tqdm=False))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_mixed_step_graphs_equal_eager_mixed_steps_and_spec_off(qwen3_dir, random_draft_dir):
    """Requests arriving as seats free (4 seats, a 24-token step budget: chunked prompts beside
    decode rows): mixed steps replaying CUDA graphs give the tokens of eager mixed steps and,
    in float32, of spec off; greedy and sampled requests."""
    from test_mixed_graphs import arrivals

    ps, params = arrivals(16, most=24)
    params = [p if i % 2 else SamplingParams(temperature=0.9, top_k=30, max_tokens=p.max_tokens, ignore_eos=True,
                                             seed=i) for i, p in enumerate(params)]
    kw = dict(model=str(qwen3_dir), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=24,
              num_gpu_blocks_override=256)
    mixed = LLM(**kw, speculative_config=spec(random_draft_dir))
    on = tokens(mixed.generate(ps, params, use_tqdm=False))
    paths = mixed.engine.runner.steps_by_path()
    assert paths["mixed_graph"] >= 5, paths
    assert any(key[1] for g in mixed.engine.runner.graphs.values() for key in g.graphs), "mixed graphs captured"
    del mixed
    eager = LLM(**kw, speculative_config=spec(random_draft_dir), max_mixed_graph_tokens=0)
    assert on == tokens(eager.generate(ps, params, use_tqdm=False)), "mixed graphs == eager mixed steps"
    del eager
    assert on == tokens(LLM(**kw).generate(ps, params, use_tqdm=False)), "spec on == spec off (float32)"


def test_enforce_eager_reaches_the_engine_config():
    import argparse

    from dflash_engine.cli_args import add_serve_args, engine_kwargs
    from dflash_engine.config import EngineConfig

    parser = add_serve_args(argparse.ArgumentParser())
    assert engine_kwargs(parser.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert "enforce_eager" not in engine_kwargs(parser.parse_args([]))  # engine default: graphs on
    assert EngineConfig().enforce_eager is False
