"""cuBLAS's default choice against PyTorch TunableOp's pick (torch.cuda.tunable: every cuBLAS /
cuBLASLt solution timed per shape) for the Qwen3-8B projections at few rows (issue 22, item 1:
qkv / o_proj read their weights at 71-75% of the copy rate at c = 1, with split-K reduces):

    python bench/bench_gemm_tunable.py [--rows 16,32,512] [--json out.json]

Each GEMM is timed as in bench/bench_skinny_gemm.py (a CUDA graph over enough weight copies
that every read comes from HBM). Tuning runs with a rotating buffer (cold caches), before any
capture; the chosen solution of each shape is printed. Needs a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from bench_skinny_gemm import SHAPES_8B  # noqa: E402
from ceilings import copy_bandwidth_gbs  # noqa: E402

from dflash_engine.ops.gemm_tuning import time_graph_us  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,512")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 1
    dev, dtype = torch.device("cuda"), torch.bfloat16
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"{torch.cuda.get_device_name()}; copy {copy_gbs:,.0f} GB/s; torch {torch.__version__}")
    tun = torch.cuda.tunable
    tun.set_filename("/tmp/tunableop_results.csv")
    tun.set_rotating_buffer_size(256)
    tun.set_max_tuning_duration(200)
    if hasattr(tun, "set_cublaslt_requested_algo_count"):  # (newer torch) more cuBLASLt candidates
        tun.set_cublaslt_requested_algo_count(64)
    rows_out = []
    for name, n, k, per_step in SHAPES_8B:
        wbytes = n * k * 2
        copies = max(2, math.ceil(512 * 2**20 / wbytes))
        ws = [torch.randn(n, k, device=dev).to(dtype) * 0.02 for _ in range(copies)]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev).to(dtype)
            ref = F.linear(x, ws[0]).float()
            tun.enable(False)
            base = time_graph_us(lambda i: F.linear(x, ws[i]), copies, dev)
            tun.enable(True)
            tun.tuning_enable(True)
            got = F.linear(x, ws[0]).float()  # tunes this shape
            tun.tuning_enable(False)
            err = ((got - ref).norm() / ref.norm()).item()
            tuned = time_graph_us(lambda i: F.linear(x, ws[i]), copies, dev)
            tun.enable(False)
            r = dict(shape=name, n=n, k=k, rows=m, per_step=per_step, default_us=base, tuned_us=tuned, rel_err=err,
                     default_of_copy=wbytes / base / 1e3 / copy_gbs, tuned_of_copy=wbytes / tuned / 1e3 / copy_gbs)
            rows_out.append(r)
            print(f"{name:8s} M={m:4d}: default {base:8.1f} us ({r['default_of_copy']:.0%} of copy)  "
                  f"tuned {tuned:8.1f} us ({r['tuned_of_copy']:.0%})  x{base / tuned:.3f}  err {err:.1e}", flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    for m in sorted({r["rows"] for r in rows_out}):
        rs = [r for r in rows_out if r["rows"] == m]
        d = sum(r["default_us"] * r["per_step"] for r in rs)
        t = sum(min(r["default_us"], r["tuned_us"]) * r["per_step"] for r in rs)
        print(f"M={m}: one 8B step's GEMMs {d:.0f} us default, {t:.0f} us with the faster per shape")
    print("chosen:", *tun.get_results(), sep="\n  ")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows_out,
                           chosen=[list(map(str, r)) for r in tun.get_results()]), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
