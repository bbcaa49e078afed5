"""Where the time of one decode step goes: torch.profiler over eager decode steps (the same
kernels and shapes the CUDA graph replays), summed per kernel name.

    python bench/profile_step.py --target DIR --draft DIR [--c 1] [--context 1024] [--steps 5] [--graphs [--replay]]
                                 [--pdl auto|on|off]

Also prints the wall time of a step (host included); `--graphs` times the CUDA-graph decode
step instead of eager (the kernel table then shows what the profiler sees of graph replays).

In graphs captured with programmatic dependent launch (kernels/pdl.py: by default the
smallest buckets) a kernel of ours starts before the one ahead of it has finished and waits
inside for it, so its profiled time includes that wait and the table's times overlap (run 50
read a split combine's wait on the attention kernel as 10.6 us of combine; run 51). `--pdl
off` captures without it: kernel times that add up, of a step slightly slower than served.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dflash_engine import SamplingParams
from dflash_engine.config import EngineConfig
from dflash_engine.engine import LLMEngine


def kernel_totals(prof, device: bool = True) -> tuple[dict[str, float], dict[str, int]]:
    """A torch.profiler run's self time (us) and calls per kernel name (the name up to its
    argument list, 70 characters): device time, or with `device=False` (a CPU smoke run) CPU time."""
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for e in prof.key_averages():
        if device:
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
        else:
            t = e.self_cpu_time_total
        if t > 0:
            name = e.key.split("(")[0][:70]
            totals[name] += t
            counts[name] += e.count
    return totals, counts


def step_until_started(engine: LLMEngine, ids: list[str], limit: int = 1024) -> int:
    """Step `engine` until every request of `ids` has its first token (its prompt prefilled);
    -> the steps it took. RuntimeError past `limit` steps."""
    steps = 0
    while not all(engine._requests[engine.scheduler.handle_of(r)].token_ids for r in ids):
        if steps == limit:
            raise RuntimeError(f"the requests did not all start in {limit} steps")
        engine.step()
        steps += 1
    return steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--c", default="1")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (the served step), not eager")
    ap.add_argument("--replay", action="store_true",
                    help="with --graphs: profile the bare graph replay of the batch's bucket (bench_step's step_ms), "
                         "not engine steps (host work, overlap and all)")
    ap.add_argument("--pdl", choices=["auto", "on", "off"], default="auto",
                    help="programmatic dependent launch in the captured graphs: the engine's rule (auto), or "
                         "forced; off gives kernel times without PDL waits folded in")
    args = ap.parse_args(argv)
    from dflash_engine.kernels import pdl
    pdl.PDL = {"auto": None, "on": True, "off": False}[args.pdl]
    spec = {"method": "dflash", "model": args.draft, "num_speculative_tokens": 15}
    for c in [int(x) for x in args.c.split(",")]:
        engine = LLMEngine(EngineConfig(model=args.target, speculative_config=spec, max_num_seqs=c,
                                        max_model_len=args.context + 256, num_gpu_blocks_override=c * 90 + 8,
                                        dtype="bfloat16", enforce_eager=not args.graphs,
                                        max_num_batched_tokens=8192))
        rng = np.random.default_rng(0)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        ids = [f"p{i}" for i in range(c)]
        for rid in ids:
            engine.add_request(rid, rng.integers(100, 100_000, size=args.context).tolist(), params)
        # Until every prompt is prefilled (c = 32 x 1024 tokens takes more than the few warm-up
        # steps this used to run: run 47's and this session's c = 32 tables had prefill chunks
        # inside the profiled steps), then a few pure decode steps.
        prefill_steps = step_until_started(engine, ids)
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        dg = engine.runner.graphs.get(spec["num_speculative_tokens"] + 1)  # the verify block's graph runner
        replay = None
        if args.replay and dg is not None and not dg.enforce_eager:
            # The bare captured step of this batch's bucket: what bench_step times as step_ms.
            replay = dg.graphs[(dg.bucket(c), 0, True)].replay
            replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                replay()
            torch.cuda.synchronize()
            replay_ms = (time.perf_counter() - t0) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                replay() if replay is not None else engine.step()
            torch.cuda.synchronize()
        totals, counts = kernel_totals(prof)
        total = sum(totals.values())
        mode = "graphs" if args.graphs else "eager"
        what = f"graph replays of bucket {dg.bucket(c)} ({replay_ms:.2f} ms each unprofiled)" if replay else mode
        print(f"## c={c}: GPU kernel time per step {total / args.steps / 1e3:.2f} ms, engine step wall {wall:.2f} ms "
              f"(profiled: {what}, {args.steps} steps, after {prefill_steps} prefill steps)")
        if args.graphs and dg is not None and any(key[0] == dg.bucket(c) for key in dg.pdl_graphs):
            print("(captured with PDL: a kernel's time includes its wait for the one before it; --pdl off for "
                  "times that add up)")
        print("| kernel | ms/step | launches/step | share |\n|---|---:|---:|---:|")
        for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"| `{name}` | {t / args.steps / 1e3:.3f} | {counts[name] / args.steps:.0f} | {t / total:.1%} |")
        sys.stdout.flush()
        del engine
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
