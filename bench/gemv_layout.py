"""The weight GEMVs of one SmolLM2-135M decode token (30 x qkv/o/gate_up/down + the tied
logits, cold in cache: 540 MB of float32), timed per weight layout and split:

    python bench/gemv_layout.py [--threads 1] [--dtype bfloat16] [--rows 16]

row-major F.linear (the checkpoint layout), column-major F.linear (what the fast CPU mode
stores), and column-major split along the input dimension into one slab per thread
(`fast_linear`, one bmm + sums). Prints ms per token, GB/s and the token rate it allows.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=1, help="rows per GEMM (1: a decode token; K+1: a verify block)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    from dflash_engine.cpu import fast_linear

    rows = [torch.randn(s, dtype=dtype) for s in SHAPES]
    cols = [w.t().contiguous().t() for w in rows]
    gb = sum(w.numel() * w.element_size() for w in rows) / 1e9
    xs = {576: torch.randn(args.rows, 576, dtype=dtype), 1536: torch.randn(args.rows, 1536, dtype=dtype)}
    runs = {
        "row-major F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in rows],
        "column-major F.linear": lambda: [F.linear(xs[w.shape[1]], w) for w in cols],
        "column-major fast_linear": lambda: [fast_linear(xs[w.shape[1]], w) for w in cols],
    }
    print(f"threads {torch.get_num_threads()}, {args.dtype}, {args.rows} rows, {gb * 1e3:.0f} MB of weights per pass")
    for name, fn in runs.items():
        fn()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn()
        dt = (time.perf_counter() - t) / args.iters
        print(f"{name:28s} {dt * 1e3:7.2f} ms/pass {gb / dt:6.1f} GB/s -> {1 / dt:5.1f} passes/s ceiling")


if __name__ == "__main__":
    main()
