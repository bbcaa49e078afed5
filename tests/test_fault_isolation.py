"""Injected faults under concurrent load fail only the requests they hit; the server keeps
serving, /health stays truthful, and the KV pool drains back to full."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_fixtures import MODEL_NAME


class Faults:
    """engine.fault_injector: requests whose prompt holds 'poison' fail while their output
    is processed; any step that holds a 'boom' request raises (alone or batched)."""

    def __init__(self, engine):
        self.decode = engine.tokenizer.decode

    def step(self, requests) -> None:
        if any("boom" in self.decode(r.prompt_token_ids) for r in requests):
            raise RuntimeError("injected step fault")

    def request(self, request) -> None:
        if "poison" in self.decode(request.prompt_token_ids):
            raise RuntimeError("injected request fault")


async def _one(c: openai.AsyncOpenAI, i: int, tag: str, max_tokens: int, delay: float) -> int | Exception:
    """Completion tokens on success, the exception otherwise; even i streams."""
    await asyncio.sleep(delay)
    headers = {"X-Request-Id": f"{tag}-{i}"}
    try:
        if i % 2 == 0:
            stream = await c.completions.create(
                model=MODEL_NAME, prompt=f"{tag} load {i}", max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                extra_headers=headers)
            chunks = [ch async for ch in stream]
            return chunks[-1].usage.completion_tokens
        r = await c.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"{tag} load {i}"}], max_tokens=max_tokens,
            temperature=0, extra_body={"ignore_eos": True}, extra_headers=headers)
        return r.usage.completion_tokens
    except openai.APIError as e:
        return e


async def _load(server, tags: list[str], max_tokens: int, stagger: float = 0.02) -> list:
    c = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    try:
        return await asyncio.gather(*(_one(c, i, t, max_tokens, stagger * i) for i, t in enumerate(tags)))
    finally:
        await c.close()


def _assert_serves_and_drains(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert asyncio.run(_load(server, ["after"] * 4, 6)) == [6] * 4
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_cache_usage == 0


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_request_fault_fails_only_that_request(fresh_server, model):
    server = fresh_server(hybrid=model == "hybrid")
    server.engine.fault_injector = Faults(server.engine)
    tags = ["ok", "ok", "poison", "ok", "ok", "poison", "ok", "ok"]
    results = asyncio.run(_load(server, tags, 12))
    for tag, res in zip(tags, results):
        if tag == "poison":
            assert isinstance(res, openai.APIError) and "injected request fault" in str(res), res
        else:
            assert res == 12, res
    non_streamed_poison = results[5]
    assert isinstance(non_streamed_poison, openai.InternalServerError)
    _assert_serves_and_drains(server)


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_step_fault_fails_that_step_only(fresh_server, model):
    server = fresh_server(hybrid=model == "hybrid")
    server.engine.fault_injector = Faults(server.engine)

    async def scenario():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        try:
            short = [asyncio.create_task(_one(c, i, "short", 4, 0)) for i in range(3)]
            long = [asyncio.create_task(_one(c, i, "long", 48, 0)) for i in range(3)]
            done_before = await asyncio.gather(*short)
            # 'boom' joins while the long requests decode: the step it enters fails, is retried
            # one request at a time, and only 'boom' (which fails alone too) is failed.
            boom = await _one(c, 9, "boom", 8, 0)
            return done_before, await asyncio.gather(*long), boom
        finally:
            await c.close()

    done_before, long, boom = asyncio.run(scenario())
    assert done_before == [4, 4, 4]  # finished before the fault: untouched
    assert isinstance(boom, openai.APIError) and "injected step fault" in str(boom)
    assert long == [48, 48, 48], "innocent requests of a failed step are never failed with it"
    _assert_serves_and_drains(server)


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_step_that_raises_out_of_the_engine_is_contained(fresh_server, model):
    """The async engine's backstop: engine.step() itself raising once."""
    server = fresh_server(hybrid=model == "hybrid")
    real_step, calls = server.engine.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("step exploded")
        return real_step()

    server.engine.step = flaky_step
    results = asyncio.run(_load(server, ["ok"] * 4, 8, stagger=0))
    assert any(isinstance(r, openai.APIError) and "step exploded" in str(r) for r in results), results
    assert all(r == 8 or isinstance(r, openai.APIError) for r in results)
    _assert_serves_and_drains(server)


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_health_is_503_only_when_the_engine_cannot_serve(fresh_server, model):
    server = fresh_server(hybrid=model == "hybrid")
    assert httpx.get(f"{server.url}/health").status_code == 200

    def broken(*_args):
        raise RuntimeError("unrecoverable")

    server.engine.step = broken
    server.engine.abort_request = broken  # so the failed step cannot even be reset
    r = httpx.post(f"{server.base_url}/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code in (500, 503) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health").status_code == 503
    r = httpx.post(f"{server.base_url}/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503
