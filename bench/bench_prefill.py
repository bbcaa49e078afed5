"""Time of one prompt's prefill step, against the GEMM rate (issue 22: the ladder's prefills).

    python bench/bench_prefill.py --target QWEN3_8B_DIR [--draft DRAFT_DIR] [--lengths 1024,2048]
                                  [--modes off,on] [--k 15] [--repeats 5] [--profile] [--top 20] [--json OUT.json]

In the 8B ladder every request's 1,024-token prompt is prefilled in a step of its own at c = 1
(TTFT 39-42 ms on an H100, run 51) or inside a mixed step; at 512 output tokens and ~79
draft+verify steps a request, that prefill is ~6% of a c = 1 request's time and a larger share
as c grows, where each arrival's prefill compute is paid whatever it rides with. The prefill is
FLOP-bound, so its floor is its FLOPs at the measured bf16 GEMM rate (bench/ceilings.py).

For each mode (off: target only; on: target + the draft-context write of every prompt row's
taps, step.verify_pass; a step of prompt rows alone runs no draft block, the request's first
one runs in its next step) and prompt length L, one request with an L-token random prompt and max_tokens = 1 is
added to an idle engine and `LLMEngine.step()` is timed until it finishes (a single step when
L <= max_num_batched_tokens, set to the longest L; the overlapped engine returns it from the
next `step()` call), median of --repeats after one warm-up. The engine is built with
enforce_eager: a step of prompt rows alone (no decode rows) runs eagerly in the served engine
too, and the capture would only cost time.
Reported: ms, prompt tokens/s, the target's FLOPs (2 x every layer matmul weight per prompt
row, the lm_head on the last row, causal attention 2 x 2 x heads x head_dim per (row, key)
pair) over the time as TFLOP/s, and its share of the GEMM rate. --profile adds a torch.profiler
table of one prefill step per (mode, L), summed per kernel name.
On a machine without a GPU it runs the same flow on the CPU as a smoke test.
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
from profile_step import kernel_totals  # noqa: E402

from dflash_engine import SamplingParams  # noqa: E402
from dflash_engine.config import EngineConfig  # noqa: E402
from dflash_engine.engine import LLMEngine  # noqa: E402


def target_flops(cfg: dict, length: int) -> float:
    """FLOPs of the target's prefill of `length` rows (matmuls + causal attention, logits of one row)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim") or h // heads
    inter = cfg["intermediate_size"]
    per_row = layers * (h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter)
    attention = layers * 2 * 2 * heads * hd * length * (length + 1) / 2
    return 2.0 * per_row * length + attention + 2.0 * h * cfg["vocab_size"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill_ms(engine: LLMEngine, prompt: list[int], rid: str, device: torch.device) -> tuple[float, int]:
    """Wall ms from add_request to the request's finish (max_tokens = 1), and the steps it took."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params)
    steps = 0
    while True:
        outs = engine.step()
        steps += 1
        if any(o.request_id == rid and o.finished for o in outs):
            break
        if steps > 64:
            raise RuntimeError(f"request {rid} did not finish in 64 steps")
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, steps


def profile_table(engine: LLMEngine, prompt: list[int], rid: str, device: torch.device, top: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        prefill_ms(engine, prompt, rid, device)
    totals, counts = kernel_totals(prof, device=device.type == "cuda")
    total = sum(totals.values())
    lines = [f"kernel time {total / 1e3:.2f} ms", "| kernel | ms | launches | share |", "|---|---:|---:|---:|"]
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{name}` | {t / 1e3:.3f} | {counts[name]} | {t / total:.1%} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None, help="the DFlash draft (needed for mode on)")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--modes", default="off,on", help="off (target only), on (target + draft)")
    ap.add_argument("--k", type=int, default=15, help="mode on's draft tokens (num_speculative_tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = args.modes.split(",")
    if "on" in modes and not args.draft:
        ap.error("mode on needs --draft")
    if any(m not in ("on", "off") for m in modes):
        ap.error(f"--modes takes off and on, got {args.modes!r}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    gemm = ceilings.gemm_tflops(device) if device.type == "cuda" else None
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (smoke run)'}; "
          f"bf16 GEMM rate {gemm if gemm is None else round(gemm, 1)} TFLOP/s")
    rows = []
    rng = np.random.default_rng(0)
    for mode in modes:
        spec = None if mode == "off" else {"method": "dflash", "model": args.draft, "num_speculative_tokens": args.k}
        engine = LLMEngine(EngineConfig(
            model=args.target, speculative_config=spec, max_num_seqs=4, max_model_len=max(lengths) + 64,
            max_num_batched_tokens=max(lengths), enforce_eager=True, dtype="bfloat16" if device.type == "cuda" else "float32"))
        n = 0
        for length in lengths:
            def prompt() -> list[int]:
                return rng.integers(100, min(cfg["vocab_size"], 100_000), size=length).tolist()
            prefill_ms(engine, prompt(), f"w{n}", device)   # warm-up (kernel compiles, allocator)
            n += 1
            times, steps = [], 0
            for _ in range(args.repeats):
                ms, steps = prefill_ms(engine, prompt(), f"r{n}", device)
                times.append(ms)
                n += 1
            ms = statistics.median(times)
            tflops = target_flops(cfg, length) / ms / 1e9
            row = dict(mode=mode, length=length, ms=ms, steps=steps, tokens_per_s=length / ms * 1e3,
                       target_tflops=tflops, gemm_share=None if gemm is None else tflops / gemm)
            rows.append(row)
            share = "" if gemm is None else f", {tflops / gemm:.0%} of the GEMM rate"
            print(f"spec {mode}, L = {length}: {ms:.2f} ms ({steps} step() calls; min {min(times):.2f}), "
                  f"{row['tokens_per_s']:,.0f} prompt tok/s, target {tflops:.0f} TFLOP/s{share}")
            if args.profile:
                print("\n".join(profile_table(engine, prompt(), f"p{n}", device, args.top)))
                n += 1
            sys.stdout.flush()
        engine.close()
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gemm_tflops=gemm, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
