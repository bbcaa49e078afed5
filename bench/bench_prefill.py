"""Time of one prompt's prefill, alone or beside decoding requests, against the GEMM rate
(issue 22: the ladder's prefills).

    python bench/bench_prefill.py --target QWEN3_8B_DIR [--draft DRAFT_DIR] [--lengths 1024,2048]
                                  [--beside 0,7] [--modes off,on] [--k 15] [--repeats 5] [--profile]
                                  [--top 20] [--json OUT.json]

In the 8B ladder every request's 1,024-token prompt is prefilled in a step of its own at c = 1
(TTFT 39-42 ms on an H100, run 51) or, at c >= 2, in 512-token chunks inside mixed steps beside
the running requests' decode rows. The prefill is FLOP-bound, so its floor is its FLOPs at the
measured bf16 GEMM rate (bench/ceilings.py); at 512 output tokens a request, its prefills are
~6% of the GPU's time at c = 1 and more at c = 4-16, where every arrival's prefill compute is
paid whatever it rides with.

For each mode (off: target only; on: target + the draft-context write of every prompt row's
taps, step.verify_pass; a step of prompt rows alone runs no draft block, the request's first
one runs in its next step), each N of --beside and each prompt length L: N requests with
L-token prompts decode (max_tokens large, ignore_eos), then one request with an L-token random
prompt and max_tokens = 1 is added and the engine is stepped until it finishes, with the
host/device overlap off so that each `step()` is one whole step. Median of --repeats after one
warm-up. N = 0: the prefill alone, its wall time. N > 0: its marginal time, the steps it took
minus as many pure decode steps of the same batch (timed just before). Reported: ms, prompt
tokens/s, the target's FLOPs (2 x every layer matmul weight per prompt row, causal attention
2 x 2 x heads x head_dim per (row, key) pair, the logits of one row) over that time as
TFLOP/s, and its share of the GEMM rate (a marginal can pass 100%: the decode rows' weight
reads, paid anyway, serve the prompt's rows too). The engine has CUDA graphs (the served engine's
decode and mixed steps; a step of prompt rows alone runs eagerly there too) and the default
token budget (so the chunks are the served ones). --profile adds a torch.profiler table of the
prompt's steps per (mode, N, L), summed per kernel name.
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
from profile_step import kernel_totals, step_until_started  # noqa: E402

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


def decode_step_ms(engine: LLMEngine, device: torch.device, steps: int = 5) -> float:
    """Median wall ms of a pure decode step of the running batch."""
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def start_decoders(engine: LLMEngine, prompts: list[list[int]], tag: str, model_len: int) -> list[str]:
    """Requests that decode for the rest of the run (to `model_len`), stepped until every one has its first token."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=model_len - len(p), ignore_eos=True))
    step_until_started(engine, ids, limit=256)
    return ids


def marginal_ms(engine: LLMEngine, prompt: list[int], rid: str, device: torch.device) -> tuple[float, int]:
    """The prompt's prefill beside the running requests: its steps' time minus as many decode steps."""
    dec = decode_step_ms(engine, device)
    ms, steps = prefill_ms(engine, prompt, rid, device)
    return ms - steps * dec, steps


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
    ap.add_argument("--beside", default="0", help="decoding requests beside the prompt (0: the prefill alone)")
    ap.add_argument("--modes", default="off,on", help="off (target only), on (target + draft)")
    ap.add_argument("--k", type=int, default=15, help="mode on's draft tokens (num_speculative_tokens)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    beside = [int(x) for x in args.beside.split(",")]
    modes = args.modes.split(",")
    if "on" in modes and not args.draft:
        ap.error("mode on needs --draft")
    if any(m not in ("on", "off") for m in modes):
        ap.error(f"--modes takes off and on, got {args.modes!r}")
    if min(beside) < 0 or min(lengths) < 1 or args.repeats < 1:
        ap.error("--beside must be >= 0, --lengths and --repeats >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    gemm = ceilings.gemm_tflops(device) if device.type == "cuda" else None
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (smoke run)'}; "
          f"bf16 GEMM rate {gemm if gemm is None else round(gemm, 1)} TFLOP/s")
    rows = []
    rng = np.random.default_rng(0)

    def prompt(length: int) -> list[int]:
        return rng.integers(100, min(cfg["vocab_size"], 100_000), size=length).tolist()

    model_len = max(lengths) + 64 + (args.k + 1) * 8 * (args.repeats + 4)  # a decoder's growth in one (N, L)
    for mode in modes:
        spec = None if mode == "off" else {"method": "dflash", "model": args.draft, "num_speculative_tokens": args.k}
        engine = LLMEngine(EngineConfig(
            model=args.target, speculative_config=spec, max_num_seqs=max(beside) + 1, max_model_len=model_len,
            dtype="bfloat16" if device.type == "cuda" else "float32"))
        engine.overlap = False  # each step() one whole step
        n = 0
        for nb in beside:
            for length in lengths:
                decoders = start_decoders(engine, [prompt(length) for _ in range(nb)], f"d{n}_", model_len) if nb else []
                timed = prefill_ms if nb == 0 else marginal_ms
                timed(engine, prompt(length), f"w{n}", device)   # warm-up (kernel compiles, allocator)
                n += 1
                times, steps = [], 0
                for _ in range(args.repeats):
                    ms, steps = timed(engine, prompt(length), f"r{n}", device)
                    times.append(ms)
                    n += 1
                ms = statistics.median(times)
                tflops = target_flops(cfg, length) / ms / 1e9 if ms > 0 else float("nan")
                row = dict(mode=mode, beside=nb, length=length, ms=ms, steps=steps, tokens_per_s=length / ms * 1e3,
                           target_tflops=tflops, gemm_share=None if gemm is None else tflops / gemm)
                rows.append(row)
                share = "" if gemm is None else f", {tflops / gemm:.0%} of the GEMM rate"
                what = "alone" if nb == 0 else f"beside {nb} decoding (its steps less as many decode steps)"
                print(f"spec {mode}, L = {length}, {what}: {ms:.2f} ms ({steps} steps; min {min(times):.2f}), "
                      f"{row['tokens_per_s']:,.0f} prompt tok/s, target {tflops:.0f} TFLOP/s{share}")
                if args.profile:
                    print("\n".join(profile_table(engine, prompt(length), f"p{n}", device, args.top)))
                    n += 1
                for rid in decoders:
                    engine.abort_request(rid)
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
