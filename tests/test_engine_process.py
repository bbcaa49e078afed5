"""The engine in its own process (server/engine_process.py, `serve`'s default): same answers as
the in-process engine thread, errors and aborts across the pipe, a dead engine process seen as
one (503, failed streams), and no engine process outliving its client."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_fixtures import MAX_MODEL_LEN, MODEL_NAME, NUM_SPEC_TOKENS, LiveServer, tiny_model_dirs

from dflash_engine.outputs import CompletionOutput, RequestOutput
from dflash_engine.sampling_params import SamplingParams
from dflash_engine.server.async_engine import RequestStream
from dflash_engine.server.engine_process import EngineProcessClient


def _kwargs(root: Path, spec: bool = True) -> dict:
    target, draft = tiny_model_dirs(root)
    spec_cfg = ({"method": "dflash", "model": str(draft), "num_speculative_tokens": NUM_SPEC_TOKENS}
                if spec else None)
    return dict(model=str(target), speculative_config=spec_cfg, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
                dtype="float32", device="cpu", num_gpu_blocks_override=128)


@pytest.fixture(scope="module")
def process_server(models_root: Path):
    server = LiveServer(None, async_engine=EngineProcessClient.build(_kwargs(models_root)))
    yield server
    server.stop()
    server.async_engine.shutdown()


def _complete(base_url: str, prompt: str, stream: bool, max_tokens: int = 12) -> tuple[str, dict | None]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{base_url}/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    text, usage = "", None
    with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage


PROMPTS = ["hello there", "the quick brown fox", "one two three four", "a b c", "zeta", "what is it"]


def test_engine_process_answers_as_the_engine_thread(process_server, spec_on_server):
    """Greedy answers, whole and streamed, 6 requests at once: the engine process and the
    in-process engine thread (same model, same draft) give the same text and token counts."""
    with ThreadPoolExecutor(12) as pool:
        jobs = {(p, s, which): pool.submit(_complete, srv.base_url, p, s)
                for p in PROMPTS for s in (False, True)
                for which, srv in (("process", process_server), ("thread", spec_on_server))}
        got = {key: job.result() for key, job in jobs.items()}
    for p in PROMPTS:
        for s in (False, True):
            (text, usage), (text_thread, usage_thread) = got[(p, s, "process")], got[(p, s, "thread")]
            assert text == text_thread, (p, s)  # (cached prompt tokens differ: the caches' histories do)
            assert usage["prompt_tokens"] == usage_thread["prompt_tokens"] and usage["completion_tokens"] == 12
    assert process_server.async_engine.engine is None, "the engine lives in the other process"
    # The stats the engine process sends reach /metrics once it is idle.
    stats = process_server.wait_idle()
    assert stats.generation_tokens >= 12 * len(PROMPTS) * 2 and stats.spec_num_drafts > 0
    text = httpx.get(f"{process_server.url}/metrics", timeout=10).text
    assert f'vllm:generation_tokens_total{{model_name="{MODEL_NAME}"}} {float(stats.generation_tokens)}' in text
    assert "vllm:time_to_first_token_seconds_count" in text


def test_engine_error_crosses_the_pipe_as_a_value_error(process_server):
    """A request the engine refuses (token ids outside the vocabulary, checked in the engine
    process) fails its own stream with the engine's ValueError, param included; the next
    request is served."""
    client = process_server.async_engine

    async def run() -> None:
        with pytest.raises(ValueError, match="outside the vocabulary") as info:
            async for _ in client.generate("bad-1", [1, 2, client.vocab_size + 5], SamplingParams(max_tokens=3)):
                pass
        assert getattr(info.value, "param", None) == "prompt"
        outs = [o async for o in client.generate("good-1", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        assert outs[-1].prompt_token_ids == [1, 2, 3]
        assert sum(len(o.new_token_ids) for o in outs) == 3

    asyncio.run(run())
    assert client.num_in_flight == 0 and not client._routes


def test_disconnect_aborts_the_request_in_the_engine_process(process_server):
    """A streaming client that goes away mid-answer: its request is aborted in the engine
    process, which runs nothing afterwards."""
    process_server.wait_idle()
    body = {"model": MODEL_NAME, "prompt": "count with me", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{process_server.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = process_server.async_engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            break
        time.sleep(0.05)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.generation_tokens < 12 * len(PROMPTS) * 2 + 200 + 3, "the aborted request ran to its end"
    assert process_server.async_engine.num_in_flight == 0


def test_killed_engine_process_fails_its_requests_and_health(models_root: Path):
    """SIGKILL the engine process mid-stream: the stream ends with an error event, /health and
    new requests answer 503 (engine_unavailable), the server itself keeps answering."""
    client = EngineProcessClient.build(_kwargs(models_root, spec=False))
    server = LiveServer(None, async_engine=client)
    try:
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        body = {"model": MODEL_NAME, "prompt": "go on", "max_tokens": 240, "temperature": 0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 1:
                        os.kill(client._proc.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]" and "engine" in json.loads(events[-2])["error"]["message"]
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "exited" in health.json()["error"]["message"]
        r = httpx.post(f"{server.base_url}/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        server.stop()
        client.shutdown(timeout=5)
    assert not client._proc.is_alive()


def test_build_error_is_raised_in_the_server_process(tmp_path: Path):
    """A model that cannot be built: the engine process's error is raised by build(), naming
    the problem, and the process is gone."""
    with pytest.raises((ValueError, FileNotFoundError, OSError), match="nowhere"):
        EngineProcessClient.build({"model": str(tmp_path / "nowhere"), "device": "cpu"})


def test_shutdown_stops_the_engine_process(models_root: Path):
    client = EngineProcessClient.build(_kwargs(models_root, spec=False))
    assert client.is_healthy and client._proc.is_alive()
    client.shutdown(timeout=20)
    assert not client._proc.is_alive() and client._proc.exitcode == 0
    assert not client.is_healthy
    client.shutdown()  # idempotent


def _out(ids: list[int], text: str, cumulative: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "".join(map(str, cumulative)), cumulative,
                                                           "length" if finished else None)],
                         finished=finished, new_token_ids=ids, new_text=text)


def test_stream_merges_outputs_queued_behind_a_slow_consumer():
    """A consumer that fell behind reads every queued output as one (deltas joined, the latest
    cumulative fields), stops merging at a queued error (raised on the next read), and never
    merges past a finished output."""
    async def run() -> None:
        s = RequestStream("r", asyncio.get_running_loop())
        for item in (_out([1], "1", [1]), _out([2, 3], "23", [1, 2, 3]), ValueError("boom"), _out([4], "4", [4])):
            s.queue.put_nowait(item)
        first = await s.get()
        assert first.new_token_ids == [1, 2, 3] and first.new_text == "123"
        assert first.outputs[0].token_ids == [1, 2, 3]
        with pytest.raises(ValueError, match="boom"):
            await s.get()
        assert (await s.get()).new_token_ids == [4]
        done = _out([5], "5", [5], finished=True)
        s.queue.put_nowait(done)
        s.queue.put_nowait(_out([6], "6", [6]))
        assert (await s.get()) is done

    asyncio.run(run())


def test_serve_flag_keeps_the_engine_in_process():
    from dflash_engine.cli import build_parser

    args = build_parser().parse_args(["serve", "--disable-frontend-multiprocessing"])
    assert args.disable_frontend_multiprocessing
    assert not build_parser().parse_args(["serve"]).disable_frontend_multiprocessing
