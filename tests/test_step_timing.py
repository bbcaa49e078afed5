"""Device busy / idle time per engine step (issue 10, item 3), on CPU: the step timer's
arithmetic, the engine's accounting (no idle time across empty periods), the Prometheus
counters, and `bench serve` reading them per rung."""
from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from dflash_engine import LLM, SamplingParams, bench_serve
from dflash_engine.cli_args import add_bench_args
from dflash_engine.engine import EngineStats
from dflash_engine.server.metrics import ServerMetrics
from dflash_engine.worker import host_path, step_timer
from dflash_engine.worker.host_path import PHASES, HostPath
from dflash_engine.worker.step_timer import StepTimer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class FakeClock:
    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(step_timer.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(host_path.time, "perf_counter", lambda: self.now)

    def at(self, t: float) -> FakeClock:
        self.now = t
        return self


def totals(t: StepTimer) -> tuple[float, float, int]:
    t.resolve()  # as the runner does after each step
    return t.totals()


def test_timer_arithmetic(monkeypatch):
    clock = FakeClock(monkeypatch)
    t = StepTimer(torch.device("cpu"))
    for start, end in [(0, 1), (3, 4.5), (5, 6)]:  # busy 1 + 1.5 + 1; idle 2 + 0.5
        clock.at(start)
        t.begin()
        clock.at(end)
        t.end()
    assert totals(t) == (3.5, 2.5, 3)
    t.pause()  # the queue emptied: the wait until the next step is not idle
    clock.at(100)
    t.begin()
    clock.at(101)
    t.end()
    assert totals(t) == (4.5, 2.5, 4)
    clock.at(102)
    t.begin()  # a step that fails midway: the engine pauses; it counts neither way
    t.pause()
    clock.at(110)
    t.begin()
    clock.at(111)
    t.end()
    clock.at(111.25)
    t.begin()
    clock.at(112)
    t.end()
    assert totals(t) == (6.25, 2.75, 6)
    t.end()  # an end without a begin is ignored
    assert totals(t) == (6.25, 2.75, 6)


def test_host_path_counts_only_open_gaps_by_phase(monkeypatch):
    clock = FakeClock(monkeypatch)
    h = HostPath()
    h.mark("commit")  # no gap open: nothing counts
    clock.at(1)
    h.start()
    clock.at(1.5)
    h.mark("commit")
    clock.at(1.75)
    h.mark("schedule")
    clock.at(2)
    h.finish()  # the rest is staging
    assert h.totals() == {**dict.fromkeys(PHASES, 0.0), "commit": 0.5, "schedule": 0.25, "stage": 0.25}
    assert h.gaps == 1
    clock.at(5)
    h.mark("schedule")  # closed: nothing until the next start
    h.finish()
    assert h.gaps == 1 and h.totals()["schedule"] == 0.25
    h.start()
    clock.at(9)
    h.cancel()  # the engine went idle: the open gap is dropped
    h.finish()
    assert h.gaps == 1 and sum(h.totals().values()) == 1.0


def test_step_timer_closes_the_host_gap_at_the_first_launch_and_drops_it_on_pause(monkeypatch):
    clock = FakeClock(monkeypatch)
    t = StepTimer(torch.device("cpu"))
    t.begin()
    clock.at(1)
    t.end()
    t.host.start()  # results back (the runner's wait)
    clock.at(1.25)
    t.host.mark("commit")
    clock.at(2)
    t.begin()  # the next step's first launch: 0.75 s of staging
    clock.at(3)
    t.end()
    assert t.host.gaps == 1 and t.host.totals()["stage"] == 0.75 and totals(t)[1] == 1.0
    t.host.start()
    t.pause()  # nothing to run
    clock.at(10)
    t.begin()
    assert t.host.gaps == 1 and sum(t.host.totals().values()) == 1.0


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": list(range(3 + i, 20 + i))} for i in range(n)]


class SlowHost:
    """Sleeps on the host between a step's schedule and its launch: idle device time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.steps = 0

    def step(self, requests):
        self.steps += 1
        time.sleep(self.seconds)

    def request(self, request):
        pass


def test_engine_counts_busy_steps_and_idle_only_while_there_is_work(qwen3_dir, random_draft_dir):
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=4,
              speculative_config={"method": "dflash", "model": str(random_draft_dir), "draft_length": "fixed"})
    s0 = llm.stats()
    assert (s0.step_busy_seconds, s0.step_idle_seconds, s0.num_steps) == (0.0, 0.0, 0)  # the profile is no step
    llm.engine.fault_injector = slow = SlowHost(0.02)
    llm.generate(prompts(3), GREEDY, use_tqdm=False)
    s1 = llm.stats()
    assert s1.num_steps == slow.steps > 1 and s1.step_busy_seconds > 0
    # Every step but the first waited 20 ms on the host before its first launch.
    assert s1.step_idle_seconds >= 0.02 * (s1.num_steps - 1)
    assert s1.step_idle_seconds < 0.02 * (s1.num_steps - 1) + 0.5

    # The host's side of the gaps: the sleep is in the launch's first part ("sampling_arrays":
    # the fault hook runs before the sampling arrays); the phases add up to at most the idle.
    host = s1.step_host_seconds
    assert set(host) == set(PHASES) and 0 < s1.step_host_gaps <= s1.num_steps - 1
    assert host["sampling_arrays"] >= 0.02 * s1.step_host_gaps
    assert sum(host.values()) <= s1.step_idle_seconds + 1e-6
    assert s1.step_host_overlapped_seconds > 0  # the outputs, built between a launch and its wait

    # An empty engine is not an idle device: nothing of the pause counts.
    llm.engine.fault_injector = None
    time.sleep(0.4)
    llm.generate(prompts(2), GREEDY, use_tqdm=False)
    s2 = llm.stats()
    assert s2.num_steps > s1.num_steps and s2.step_busy_seconds > s1.step_busy_seconds
    assert 0 <= s2.step_idle_seconds - s1.step_idle_seconds < 0.3


def test_an_abort_that_empties_the_engine_stops_the_idle_clock(qwen3_dir):
    llm = LLM(model=str(qwen3_dir), device="cpu")
    e = llm.engine
    e.add_request("a", list(range(3, 30)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    e.step()
    e.abort_request("a")
    time.sleep(0.3)
    e.add_request("b", list(range(3, 30)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    s = e.stats()
    assert s.num_steps >= 2 and s.step_idle_seconds < 0.2


def test_metrics_expose_the_step_counters_and_bench_parses_them():
    stats = EngineStats(step_busy_seconds=1.5, step_idle_seconds=0.5, num_steps=40,
                        step_host_seconds={"commit": 0.1, "stage": 0.2}, step_host_gaps=39)
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'dflash:step_host_seconds_total{model_name="m",phase="stage"} 0.2' in text
    assert 'dflash:step_host_gaps_total{model_name="m"} 39.0' in text
    assert 'dflash:step_device_busy_seconds_total{model_name="m"} 1.5' in text
    assert 'dflash:step_device_idle_seconds_total{model_name="m"} 0.5' in text
    assert 'dflash:steps_total{model_name="m"} 40.0' in text
    before = bench_serve._parse_counters(text)
    stats = EngineStats(step_busy_seconds=3.5, step_idle_seconds=1.0, num_steps=60,
                        step_host_seconds={"commit": 0.12, "stage": 0.3}, step_host_gaps=59,
                        step_host_overlapped_seconds=0.04)
    after = bench_serve._parse_counters(ServerMetrics("m", lambda: stats).render().decode())
    idle = bench_serve._step_idle(before, after)
    # 20 steps: 100 ms busy and 25 ms idle each; idle is 20% of step time.
    assert idle["steps"] == 20
    assert idle["busy_ms_per_step"] == pytest.approx(100.0) and idle["idle_ms_per_step"] == pytest.approx(25.0)
    assert idle["idle_pct"] == pytest.approx(20.0)
    # 20 gaps: 1 ms of commit and 5 ms of staging each.
    assert idle["host_ms_per_gap"] == pytest.approx({"commit": 1.0, "stage": 5.0})
    assert idle["host_overlapped_ms_per_step"] == pytest.approx(2.0)
    # No step in the rung, or a server without the counters (vLLM): no numbers, not zeros.
    assert bench_serve._step_idle(after, after)["idle_ms_per_step"] is None
    other = {k: v for k, v in after.items() if not k.startswith("dflash:")}
    assert bench_serve._step_idle(other, other) == {"steps": None, "idle_ms_per_step": None,
                                                    "busy_ms_per_step": None, "idle_pct": None}
    assert bench_serve._step_idle(None, after)["idle_pct"] is None


def test_bench_reports_gpu_idle_per_step_per_rung(spec_on_server, tmp_path, capsys):
    args = add_bench_args(argparse.ArgumentParser()).parse_args([
        "--base-url", spec_on_server.base_url, "--result-dir", str(tmp_path), "--result-filename", "run.json",
        "--disable-tqdm", "--concurrency", "1,2", "--num-prompts", "2", "--random-input-len", "12",
        "--random-output-len", "6"])
    assert bench_serve.main(args) == 0
    rungs = json.loads((tmp_path / "run.json").read_text())["rungs"]
    for rung in rungs:
        assert rung["status"] == "OK" and rung["steps"] >= 2
        assert rung["busy_ms_per_step"] > 0 and rung["idle_ms_per_step"] >= 0
        assert 0 <= rung["idle_pct"] < 100
    table = capsys.readouterr().out
    assert "idle ms/step" in table and "idle %" in table


def test_tagged_steps_add_up_per_tag(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 3.5, 10.0, 10.25, 20.0, 21.0])
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: next(clock))
    t = StepTimer(torch.device("cpu"))
    for tag in [(1, 3), None, (1, 3), (4, 0)]:
        t.begin(tag)
        t.end()
    t.resolve()
    # (busy, steps, idle before them, gaps): the first step of a run has no gap; the gap
    # before a tagged step (3.5 -> 10.0, 10.25 -> 20.0) counts in its tag.
    assert t.take_by_tag(min_steps=2) == {(1, 3): (1.25, 2, 6.5, 1)}  # (4, 0) has one step: it stays
    # A tag outside `measured` (its first measurement) needs one step; one inside, min_steps.
    assert t.take_by_tag(min_steps=2, measured={(4, 0)}) == {}
    assert t.take_by_tag(min_steps=2, measured={(1, 3)}) == {(4, 0): (1.0, 1, 9.75, 1)}
    assert t.take_by_tag() == {}
    assert t.totals()[0] == 1.0 + 0.5 + 0.25 + 1.0
