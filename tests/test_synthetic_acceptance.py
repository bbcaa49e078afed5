"""Benchmark-only synthetic acceptance (issue 10): vLLM's speculative_config keys, the
acceptance-length solve, and the engine committing drafts by a seeded RNG."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_engine import LLM, SamplingParams
from dflash_engine.config import SpeculativeConfig, synthetic_rates
from dflash_engine.worker.graph_runner import GraphRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def spec(draft_dir, **kw) -> dict:
    return {"method": "dflash", "model": str(draft_dir), "rejection_sample_method": "synthetic", **kw}


def prompts(n: int) -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"prompt_token_ids": rng.integers(3, 250, size=int(rng.integers(3, 20))).tolist()} for _ in range(n)]


def test_acceptance_length_solves_for_a_constant_rate():
    (p,) = set(synthetic_rates(15, 6.5, None))
    assert sum(p**i for i in range(16)) == pytest.approx(6.5, abs=1e-9)
    assert synthetic_rates(3, 4.0, None) == pytest.approx([1.0] * 3)
    assert synthetic_rates(3, 1.0, None) == pytest.approx([0.0] * 3)
    assert synthetic_rates(2, None, [0.9, 0.5, 0.1]) == [0.9, 0.5]


@pytest.mark.parametrize("bad, match", [
    ({"rejection_sample_method": "synthetic"}, "exactly one"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2, "synthetic_acceptance_rates": [1]},
     "exactly one"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [1.5]}, "probabilities"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": float("nan")}, "number"),
    ({"synthetic_acceptance_length": 3}, "need rejection_sample_method"),
    ({"rejection_sample_method": "typical"}, "strict' or 'synthetic"),
])
def test_bad_synthetic_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse({"model": "d", **bad})
    assert not SpeculativeConfig.parse({"model": "d"}).synthetic, "never on by default"


def test_length_outside_the_block_is_refused(qwen3_dir, random_draft_dir):
    with pytest.raises(ValueError, match="synthetic_acceptance_length"):
        LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir, synthetic_acceptance_length=9))


def test_rate_one_accepts_every_draft_and_rate_zero_is_spec_off(qwen3_dir, random_draft_dir):
    ps = prompts(4)
    full = LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir, synthetic_acceptance_rates=[1.0] * 3))
    outs = full.generate(ps, GREEDY, use_tqdm=False)
    st = full.stats()
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    # 23 tokens after the prefill's first one at 4 per step: 6 verify steps per request (the
    # last one cut at max_tokens), every draft accepted.
    assert st.spec_num_drafts == 4 * 6
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens == 3 * st.spec_num_drafts
    assert st.mean_acceptance_length == 4.0
    full.engine.scheduler.check_invariants()
    none = LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir, synthetic_acceptance_length=1.0))
    off = LLM(model=str(qwen3_dir), device="cpu")
    assert [o.outputs[0].token_ids for o in none.generate(ps, GREEDY, use_tqdm=False)] == \
           [o.outputs[0].token_ids for o in off.generate(ps, GREEDY, use_tqdm=False)]
    assert none.stats().mean_acceptance_length == 1.0


def test_mean_length_is_reached_and_runs_repeat(qwen3_dir, random_draft_dir):
    ps = prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(qwen3_dir), device="cpu", max_model_len=256, max_num_seqs=8,
                  speculative_config=spec(random_draft_dir, synthetic_acceptance_length=2.5))
        runs.append([o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)])
    assert runs[0] == runs[1], "the RNG is keyed by (seed, position): runs repeat"
    tau = llm.stats().mean_acceptance_length
    assert 2.2 < tau < 2.8, tau  # ~400 steps; the per-step std of a+1 is ~1.1


def test_synthetic_through_the_kernel_decode_step(qwen3_dir, random_draft_dir, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the interpreter mode is for machines without a GPU")
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    ran = []
    real = GraphRunner.step
    monkeypatch.setattr(GraphRunner, "step", lambda self, *a: (ran.append(1), real(self, *a))[1])
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=2,
              speculative_config=spec(random_draft_dir, synthetic_acceptance_rates=[1.0] * 3))
    outs = llm.generate(prompts(2), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True), use_tqdm=False)
    assert ran and all(len(o.outputs[0].token_ids) == 9 for o in outs)
    st = llm.stats()
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens  # 1 + 4 + 4 tokens: two full blocks each


def test_synthetic_is_labelled_in_metrics_responses_and_bench(fresh_server, spec_on_server):
    """A server with synthetic acceptance says so in /metrics (acceptance label), in every
    response's system_fingerprint, and in `bench serve`'s counters; a normal one does not."""
    import asyncio

    import httpx
    from server_fixtures import MODEL_NAME, NUM_SPEC_TOKENS, tiny_model_dirs

    from dflash_engine import bench_serve

    _, draft = tiny_model_dirs(None)  # created by the spec_on_server fixture
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 8, "temperature": 0}
    for server, label in [
        (fresh_server(speculative_config={**spec(draft, synthetic_acceptance_length=2.0),
                                          "num_speculative_tokens": NUM_SPEC_TOKENS}), "synthetic"),
        (spec_on_server, "target"),
    ]:
        r = httpx.post(f"{server.base_url}/completions", timeout=60, json=body)
        fingerprint = "dflash-engine-synthetic-acceptance" if label == "synthetic" else "dflash-engine"
        assert r.status_code == 200 and r.json()["system_fingerprint"] == fingerprint
        text = httpx.get(f"{server.url}/metrics").text
        assert f'vllm:spec_decode_num_drafts_total{{acceptance="{label}"' in text
        counters = asyncio.run(_counters(bench_serve, server.url))
        assert counters["synthetic"] == (1.0 if label == "synthetic" else 0.0)


async def _counters(bench_serve, url):
    import httpx

    async with httpx.AsyncClient() as c:
        return await bench_serve._spec_counters(c, url)
