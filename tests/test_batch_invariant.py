"""The CPU GEMM modes: fast (plain GEMMs and the CPU backend, the default) and exact
(batch-invariant, behind VLLM_BATCH_INVARIANT / DFLASH_BATCH_INVARIANT / --batch-invariant /
batch_invariant=True). The fast mode's own tests: tests/test_fast_cpu_mode.py.

tests/conftest.py turns the exact mode on for the whole suite; these tests undo that where
they check the default."""
from __future__ import annotations

import pytest
import torch

from dflash_engine import LLM, SamplingParams, envs
from dflash_engine.cli_args import add_serve_args, engine_kwargs
from dflash_engine.config import EngineConfig
from dflash_engine.models import load_target
from dflash_engine.models.layers import Linear
from dflash_engine.ops.linear import invariant_linear, linear

ENV_VARS = ("VLLM_BATCH_INVARIANT", "DFLASH_BATCH_INVARIANT")


@pytest.fixture
def no_env(monkeypatch):
    for v in ENV_VARS:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def _modes(model) -> set[bool]:
    flags = {m.batch_invariant for m in model.modules() if isinstance(m, Linear)}
    return flags | {model.batch_invariant}  # the logits GEMM


def _resolved(model_dir, **kw) -> bool:
    """The exact-mode flag an engine runs with (runtime_config.resolve decides it once)."""
    from dflash_engine.runtime_config import resolve

    return resolve(EngineConfig(model=str(model_dir), device="cpu", **kw)).batch_invariant


def test_fast_mode_is_the_default(no_env, qwen3_dir):
    assert envs.batch_invariant() is False
    assert _resolved(qwen3_dir) is False


@pytest.mark.parametrize("var", ENV_VARS)
@pytest.mark.parametrize("value, expected", [("1", True), ("true", True), ("0", False), ("", False)])
def test_env_vars_switch_the_exact_mode(no_env, qwen3_dir, var, value, expected):
    no_env.setenv(var, value)
    assert envs.batch_invariant() is expected
    assert _resolved(qwen3_dir) is expected
    # an explicit setting wins over the environment
    assert _resolved(qwen3_dir, batch_invariant=not expected) is (not expected)


def test_cli_flag():
    import argparse

    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert "batch_invariant" not in engine_kwargs(parse([]))  # unset: the environment decides
    assert engine_kwargs(parse(["--batch-invariant"]))["batch_invariant"] is True
    assert engine_kwargs(parse(["--no-batch-invariant"]))["batch_invariant"] is False
    from dflash_engine.cli import build_parser

    assert build_parser().parse_args(["generate", "hi", "--batch-invariant"]).batch_invariant is True
    assert build_parser().parse_args(["generate", "hi"]).batch_invariant is None


def test_mode_is_per_model_and_per_engine(no_env, qwen3_dir):
    fast = LLM(model=str(qwen3_dir), device="cpu")
    exact = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=True)  # same process
    assert _modes(fast.engine.runner.models.target) == {False}
    assert _modes(exact.engine.runner.models.target) == {True}
    no_env.setenv("VLLM_BATCH_INVARIANT", "1")
    assert _modes(load_target(qwen3_dir)) == {True}
    assert _modes(load_target(qwen3_dir, batch_invariant=False)) == {False}
    assert _modes(fast.engine.runner.models.target) == {False}  # read at load, not at every call


def test_linear_modes_agree_numerically():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(37, 64, generator=gen), torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    exact = linear(x, w, b, True)
    assert torch.equal(exact, invariant_linear(x, w, b))
    torch.testing.assert_close(linear(x, w, b, False), exact, rtol=1e-5, atol=1e-5)
    # exact mode: a row's bits do not depend on the rows beside it
    assert torch.equal(linear(x[5:6], w, b, True), exact[5:6])
    assert torch.equal(linear(x[3:20], w, b, True), exact[3:20])


@pytest.mark.parametrize("model", ["qwen3_dir", "llama_tied_dir"])  # q/k-norm path; joint q-k RoPE + tied head
def test_fast_mode_gives_the_exact_modes_greedy_tokens_alone(no_env, request, model):
    """One request at a time, float32: the two modes differ only in the last bits of each
    GEMM, so greedy decoding of this tiny model picks the same tokens (an argmax flip needs a
    near-tie of ~1e-6; the logits are compared too, loosely)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 256 for j in range(5 + i)]} for i in range(3)]
    path = request.getfixturevalue(model)
    fast = LLM(model=str(path), device="cpu")
    exact = LLM(model=str(path), device="cpu", batch_invariant=True)
    for p in prompts:
        a = fast.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
        b = exact.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids
        assert a == b
    ids = torch.tensor(prompts[2]["prompt_token_ids"])
    fast_target, exact_target = fast.engine.runner.models.target, exact.engine.runner.models.target
    assert fast_target.backend is not None and exact_target.backend is None  # the CPU backend, float32 GEMMs
    h = exact_target.model.embed_tokens(ids)
    torch.testing.assert_close(fast_target.compute_logits(h), exact_target.compute_logits(h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_fast_attention_matches_the_reference(causal):
    """paged_attention_sdpa (fast mode) == the reference loop, numerically: a prefill with
    earlier context, a verify block, a decode row and an idle request, scattered and
    consecutive pages, GQA."""
    from attention_meta import meta_for_batch

    from dflash_engine.ops.attention import paged_attention, paged_attention_sdpa

    gen = torch.Generator().manual_seed(0)
    page, n_kv, heads, d = 4, 2, 6, 16
    k_cache, v_cache = torch.randn(40, page, n_kv, d, generator=gen), torch.randn(40, page, n_kv, d, generator=gen)
    tables = [[7, 3, 9, 1, 22], [5, 30, 2], [11, 12, 13, 14, 15, 16], [31]]  # [2]: consecutive pages (a view)
    meta, _ = meta_for_batch([9, 4, 1, 0], [17, 10, 21, 3], tables, page, causal)
    q = torch.randn(14, heads, d, generator=gen)
    ref = paged_attention(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(paged_attention_sdpa(q, k_cache, v_cache, meta, 0.25), ref, rtol=1e-5, atol=1e-5)
    one, _ = meta_for_batch([3], [10], [tables[1]], page, causal)  # a single request: no copy out
    torch.testing.assert_close(paged_attention_sdpa(q[9:12], k_cache, v_cache, one, 0.25),
                               paged_attention(q[9:12], k_cache, v_cache, one, 0.25), rtol=1e-5, atol=1e-5)
