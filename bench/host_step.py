"""Host time of an engine step with the device taken out (issue 22, item 4).

Usage: python bench/host_step.py [--c 32] [--k 15] [--steps 100] [--profile]

The embedded SmolLM2 engine (its tokenizer, vocabulary and shipped draft) on the CPU, with the
runner's `launch` replaced by a stub that returns at once: random acceptance (0..K drafts) and
random sampled tokens for the plan, as a GPU step's one device-to-host copy would. What is left
of `LLMEngine.step()` is the host's share of a step: the core's schedule and commit, the
per-row sampling arrays, the plan crossing into Python, turning committed tokens into outputs
(detokenisation included: every request streams, as the server's do, with delta outputs
unless `--output-kind cumulative`). c requests decode
without end (ignore_eos, long max_tokens); the timed steps are pure decode steps.

Prints the mean wall time per step and the share of each part (the parts are timed by
wrapping them; `--profile` adds cProfile's top functions). On the H200 host the same code
runs faster than on this 2-core machine: compare before / after here, on one machine.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--c", type=int, default=32)
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--steps", type=int, default=100, help="timed steps (at K = 15 ~8 tokens each: 2k context)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="the page tables' width in the graph runner's buffers (the server's default: 8192)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--output-kind", choices=["delta", "cumulative"], default="delta",
                    help="each output's completion: its news (the server's way) or the whole history so far")
    ap.add_argument("--max-tokens", type=int, default=0,
                    help="each request finishes after this many tokens and a new one takes its seat (the "
                         "serving ladder's churn: arrivals bring prefill steps and new batches); 0: decode "
                         "without end")
    ap.add_argument("--no-overlap", action="store_true", help="the synchronous step")
    ap.add_argument("--graph-runner", nargs=2, metavar=("TARGET_DIR", "DRAFT_DIR"), default=None,
                    help="keep the runner's launch (the graph runner's packing of the plan into its pinned "
                         "buffers, the bucket choice, the step timer) and stub only the device work, on a small "
                         "checkpoint (e.g. `python -m dflash_engine.random_checkpoint --shape tiny T --draft D`) "
                         "with the kernel path on the CPU; prints the host path's phases (worker/host_path.py)")
    args = ap.parse_args(argv)
    if args.graph_runner:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ["DFLASH_KERNELS_ON_CPU"] = "1"  # graph runners exist only on the kernel path

    from dflash_engine import RequestOutputKind, SamplingParams
    from dflash_engine.config import EngineConfig
    from dflash_engine.engine import LLMEngine
    from dflash_engine.worker.in_flight import InFlight

    spec = {"method": "dflash", "num_speculative_tokens": args.k, "draft_length": "fixed"} if args.k else "none"
    model = "default"
    if args.graph_runner:
        model = args.graph_runner[0]
        if args.k:
            spec["model"] = args.graph_runner[1]
    max_len = args.max_model_len  # a pool that holds every request whole: no preemption in the timed steps
    engine = LLMEngine(EngineConfig(model=model, speculative_config=spec, max_num_seqs=args.c,
                                    max_model_len=max_len, device="cpu", dtype="float32",
                                    num_gpu_blocks_override=args.c * (max_len // 16 + 2)))
    engine.overlap = not args.no_overlap
    runner = engine.runner
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size

    def launch(plan, st, all_greedy):
        accepted = np.minimum(rng.integers(0, args.k + 1, len(plan)), plan.num_drafts).astype(np.int64)
        sampled = rng.integers(100, vocab - 100, len(plan.sample_rows)).astype(np.int64)
        return InFlight(lambda: (accepted, sampled), runner.device)

    if args.graph_runner:  # the device work alone is stubbed: random results in the runner's output buffers
        import torch

        from dflash_engine.worker.graph_runner import GraphRunner

        def device_step(self, bs, all_greedy, p=0):
            ns = self._shape(bs, p)[2]
            self.out[:ns] = torch.from_numpy(rng.integers(100, vocab - 100, ns))
            self.out[ns:ns + bs] = torch.from_numpy(rng.integers(0, self.b, bs))

        GraphRunner.step = device_step
        runner._launch_eager = launch  # prefill-only steps: no device work either
    else:
        runner.launch = launch
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens or max_len - args.prompt_len - 64, ignore_eos=True,
                            output_kind=RequestOutputKind[args.output_kind.upper()])
    serial = iter(range(10**9))

    def add(n):
        for _ in range(n):
            engine.add_request(f"r{next(serial)}", rng.integers(100, vocab - 100, args.prompt_len).tolist(), params)

    def step():
        outs = engine.step()
        if args.max_tokens:  # a finished request's seat goes to a new one, as a client at concurrency c does
            add(sum(o.finished for o in outs))
        return outs

    add(args.c)
    while engine.scheduler.num_running < args.c or engine.scheduler.num_waiting:
        step()
    for _ in range(20):  # past the prefill steps' pending outputs
        step()
    engine.runner.step_timer.host.reset()

    # Time the parts by wrapping them (each wrapper adds ~0.3 us).
    parts: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                parts[name] += time.perf_counter() - t0
        return wrapper

    sched = engine.scheduler
    engine._sampling_arrays = timed("sampling arrays", engine._sampling_arrays)
    engine._process = timed("outputs (_process)", engine._process)
    engine._record_spec = timed("spec stats", engine._record_spec)
    runner.launch = timed("launch" if args.graph_runner else "launch (stub)", runner.launch)
    runner.wait = timed("wait (unpack)", runner.wait)
    # The critical path: from a step's results being back (wait returns) to the next launch.
    gap = {"last": None, "sum": 0.0, "n": 0}
    launch_inner, wait_inner = runner.launch, runner.wait

    def launch_gap(*a):
        if gap["last"] is not None:
            gap["sum"] += time.perf_counter() - gap["last"]
            gap["n"] += 1
        return launch_inner(*a)

    def wait_gap(*a):
        out = wait_inner(*a)
        gap["last"] = time.perf_counter()
        return out

    runner.launch, runner.wait = launch_gap, wait_gap
    raw_schedule, raw_commit = sched.schedule, sched.commit

    class Core:  # the core object's methods cannot be reassigned: proxy the two timed ones
        def __getattr__(self, name):
            return getattr(sched, name)

    core = Core()
    core.schedule = timed("core schedule", raw_schedule)
    core.commit = timed("core commit", raw_commit)
    engine.scheduler = core

    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    n_out = 0
    first = next(serial)
    for _ in range(args.steps):
        n_out += len(step())
    if prof:
        prof.disable()
    wall = time.perf_counter() - t0
    per = wall / args.steps
    print(f"c={args.c} K={args.k} overlap={engine.overlap}: {per * 1e6:.0f} us per step "
          f"({args.steps} steps, {n_out / args.steps:.1f} outputs a step"
          + (f", {next(serial) - first - 1} arrivals)" if args.max_tokens else ")"))
    for name, sec in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<22} {sec / args.steps * 1e6:8.1f} us  {100 * sec / wall:5.1f}%")
    if gap["n"]:
        print(f"  critical path (results back -> next launch): {gap['sum'] / gap['n'] * 1e6:.1f} us")
    host = engine.runner.step_timer.host
    if host.gaps:
        print("  host path by phase (us per gap): " + ", ".join(
            f"{k} {v / host.gaps * 1e6:.1f}" for k, v in host.totals().items())
            + f"; total {sum(host.totals().values()) / host.gaps * 1e6:.1f}")
    rest = wall - sum(parts.values())
    print(f"  {'rest (step body)':<22} {rest / args.steps * 1e6:8.1f} us  {100 * rest / wall:5.1f}%")
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
