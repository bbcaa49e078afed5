"""Host/device overlap (issue 10, item 3): step N's outputs are built while step N+1 runs.

Overlap on and off (`LLMEngine.overlap`, env DFLASH_OVERLAP) give the same tokens, text and
streamed deltas; outputs come one step late and none is lost; an abort while a request's
result is pending keeps its tokens; stop strings, per-request and per-step faults behave as
without overlap. The kernel (decode-graph) path with the overlap: tests/test_gpu_step.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import httpx
import pytest
import torch
from server_fixtures import MODEL_NAME

from dflash_engine import LLM, SamplingParams
from dflash_engine.engine import FaultInjector, LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(model: str, draft: str | None = None, overlap: bool = True, **kw) -> LLMEngine:
    spec = {"method": "dflash", "model": draft, "draft_length": "fixed"} if draft else None
    e = LLMEngine.from_kwargs(model=model, device="cpu", speculative_config=spec, **kw)
    e.overlap = overlap
    return e


def drive(e: LLMEngine, ps: list[list[int]], params, sink: bool = False) -> dict[str, list]:
    """Every output of every request, in order (streamed deltas and the final one)."""
    seen: dict[str, list] = {}
    got: list = []
    if sink:
        e.output_sink = got.extend
    for i, p in enumerate(ps):
        e.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    while e.has_unfinished_requests():
        got.extend(e.step())
    for out in got:
        seen.setdefault(out.request_id, []).append(out)
    e.scheduler.check_invariants()
    assert e.scheduler.kv_usage == 0 and e.scheduler.num_live == 0
    return seen


def summary(seen: dict[str, list]) -> dict[str, tuple]:
    out = {}
    for rid, outs in seen.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], "one final output, last"
        final = outs[-1].outputs[0]
        deltas = [t for o in outs for t in o.new_token_ids]
        text = "".join(o.new_text for o in outs)
        assert deltas == final.token_ids and text == final.text, "the deltas add up to the final output"
        out[rid] = (final.token_ids, final.text, final.finish_reason)
    return out


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("n,max_num_seqs", [(1, 1), (5, 2), (8, 8)])
def test_overlap_gives_the_same_outputs(qwen3_dir, random_draft_dir, spec, n, max_num_seqs):
    draft = str(random_draft_dir) if spec else None
    ps = prompts(n, seed=n)
    params = [GREEDY if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.9, max_tokens=7 + i, seed=i,
                                                      ignore_eos=True) for i in range(n)]
    on = drive(engine(str(qwen3_dir), draft, overlap=True, max_num_seqs=max_num_seqs), ps, params)
    off = drive(engine(str(qwen3_dir), draft, overlap=False, max_num_seqs=max_num_seqs), ps, params)
    assert summary(on) == summary(off)
    assert len(on) == n


def test_outputs_come_one_step_late_and_the_last_ones_are_flushed(qwen3_dir):
    e = engine(str(qwen3_dir), max_num_seqs=2)
    e.add_request("a", prompts(1)[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert e.step() == []  # the prefill's token is pending
    assert e.has_unfinished_requests()
    outs = e.step()
    assert [len(o.new_token_ids) for o in outs] == [1]
    e.step()  # launches the 3rd token's step and returns with it in flight
    assert e.scheduler.num_live == 1 and e.has_unfinished_requests()
    last = e.step()  # lands it (the core finishes the request), nothing to run: its output comes at once
    assert e.scheduler.num_live == 0
    assert [o.finished for o in last] == [True] and len(last[0].outputs[0].token_ids) == 3
    assert not e.has_unfinished_requests() and e.step() == []


def test_sink_gets_the_outputs_during_the_step(qwen3_dir, random_draft_dir):
    ps = prompts(4, seed=9)
    with_sink = drive(engine(str(qwen3_dir), str(random_draft_dir), max_num_seqs=4), ps, GREEDY, sink=True)
    off = drive(engine(str(qwen3_dir), str(random_draft_dir), overlap=False, max_num_seqs=4), ps, GREEDY)
    assert summary(with_sink) == summary(off)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_abort_while_the_result_is_pending_keeps_its_tokens(qwen3_dir, steps):
    def run(overlap: bool):
        e = engine(str(qwen3_dir), overlap=overlap, max_num_seqs=2)
        e.add_request("a", prompts(1)[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        e.add_request("b", prompts(2)[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        streamed = [t for _ in range(steps) for o in e.step() if o.request_id == "a" for t in o.new_token_ids]
        aborted = e.abort_request("a")
        rest = []
        while e.has_unfinished_requests():
            rest += e.step()
        assert all(o.request_id == "b" for o in rest), "nothing of 'a' after its abort"
        assert e.scheduler.kv_usage == 0
        assert streamed + aborted.new_token_ids == aborted.outputs[0].token_ids
        return aborted.outputs[0].token_ids, aborted.outputs[0].finish_reason, rest[-1].outputs[0].token_ids

    on, off = run(True), run(False)
    assert on == off and on[1] == "abort"


@pytest.mark.parametrize("overlap", [True, False])
def test_the_callers_work_between_steps_is_not_in_the_hosts_gap(qwen3_dir, overlap):
    """Overlapped, step() returns with the next step in flight, so what the caller does
    before the next call (the server's admissions, aborts, stats) runs while the device
    works: the host path's between_steps phase (worker/host_path.py) does not see it. The
    synchronous step returns at a boundary, and the caller's 20 ms are in every gap."""
    e = engine(str(qwen3_dir), overlap=overlap, max_num_seqs=2)
    e.add_request("a", prompts(1)[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
        time.sleep(0.02)
    s = e.stats()
    assert s.step_host_gaps >= 5
    if overlap:
        assert s.step_host_seconds["between_steps"] < 0.005
    else:
        assert s.step_host_seconds["between_steps"] >= 0.019 * s.step_host_gaps


def test_abort_of_a_request_finished_in_the_pending_step(qwen3_dir):
    e = engine(str(qwen3_dir))
    e.add_request("a", prompts(1)[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    e.step()
    e.step()  # the 2nd token's step is in flight: the abort lands it, the core finishes 'a' then
    assert e.scheduler.handle_of("a") is not None
    out = e.abort_request("a")  # ('a' finished by the landed step, its output still pending)
    assert out is not None and out.finished and len(out.outputs[0].token_ids) == 2
    assert not e.has_unfinished_requests() and e.step() == []
    assert e.abort_request("a") is None


def test_stop_string_found_while_the_next_step_runs(qwen3_dir):
    ps = prompts(3, seed=4)
    base = drive(engine(str(qwen3_dir), overlap=False, max_num_seqs=3), ps, GREEDY)
    text = summary(base)["1"][1]
    assert len(text) > 6
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[text[3:5]]), GREEDY]
    on = drive(engine(str(qwen3_dir), max_num_seqs=3), ps, params)
    off = drive(engine(str(qwen3_dir), overlap=False, max_num_seqs=3), ps, params)
    assert summary(on) == summary(off)
    assert summary(on)["1"][2] == "stop" and summary(on)["0"] == summary(base)["0"]


def test_a_stop_string_that_empties_the_engine_lands_its_flight_and_opens_no_gap(qwen3_dir):
    """The last request stops on a stop string found while its next step is in flight: the
    engine lands that step at once (nothing left to wait for later) and counts no host gap
    across the idle time before the next request."""
    e = engine(str(qwen3_dir), max_num_seqs=2)
    prompt = prompts(3, seed=4)[1]  # (its greedy text decodes to whole characters early on)
    text = summary(drive(engine(str(qwen3_dir), overlap=False), [prompt], GREEDY))["0"][1]
    e.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop=[text[3:5]]))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
    assert e._flight is None and e.scheduler.num_live == 0  # landed, the core at rest
    before = e.stats().step_host_seconds["between_steps"]
    time.sleep(0.3)
    e.add_request("b", prompts(1)[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    assert e.stats().step_host_seconds["between_steps"] - before < 0.1


class Faults(FaultInjector):
    """Request '1' fails while its output is processed; any step holding request '3' raises."""

    def step(self, requests) -> None:
        if any(r.request_id == "3" for r in requests):
            raise RuntimeError("injected step fault")

    def request(self, request) -> None:
        if request.request_id == "1" and len(request.token_ids) >= 2:
            raise RuntimeError("injected request fault")


@pytest.mark.parametrize("spec", [False, True])
def test_faults_fail_only_their_requests(qwen3_dir, random_draft_dir, spec):
    draft = str(random_draft_dir) if spec else None
    ps = prompts(5, seed=2)

    def run(overlap: bool):
        e = engine(str(qwen3_dir), draft, overlap=overlap, max_num_seqs=5)
        e.fault_injector = Faults()
        return summary(drive(e, ps, GREEDY))

    on, off = run(True), run(False)
    assert on == off
    assert on["1"][2] == "error" and on["3"][2] == "error"
    clean = summary(drive(engine(str(qwen3_dir), draft, max_num_seqs=5), ps, GREEDY))
    for rid in "024":
        assert on[rid] == clean[rid]


def test_step_timer_counts_every_step(qwen3_dir, random_draft_dir):
    e = engine(str(qwen3_dir), str(random_draft_dir), max_num_seqs=4)
    launches = []
    real = e.runner.launch

    def counting(*a, **k):
        launches.append(1)
        return real(*a, **k)

    e.runner.launch = counting
    drive(e, prompts(4, seed=1), GREEDY)
    s = e.stats()
    assert s.num_steps == len(launches) > 1
    assert s.step_busy_seconds > 0 and 0 <= s.step_idle_seconds < s.step_busy_seconds + 1.0
    assert s.generation_tokens == 4 * GREEDY.max_tokens


def test_env_switch(qwen3_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_OVERLAP", "0")
    assert engine(str(qwen3_dir), overlap=True).overlap is True  # the attribute wins; the env sets the default
    assert LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu").overlap is False
    monkeypatch.delenv("DFLASH_OVERLAP")
    assert LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu").overlap is True


def test_streamed_server_outputs_match_with_overlap_off(fresh_server):
    server = fresh_server()

    async def load() -> list[str]:
        async def one(client: httpx.AsyncClient, i: int) -> str:
            body = {"model": MODEL_NAME, "prompt": f"overlap {i} " * (i + 1), "max_tokens": 9 + i,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            text = ""
            async with client.stream("POST", f"{server.base_url}/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(6)))

    assert server.engine.overlap and server.engine.output_sink is not None
    if "DFLASH_SWITCH_INTERVAL_MS" not in os.environ:
        assert sys.getswitchinterval() == pytest.approx(0.0005)  # the server's shorter GIL switch interval
    on = asyncio.run(load())
    server.wait_idle()
    server.engine.overlap = False
    off = asyncio.run(load())
    assert on == off and all(on)
    stats = server.wait_idle()
    assert stats.kv_cache_usage == 0


def test_config_flag_wins_over_the_env(qwen3_dir, monkeypatch):
    """overlap= (LLM / EngineConfig) and `serve --no-overlap` set it; the env is the default."""
    import argparse

    from dflash_engine.cli_args import add_serve_args, engine_kwargs

    monkeypatch.setenv("DFLASH_OVERLAP", "0")
    assert LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu", overlap=True).overlap is True
    monkeypatch.delenv("DFLASH_OVERLAP")
    assert LLM(model=str(qwen3_dir), device="cpu", overlap=False).engine.overlap is False
    p = add_serve_args(argparse.ArgumentParser())
    assert engine_kwargs(p.parse_args([str(qwen3_dir), "--no-overlap"]))["overlap"] is False
    assert "overlap" not in engine_kwargs(p.parse_args([str(qwen3_dir)]))
