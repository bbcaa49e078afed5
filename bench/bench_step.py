"""Step time of the GPU decode step beside its floor (issue: the fast GPU step).

    python bench/bench_step.py --target QWEN3_8B_DIR --draft DRAFT_DIR \
        [--context 1024] [--concurrency 1,2,4,8,16,32] [--steps 30] [--json OUT.json]

In one run: the ceilings (device copy GB/s, bf16 GEMM TFLOP/s, bench/ceilings.py), then for
spec-off decode (B = 1) and draft+verify (B = 16: 15 draft tokens), at each concurrency c:
c requests with `--context`-token random prompts are prefilled, then
  - step (graph): CUDA events around replays of the captured decode graph of that bucket;
  - draft / verify: the same, for graphs of the draft pass alone and the verify pass alone
    (verify = target pass + draft-context write + logits); rest = step - draft - verify
    (sampling, acceptance, input unpacking);
  - engine step: wall time of `LLMEngine.step()` (schedule + stage + replay + commit + outputs);
  - floor: max(weight + KV bytes / copy rate, FLOPs / GEMM rate) of that step.
Random weights accept no drafts, so contexts grow by one token per step (timing is unaffected).
On a machine without a GPU it runs the same flow eagerly (perf_counter), as a smoke test.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ceilings  # noqa: E402

from dflash_engine import SamplingParams, _core  # noqa: E402
from dflash_engine.config import EngineConfig  # noqa: E402
from dflash_engine.engine import LLMEngine  # noqa: E402
from dflash_engine.worker import step  # noqa: E402


def _timer(device: torch.device, fn, repeats: int) -> float:
    """Median ms of `fn()`."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _phase_graph(dg, bs: int, phase: str):
    """A callable that runs one phase of the decode step (captured when on a GPU)."""

    def run():
        if phase == "step":
            dg.step(bs, True)
            return
        x = dg._inputs(bs, 0)
        if phase == "draft":
            step.draft_pass(dg.models, x)
        else:
            step.verify_pass(dg.models, x, x.input_ids)

    if dg.device.type != "cuda":
        return run
    from dflash_engine.kernels import capture_scope

    # As the graph runner captures the bucket (its launch choices for small batches: PDL).
    with torch.inference_mode(), capture_scope.for_bucket(bs, bs * dg.b):
        stream = torch.cuda.Stream(dg.device)
        stream.wait_stream(torch.cuda.current_stream(dg.device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(dg.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=dg.pool):
            run()
    return g.replay


def _ab_step(attr: str, dg, bs: int, device: torch.device, steps: int) -> dict:
    """The whole step's graph captured with module attribute `attr` ("pkg.module.NAME") True and
    False, timed in alternation (two rounds; the faster median of each): a switch's effect
    on the same engine, bucket and contexts. -> {"ab_on_ms", "ab_off_ms"}."""
    import importlib

    module_name, name = attr.rsplit(".", 1)
    module = importlib.import_module(module_name)
    was = getattr(module, name)
    best = {True: float("inf"), False: float("inf")}
    try:
        for _ in range(2):
            for value in (True, False):
                setattr(module, name, value)
                best[value] = min(best[value], _timer(device, _phase_graph(dg, bs, "step"), steps))
    finally:
        setattr(module, name, was)
    return {"on_ms": best[True], "off_ms": best[False]}


def _prefill(engine: LLMEngine, c: int, context: int, rng: np.random.Generator, max_tokens: int) -> None:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"bench-{c}-{i}" for i in range(c)]
    for rid in ids:
        engine.add_request(rid, rng.integers(100, min(vocab, 100_000), size=context).tolist(), params)
    while True:
        engine.step()
        states = [engine._requests[engine.scheduler.handle_of(r)] for r in ids]
        if all(s.token_ids for s in states):
            return


def run_mode(args, spec: dict | None, copy_gbs: float, tflops: float, device: torch.device) -> list[dict]:
    conc = [int(c) for c in args.concurrency.split(",")]
    max_c = max(conc)
    b = (spec or {}).get("num_speculative_tokens", 0) + 1
    max_len = args.context + args.steps * 4 + 64
    pages = max_c * _core.pages_per_seq(max_len, max(b, 16), 16) + 16  # reserve rows: max(B, D <= 16)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=args.target, speculative_config=spec, max_num_seqs=max_c, max_model_len=max_len,
        num_gpu_blocks_override=pages, dtype=args.dtype, device=args.device,
        max_num_batched_tokens=max(8192, b * max_c), tensor_parallel_size=args.tensor_parallel_size,
        tune_gemms=args.tune_gemms,
    ))
    dg = engine.runner.graphs.get(b)
    print(f"# {'spec on' if spec else 'spec off'}: engine ready in {time.perf_counter() - t0:.1f} s; "
          f"graphs {len(dg.graphs) if dg else 0}, capture {dg.capture_seconds if dg else 0:.1f} s, "
          f"graph memory {(dg.graph_bytes if dg else 0) / 2**20:.0f} MiB", flush=True)
    picks = sorted(engine.runner.gemm_picks.items(), key=lambda kv: (kv[0].m, kv[0].n, kv[0].k))
    print("# few-row GEMMs (N x K @ M: the tuned pick): "
          + (", ".join(f"{k.n}x{k.k}@{k.m} {c.label() if c else 'cuBLAS'}" for k, c in picks) or "none tuned"),
          flush=True)
    target_cfg = json.loads((Path(args.target) / "config.json").read_text())
    draft_cfg = json.loads((Path(spec["model"]) / "config.json").read_text()) if spec else None
    rng = np.random.default_rng(0)
    rows = []
    for c in conc:
        _prefill(engine, c, args.context, rng, max_tokens=args.steps * 3 + 32)
        # engine steps: host included
        t = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            t.append((time.perf_counter() - t0) * 1e3)
        engine_ms = statistics.median(t)
        mode = "decode" if not spec else f"draft+verify, vocab {spec['draft_vocab_size']}" if spec.get(
            "draft_vocab_size") else "draft+verify"
        row = {"mode": mode, "c": c, "B": b, "engine_step_ms": engine_ms}
        if dg is not None:
            bs = dg.bucket(c)
            if dg.device.type == "cuda" and not dg.enforce_eager:
                step_fn = dg.graphs[(bs, 0, True)].replay
            else:
                def step_fn():
                    dg.step(bs, True)
            row["step_ms"] = _timer(device, step_fn, args.steps)
            row["verify_ms"] = _timer(device, _phase_graph(dg, bs, "verify"), args.steps)
            row["draft_ms"] = _timer(device, _phase_graph(dg, bs, "draft"), args.steps) if spec else 0.0
            row["rest_ms"] = row["step_ms"] - row["verify_ms"] - row["draft_ms"]
            for attr in args.ab.split(",") if args.ab else []:
                row[f"ab:{attr}"] = _ab_step(attr, dg, bs, device, args.steps)
        fl = ceilings.step_floor(target_cfg, draft_cfg, batch_size=c, context_len=args.context, rows_per_request=b,
                                 draft_pass=spec is not None, copy_gbs=copy_gbs, gemm_tflops=tflops,
                                 draft_vocab=(spec or {}).get("draft_vocab_size"))
        row.update(floor_ms=fl.floor_ms, floor_bound=fl.bound)
        rows.append(row)
        print(json.dumps(row), flush=True)
        for rid in [f"bench-{c}-{i}" for i in range(c)]:
            engine.abort_request(rid)
    engine = dg = None  # free the engine before the next mode
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--num-speculative-tokens", type=int, default=15)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="ranks (tensor parallelism: eager steps, no graph-step timing)")
    ap.add_argument("--modes", default="off,on",
                    help="off (decode), on (draft + verify), vocab (draft + verify with --draft-vocab-size)")
    ap.add_argument("--draft-vocab-size", type=int, default=32768,
                    help="the vocab mode's draft vocabulary (the draft's draft_vocab.json: `dflash-engine draft-vocab "
                         "TARGET --source stdlib-text --out DRAFT`)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tune-gemms", action="store_true",
                    help="the engine's few-row GEMM tuning (ops/gemm_tuning.py); with --ab "
                         "dflash_engine.ops.dispatch.SKINNY_GEMM it times the step with and without its picks")
    ap.add_argument("--ab", default=None, metavar="MODULE.ATTR[,MODULE.ATTR]",
                    help="also time the step graph with each of these boolean module attributes True and "
                         "False (e.g. dflash_engine.ops.dispatch.HALF_LOGITS)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    copy_gbs = ceilings.copy_bandwidth_gbs(device)
    tflops = ceilings.gemm_tflops(device)
    print(f"# ceilings on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (smoke run)'}: "
          f"copy {copy_gbs:,.1f} GB/s, bf16 GEMM {tflops:,.1f} TFLOP/s", flush=True)
    rows = []
    spec = {"method": "dflash", "model": args.draft, "num_speculative_tokens": args.num_speculative_tokens}
    for mode in args.modes.split(","):
        if mode not in ("on", "off", "vocab"):
            ap.error(f"--modes: unknown mode {mode!r} (on, off, vocab)")
        m = None if mode == "off" else spec if mode == "on" else {**spec, "draft_vocab_size": args.draft_vocab_size}
        rows += run_mode(args, m, copy_gbs, tflops, device)
    print("\n| mode | c | step (graph) ms | draft ms | verify ms | rest ms | floor ms | step/floor | engine step ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        s = r.get("step_ms", float("nan"))
        print(f"| {r['mode']} | {r['c']} | {s:.2f} | {r.get('draft_ms', 0):.2f} | {r.get('verify_ms', 0):.2f} | "
              f"{r.get('rest_ms', 0):.2f} | {r['floor_ms']:.2f} ({r['floor_bound']}) | {s / r['floor_ms']:.2f}x | "
              f"{r['engine_step_ms']:.2f} |")
    for attr in args.ab.split(",") if args.ab else []:
        print(f"\n| mode | c | step ms, {attr} = True | = False | True / False |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            if f"ab:{attr}" in r:
                ab = r[f"ab:{attr}"]
                print(f"| {r['mode']} | {r['c']} | {ab['on_ms']:.3f} | {ab['off_ms']:.3f} | "
                      f"{ab['on_ms'] / ab['off_ms']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbs": copy_gbs, "gemm_tflops": tflops, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
