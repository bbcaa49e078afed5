"""The OpenAI-compatible server through the `openai` SDK, against live servers."""
from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MAX_MODEL_LEN, MODEL_NAME

from dflash_engine.cli_args import add_serve_args

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def prompt_len(server, prompt: str) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["count"]


@pytest.mark.parametrize("server_name", ["spec_off_server", "spec_on_server"])
def test_completions_stream_and_not(server_name, request):
    server = request.getfixturevalue(server_name)
    c = client(server)
    prompt = "The quick brown fox"
    full = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert full.object == "text_completion" and choice.finish_reason == "length"
    assert full.usage.prompt_tokens == prompt_len(server, prompt)
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.parametrize("server_name", ["spec_off_server", "spec_on_server"])
def test_chat_stream_and_not(server_name, request):
    server = request.getfixturevalue(server_name)
    c = client(server)
    full = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_completion_tokens=10,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    assert full.usage.prompt_tokens == rendered["count"]

    chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 10


def test_sampling_options(spec_on_server):
    c = client(spec_on_server)
    base = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=16, extra_body={"ignore_eos": True})
    greedy = c.completions.create(temperature=0, **base).choices[0]
    # A stop string taken from the greedy text ends the completion right before it. (One
    # character: the tiny random model's text is mostly partial UTF-8.)
    stop = next(ch for ch in greedy.text[1:] if ch.isascii() and ch.isalnum())
    cut = c.completions.create(temperature=0, stop=[stop], **base).choices[0]
    assert cut.finish_reason == "stop" and cut.text == greedy.text[: greedy.text.index(stop)]
    # Seeded sampling repeats; top_k=1 is greedy.
    seeded = dict(temperature=1.0, top_p=0.9, seed=1234, **base)
    assert c.completions.create(**seeded).choices[0].text == c.completions.create(**seeded).choices[0].text
    top1 = c.completions.create(temperature=0.8, **{**base, "extra_body": {"ignore_eos": True, "top_k": 1}})
    assert top1.choices[0].text == greedy.text
    # A stop token id ends generation at once: every id is one here.
    stopped = c.completions.create(temperature=0, **{**base, "extra_body": {"stop_token_ids": list(range(300))}})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


def test_models_health_tokenize(spec_off_server):
    models = client(spec_off_server).models.list().data
    assert [(m.id, m.root) for m in models] == [(MODEL_NAME, "/models/tiny")]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(f"{spec_off_server.url}/health").status_code == 200
    ids = httpx.post(f"{spec_off_server.url}/tokenize", json={"prompt": "héllo wörld"}).json()["tokens"]
    back = httpx.post(f"{spec_off_server.url}/detokenize", json={"tokens": ids}).json()
    assert back["prompt"] == "héllo wörld"


def test_spec_on_streams_equal_spec_off_16_concurrent_staggered(spec_off_server, spec_on_server):
    async def run(server) -> list[str]:
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)

        async def one(i: int) -> str:
            await asyncio.sleep(0.03 * i)  # staggered: requests join a batch already decoding
            if i % 2:
                stream = await c.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": f"request {i}: count"}],
                    max_tokens=10 + i % 5, temperature=0, stream=True, extra_body={"ignore_eos": True})
                return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            stream = await c.completions.create(
                model=MODEL_NAME, prompt=f"{i} bottles of" + " x" * i, max_tokens=10 + i % 5,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await c.close()

    off, on = asyncio.run(run(spec_off_server)), asyncio.run(run(spec_on_server))
    assert all(off) and on == off


def _scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _get(m: dict, name: str, **labels: str) -> float:
    if name.startswith("vllm:spec_decode"):
        labels = {"acceptance": "target", **labels}  # real acceptance, not the synthetic one
    return m[(name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items())))]


def test_metrics_move(spec_on_server):
    before = _scrape(spec_on_server)
    r = client(spec_on_server).completions.create(model=MODEL_NAME, prompt="metrics please", max_tokens=9,
                                                  temperature=0, extra_body={"ignore_eos": True})
    spec_on_server.wait_idle()
    after = _scrape(spec_on_server)

    def delta(name: str, **labels: str) -> float:
        return _get(after, name, **labels) - _get(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds"):
        assert delta(f"vllm:{hist}_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") >= 1
    assert delta("vllm:spec_decode_num_drafts_total") >= 1
    assert delta("vllm:spec_decode_num_draft_tokens_total") >= delta("vllm:spec_decode_num_drafts_total")
    per_pos = sum(delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                  for i in range(len([k for k in after if k[0].endswith("per_pos_total")])))
    assert per_pos == delta("vllm:spec_decode_num_accepted_tokens_total")
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _get(after, f"vllm:{gauge}") == 0
    assert _get(after, "vllm:num_preemptions_total") >= 0
    # CPU fast mode: every step eager (one per engine step timed); no graph runner
    assert delta("dflash:steps_by_path_total", path="eager") == delta("dflash:steps_total") >= 1


def test_api_key(fresh_server):
    server = fresh_server(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        client(server, api_key="wrong").models.list()
    r = httpx.post(f"{server.base_url}/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert client(server, api_key="s3cret").completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    assert httpx.get(f"{server.url}/health").status_code == 200  # only /v1/* is guarded


def test_serve_flags(monkeypatch):
    monkeypatch.setenv("DFLASH_API_KEY", "from-env")
    args = add_serve_args(argparse.ArgumentParser()).parse_args([
        "some/model", "--num-blocks", "64", "--speculative-config", '{"method": "dflash", "model": "d"}',
        "--no-enable-prefix-caching", "--max-num-seqs", "4", "--max-model-len", "512",
        "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.8", "--dtype", "float32",
        "--device", "cpu", "--seed", "3", "--served-model-name", "m", "--port", "9000"])
    assert args.api_key == "from-env" and args.host == "127.0.0.1"
    assert args.num_gpu_blocks_override == 64 and args.speculative_config["model"] == "d"
    assert args.enable_prefix_caching is False and args.model == "some/model"
    with pytest.raises(SystemExit):
        add_serve_args(argparse.ArgumentParser()).parse_args(["--speculative-config", "{not json"])


def test_serve_builds_the_engine_on_the_thread_that_steps_it(models_root):
    """`serve` builds through AsyncLLMEngine.build: the engine is built on its own thread, and
    that thread (not the caller, not the event loop's) runs every step; the server answers as
    with an engine built elsewhere. A build error is raised in the caller, naming the problem."""
    import gc
    import threading

    from server_fixtures import LiveServer, make_engine

    from dflash_engine.server import AsyncLLMEngine

    seen: dict[str, Any] = {"steps": set()}

    def factory():
        seen["build"] = threading.get_ident()
        engine = make_engine(models_root, spec=True)
        real_step = engine.step
        engine.step = lambda: seen["steps"].add(threading.get_ident()) or real_step()
        return engine

    frozen = gc.get_freeze_count()
    async_engine = AsyncLLMEngine.build(factory)
    assert seen["build"] != threading.get_ident()
    server = LiveServer(None, async_engine=async_engine)
    # What startup built is out of the cyclic collector's reach once the engine serves.
    assert gc.get_freeze_count() > frozen + 1000
    try:
        r = httpx.post(f"{server.base_url}/completions", json={
            "model": MODEL_NAME, "prompt": "hello there", "max_tokens": 5, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert seen["steps"] == {seen["build"]}
    finally:
        server.stop()

    def broken():
        raise ValueError("no such model: /nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine.build(broken)
