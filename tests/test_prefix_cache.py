"""Prefix caching with DFlash (issue 12): the target KV and the draft context of cached pages
are reused, and nothing a request sees changes: greedy outputs and τ with caching on equal
those with caching off, at every concurrency, under preemption and chunked prefill; a second
chat turn reuses the first turn's pages; the counts reach the API and /metrics."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from dflash_engine import LLM, SamplingParams
from dflash_engine.cli_args import add_serve_args, engine_kwargs

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def spec(draft) -> dict:
    return {"method": "dflash", "model": str(draft), "draft_length": "fixed"}


def shared_prefix_workload(n: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Three "system prompts" (37, 21 and 50 tokens) and `n` requests, each one of them plus a
    distinct question of 2-12 tokens; and the system prompts alone (the warm-up)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 250, size=k).tolist() for k in (37, 21, 50)]
    reqs = [{"prompt_token_ids": systems[i % 3] + rng.integers(3, 250, size=int(rng.integers(2, 13))).tolist()}
            for i in range(n)]
    return [{"prompt_token_ids": s} for s in systems], reqs


def run(llm: LLM, warm: list[dict], reqs: list[dict]) -> tuple[list[list[int]], list[int]]:
    """Warm-up (the system prompts alone), then the batch; token ids and cached counts."""
    llm.generate(warm, GREEDY, use_tqdm=False)
    outs = llm.generate(reqs, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def spec_stats(llm: LLM) -> tuple:
    s = llm.stats()
    return (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_accepted_per_pos,
            s.mean_acceptance_length)


def pool_is_full(llm: LLM) -> bool:
    s = llm.engine.scheduler
    return s.num_free_pages == s.num_usable_pages and s.num_live == 0


@pytest.fixture(scope="module")
def caching_off(trained):
    """Outputs and spec statistics with caching off, per concurrency (computed on demand)."""
    cache: dict = {}

    def get(concurrency: int, **kw):
        key = (concurrency, tuple(sorted(kw.items())))
        if key not in cache:
            llm = LLM(model=str(trained.target), device="cpu", max_num_seqs=concurrency,
                      speculative_config=spec(trained.draft), enable_prefix_caching=False, **kw)
            warm, reqs = shared_prefix_workload(max(concurrency, 8))
            toks, cached = run(llm, warm, reqs)
            assert cached == [0] * len(reqs) and llm.stats().prefix_cache_queries == 0
            assert pool_is_full(llm)
            cache[key] = (toks, spec_stats(llm))
        return cache[key]

    return get


@pytest.mark.parametrize("concurrency", [1, 2, 8, 32])
def test_caching_changes_neither_outputs_nor_acceptance(trained, caching_off, concurrency):
    ref_tokens, ref_stats = caching_off(concurrency, block_size=4)
    llm = LLM(model=str(trained.target), device="cpu", max_num_seqs=concurrency, block_size=4,
              speculative_config=spec(trained.draft))
    assert llm.engine.scheduler.enable_prefix_caching, "on by default"
    warm, reqs = shared_prefix_workload(max(concurrency, 8))
    toks, cached = run(llm, warm, reqs)
    assert toks == ref_tokens
    assert spec_stats(llm) == ref_stats
    assert ref_stats[-1] > 1.5, "the trained draft is accepted: τ compares real acceptance"
    # Every request found the full pages (4 tokens) of its system prompt cached.
    for i, (r, c) in enumerate(zip(reqs, cached)):
        system_len = len(warm[i % 3]["prompt_token_ids"])
        assert system_len // 4 * 4 <= c < len(r["prompt_token_ids"])
    stats = llm.stats()
    assert stats.prefix_cache_hits >= sum(cached) and stats.prefix_cache_queries >= sum(len(r["prompt_token_ids"]) for r in reqs)
    assert pool_is_full(llm)
    llm.engine.scheduler.check_invariants()


def test_caching_is_lossless_under_preemption_and_chunked_prefill(trained, caching_off):
    # 24-token steps chunk every prompt; 14 pages of 4 tokens hold about two requests at once,
    # so requests are preempted and resume (re-admitted through the cache). (40 pages hold
    # one request of max_model_len 128, as startup requires.)
    kw = dict(block_size=4, max_num_batched_tokens=24, num_gpu_blocks_override=40, max_model_len=128)
    ref_tokens, ref_stats = caching_off(12, **kw)
    llm = LLM(model=str(trained.target), device="cpu", max_num_seqs=12, speculative_config=spec(trained.draft), **kw)
    warm, reqs = shared_prefix_workload(12)
    toks, cached = run(llm, warm, reqs)
    assert toks == ref_tokens
    assert spec_stats(llm) == ref_stats
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and sum(cached) > 0
    assert pool_is_full(llm)
    llm.engine.scheduler.check_invariants()


def test_caching_is_lossless_with_16_token_pages_and_the_random_draft(qwen3_dir, random_draft_dir):
    warm, reqs = shared_prefix_workload(16, seed=5)
    outs = {}
    for on in (False, True):
        llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=16, max_num_batched_tokens=64,
                  speculative_config=spec(random_draft_dir), enable_prefix_caching=on)
        outs[on] = run(llm, warm, reqs)[0], spec_stats(llm), llm.stats().prefix_cache_hits
    assert outs[True][:2] == outs[False][:2]
    assert outs[True][2] > 0 and outs[False][2] == 0


def test_second_chat_turn_reuses_the_first_turns_pages(qwen3_dir, random_draft_dir):
    llm = LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    turn1 = [{"role": "system", "content": "You are a terse assistant who answers in one line."},
             {"role": "user", "content": "Name three prime numbers."}]
    first = llm.chat(turn1, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     {"role": "user", "content": "And three more?"}]
    second = llm.chat(turn2, params, use_tqdm=False)[0]
    n1 = len(first.prompt_token_ids)
    assert second.prompt_token_ids[:n1] == first.prompt_token_ids
    # At least every full 16-token page of the first turn's prompt comes from the cache.
    assert n1 // 16 * 16 <= second.num_cached_tokens < len(second.prompt_token_ids)
    assert second.num_cached_tokens % 16 == 0
    alone = LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir),
                enable_prefix_caching=False).chat(turn2, params, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == alone.outputs[0].token_ids
    assert alone.num_cached_tokens == 0


def test_serve_flag_is_on_by_default():
    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert engine_kwargs(parse([]))["enable_prefix_caching"] is True
    assert engine_kwargs(parse(["--enable-prefix-caching"]))["enable_prefix_caching"] is True
    assert engine_kwargs(parse(["--no-enable-prefix-caching"]))["enable_prefix_caching"] is False


def _scrape(server) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("vllm:prefix_cache")}


def test_server_reports_cached_tokens_in_usage_and_metrics(spec_on_server):
    from openai import OpenAI
    from server_fixtures import MODEL_NAME

    client = OpenAI(base_url=spec_on_server.base_url, api_key="x")
    system = "You are a careful assistant. Answer every question briefly and precisely, in English."
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is two plus two?"}]
    before = _scrape(spec_on_server)
    r1 = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=6, temperature=0)
    msgs2 = msgs + [{"role": "assistant", "content": r1.choices[0].message.content},
                    {"role": "user", "content": "And three plus three?"}]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=msgs2, max_tokens=6, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in r2 if c.usage is not None][-1]
    spec_on_server.wait_idle()
    after = _scrape(spec_on_server)
    cached = usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens // 16 * 16 <= cached < usage.prompt_tokens
    queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert queries == r1.usage.prompt_tokens + usage.prompt_tokens
    assert hits == r1.usage.prompt_tokens_details.cached_tokens + cached
