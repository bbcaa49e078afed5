"""The cost model of the adaptive draft-length policy: how long a decode step takes for
each batch bucket and each candidate K, measured on this machine at startup.

GPU: the captured decode graphs themselves are replayed (padding inputs: every GEMM, norm
and sampling kernel runs on the full bucket, attention over no context) and timed with CUDA
events. CPU: eager steps of the core's profile plan (`_core.profile_plan`, bs decoding
requests of B rows over a short context) on a 2-page KV cache, at a few buckets, the rest
interpolated linearly in the batch (a CPU step's cost is close to linear in its rows).

The table goes to the core once (`Scheduler.set_step_costs`); the core combines it with the
acceptance it measures from commits (rust/src/draft_len.rs) to pick each step's K.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .. import _core
from .graph_runner import batch_buckets

_CPU_PROBE_BUCKETS = (1, 4, 16)
_CPU_PROBE_CONTEXT = 256
_GPU_REPS = 10
_CPU_REPS = 3


@dataclass(frozen=True)
class StepCosts:
    buckets: list[int]
    ks: list[int]
    seconds: list[list[float]]  # [bucket][k]

    def summary(self) -> str:
        """One line: the cost per K at the smallest and largest bucket, in ms."""
        def row(i: int) -> str:
            return ", ".join(f"K={k} {self.seconds[i][j] * 1e3:.2f}" for j, k in enumerate(self.ks))
        return (f"decode step cost (ms) at batch {self.buckets[0]}: {row(0)}; "
                f"at batch {self.buckets[-1]}: {row(len(self.buckets) - 1)}")


class LiveCosts:
    """The startup table refined by the engine's own pure-decode steps. Every EVERY steps
    (`refresh`): a (batch bucket, K) cell whose steps ran at least MIN_STEPS times since it
    was last refined (once, for a cell never measured: StepTimer.take_by_tag) takes an
    exponential average of their mean busy time, and of the mean host time the device
    waited before them (`gaps`: their staging and the commit before them, which grow with K:
    on a small model, where the host is much of a step, a device-only table made K = 15 look
    as cheap as K = 7); a cell that never ran is its
    startup value times its bucket's measured / startup ratio over the cells of its kind,
    drafting or plain (the overall ratio of its kind where the bucket ran none: the context and
    the machine's load move every K of a kind alike; `seconds`), plus the window's mean host
    time between steps (a constant per step favours longer blocks: each step's fixed cost buys
    more tokens). So a noisy startup probe is corrected by what the traffic itself costs."""

    # Every 32 steps, and a cell's first measurement from one step: a (bucket, K) cell that
    # only the runner-up probe visits (one step in 32) replaces its startup estimate at the
    # next refresh. With 128 / 4 (before), a CPU engine at batch 32 ran ~130 plain steps of a
    # HumanEval burst on a startup estimate of K = 3 that was 25% high (docs/perf.md, issue 20).
    EVERY = 32
    ALPHA = 0.5
    MIN_STEPS = 4

    def __init__(self, startup: StepCosts):
        self.startup = startup
        self.measured: dict[tuple[int, int], float] = {}  # busy seconds per step
        self.gaps: dict[tuple[int, int], float] = {}  # host seconds the device waited before a step
        self.last = (0.0, 0)  # (idle seconds, steps) of the timer at the last refresh

    def _average(self, into: dict, tag, value: float) -> None:
        old = into.get(tag)
        into[tag] = value if old is None else (1 - self.ALPHA) * old + self.ALPHA * value

    def observe(self, by_tag: dict[tuple[int, int], tuple[float, int, float, int]]) -> None:
        """Fold in measured (busy seconds, steps, idle seconds before them, gaps) per (bucket,
        K) cell (StepTimer.take_by_tag); a cell's gap needs MIN_STEPS gaps."""
        s = self.startup
        for tag, (sec, n, idle, gaps) in by_tag.items():
            if tag[0] in s.buckets and tag[1] in s.ks:
                self._average(self.measured, tag, sec / n)
                if gaps >= self.MIN_STEPS:
                    self._average(self.gaps, tag, idle / gaps)

    def seconds(self, gap: float = 0.0) -> list[list[float]]:
        """The table for the core: [bucket][k] seconds, plus the host time before such a step
        (the cell's measured one, else `gap`: the window's mean).
        An unmeasured cell is scaled by the ratio of measured cells of its own kind: drafting
        cells by drafting cells, the plain (K = 0) cell by plain cells. What makes drafting
        steps cost more live than in the startup probe (the draft pass over a longer context,
        its cold weights) does not touch a plain step: scaled alike, the plain cell looked
        as slow as the drafting ones and the policy drafted where it did not pay (CPU chat)."""
        s = self.startup
        ratio = {(b, k): self.measured[(b, k)] / s.seconds[i][j] for i, b in enumerate(s.buckets)
                 for j, k in enumerate(s.ks) if (b, k) in self.measured}
        out = []
        for i, b in enumerate(s.buckets):
            row = []
            for j, k in enumerate(s.ks):
                kind = [(rb, v) for (rb, rk), v in ratio.items() if (rk > 0) == (k > 0)]
                r = float(np.mean([v for rb, v in kind if rb == b] or [v for _, v in kind] or [1.0]))
                row.append(self.measured.get((b, k), s.seconds[i][j] * r) + self.gaps.get((b, k), gap))
            out.append(row)
        return out

    def refresh(self, timer) -> list[list[float]] | None:
        """Every EVERY steps of `timer` (the runner's StepTimer): the refined table; else None."""
        _, idle, steps = timer.totals()
        if steps - self.last[1] < self.EVERY:
            return None
        gap = (idle - self.last[0]) / (steps - self.last[1])
        self.last = (idle, steps)
        self.observe(timer.take_by_tag(self.MIN_STEPS, measured=self.measured))
        return self.seconds(gap)


def measure(runner, ks: list[int]) -> StepCosts:
    """`runner`: the ModelRunner, set up (pool allocated, graphs captured)."""
    rc = runner.rc
    buckets = batch_buckets(rc.max_num_seqs)
    if runner.graphs and all(not g.enforce_eager for g in runner.graphs.values()):
        seconds = [[_time_graph(runner.graphs[k + 1], bs) for k in ks] for bs in buckets]
    elif runner.graphs and rc.device.type == "cpu":
        # The kernels under Triton's interpreter (a test mode): timing would measure the
        # interpreter. Rows run stand in for time: bs * (B + D) per step, plus one.
        seconds = [[1e-3 * (1 + bs * (k + 1 + rc.draft_rows_for(k + 1))) for k in ks] for bs in buckets]
    else:
        probe = sorted({b for b in _CPU_PROBE_BUCKETS if b < buckets[-1]} | {buckets[-1]})
        measured = np.array([[_time_eager(runner, bs, k) for k in ks] for bs in probe])
        seconds = [[float(np.interp(bs, probe, measured[:, j])) for j in range(len(ks))] for bs in buckets]
    return StepCosts(buckets=buckets, ks=list(ks), seconds=seconds)


@torch.inference_mode()
def _time_graph(g, bs: int) -> float:
    key = (bs, 0, True)
    if key not in g.graphs:
        g.reset_inputs()
        g._capture_one(bs, 0, True)
    g.reset_inputs()
    graph = g.graphs[key]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(_GPU_REPS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / _GPU_REPS


def _time_eager(runner, bs: int, k: int) -> float:
    rc = runner.rc
    b = k + 1
    ctx = max(min(rc.max_model_len, _CPU_PROBE_CONTEXT), b + rc.draft_rows)
    plan = _core.profile_plan(bs * b, bs + 1, b, rc.draft_rows_for(b), rc.reserve_rows, ctx, rc.page_size,
                              rc.mask_token_id, rc.hybrid)
    n = len(plan.sample_rows)
    st = {"greedy": np.ones(n, np.bool_), "temperature": np.ones(n, np.float32),
          "top_k": np.full(n, rc.model_config.vocab_size, np.int64), "top_p": np.ones(n, np.float32),
          "min_p": np.zeros(n, np.float32), "seed": np.zeros(n, np.int64),
          "position": plan.positions[plan.sample_rows] + 1}
    real_kv, runner.models.kv = runner.models.kv, runner._allocate(2)
    try:
        best = float("inf")
        for _ in range(_CPU_REPS):
            t0 = time.perf_counter()
            runner._launch_eager(plan, st, True).wait()
            best = min(best, time.perf_counter() - t0)
    finally:
        runner.models.kv = real_kv
    return best
