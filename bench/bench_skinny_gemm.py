"""The skinny GEMM (kernels/skinny_gemm.py) against cuBLAS at the Qwen3-8B projections' shapes
for few rows (issue 22, item 1):

    python bench/bench_skinny_gemm.py [--rows 1,16,32,64] [--json out.json] [--budget-s 300]

For each (weight shape, rows) it times `F.linear` (cuBLAS) and a sweep of SkinnyConfig
(tiles, split of K, operand order, pipeline stages), each inside a CUDA graph over enough
copies of the weight that none is still in L2 when it is read again (what a decode step
sees: each weight read once per step), and reports microseconds per call, the weight read
rate in GB/s and its share of the device-to-device copy rate (bench/ceilings.py, read +
written bytes). The last table sums one Qwen3-8B step's GEMMs (36 layers + lm_head) per row
count: cuBLAS against the best configuration of each shape. On a machine without a GPU it runs
a smoke sweep on tiny shapes under the interpreter (numbers meaningless).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
from ceilings import copy_bandwidth_gbs  # noqa: E402

from dflash_engine.ops.gemm_tuning import time_graph_us  # noqa: E402

# (name, N, K, per step): Qwen3-8B (hidden 4096, 32 q / 8 kv heads of 128, intermediate 12288).
SHAPES_8B = [("qkv", 6144, 4096, 36), ("o", 4096, 4096, 36), ("gate_up", 24576, 4096, 36),
             ("down", 4096, 12288, 36), ("lm_head", 151936, 4096, 1)]
SHAPES_SMOKE = [("tiny_a", 96, 64, 2), ("tiny_b", 64, 160, 2)]


def configs(gpu: bool):
    """The engine's tuning candidates first (ops/gemm_tuning.py), then the same at 8 warps
    (at M = 64 every 4-warp candidate spills registers: docs/perf.md "Run 50"), then a wider
    sweep at 4 and 8 warps."""
    from dflash_engine.kernels.skinny_gemm import SkinnyConfig
    from dflash_engine.ops.gemm_tuning import CANDIDATES

    if not gpu:
        return [SkinnyConfig(block_n=32, block_k=32, split_k=s, swap_ab=t, fold_reduce=f)
                for s, t, f in itertools.product((1, 2), (True, False), (False, True)) if s > 1 or not f]
    out = list(CANDIDATES)
    out += [w8 for c in CANDIDATES if (w8 := dataclasses.replace(c, num_warps=8)) not in out]
    for bn, bk, split, warps in itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (4, 8)):
        stages = 4 if bn * bk <= 128 * 128 else 3  # (a 128 x 256 tile's 4 stages overflow shared memory)
        for fold in ((False, True) if split > 1 else (False,)):
            cfg = SkinnyConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages,
                               fold_reduce=fold)
            if cfg not in out:
                out.append(cfg)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64")
    ap.add_argument("--shapes", default=None, help="comma list of shape names (default: all)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop sweeping configs past this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    from dflash_engine.kernels.skinny_gemm import skinny_matmul

    dev = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    shapes = SHAPES_8B if gpu else SHAPES_SMOKE
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    copy_gbs = copy_bandwidth_gbs(dev)
    print(f"device {torch.cuda.get_device_name() if gpu else 'cpu (smoke)'}; copy {copy_gbs:,.0f} GB/s (read + written)")
    t_start = time.perf_counter()
    results = []
    for name, n, k, per_step in shapes:
        wbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, math.ceil(512 * 2**20 / wbytes)) if gpu else 2
        ws = [torch.randn(n, k, device=dev).to(dtype) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev).to(dtype)
            ref = F.linear(x, ws[0])
            row = {"shape": name, "n": n, "k": k, "rows": m, "per_step": per_step, "weight_mb": wbytes / 2**20}
            us = time_graph_us(lambda i: F.linear(x, ws[i]), copies, dev)
            row["cublas_us"] = us
            row["cublas_gbs"] = wbytes / us / 1e3
            best = None
            tried = []
            for cfg in configs(gpu):
                if time.perf_counter() - t_start > args.budget_s:
                    row["budget_hit"] = True
                    break
                try:
                    got = skinny_matmul(x, ws[0], None, cfg)
                    err = (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
                    if err > (2e-2 if gpu else 1e-4):
                        tried.append({"cfg": cfg.label(), "error": f"rel err {err:.3g}"})
                        continue
                    us = time_graph_us(lambda i, cfg=cfg: skinny_matmul(x, ws[i], None, cfg), copies, dev)
                except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: record, go on)
                    tried.append({"cfg": cfg.label(), "error": f"{type(e).__name__}: {str(e)[:120]}"})
                    continue
                tried.append({"cfg": cfg.label(), "us": round(us, 2)})
                if best is None or us < best[1]:
                    best = (cfg.label(), us)
            if best:
                row.update(best_cfg=best[0], best_us=best[1], best_gbs=wbytes / best[1] / 1e3,
                           speedup=row["cublas_us"] / best[1])
            row["cublas_of_copy"] = row["cublas_gbs"] / copy_gbs
            row["best_of_copy"] = row.get("best_gbs", 0.0) / copy_gbs
            row["tried"] = tried
            results.append(row)
            print(f"{name:8s} N={n:6d} K={k:5d} M={m:3d}: cuBLAS {row['cublas_us']:8.1f} us "
                  f"({row['cublas_gbs']:6.0f} GB/s, {row['cublas_of_copy']:.0%} of copy); "
                  + (f"skinny {best[1]:8.1f} us ({row['best_gbs']:6.0f} GB/s, {row['best_of_copy']:.0%}) "
                     f"{best[0]} x{row['speedup']:.2f}" if best else "skinny: none ran"), flush=True)
        ws.clear()
        if gpu:
            torch.cuda.empty_cache()
    print("\nOne Qwen3-8B step's GEMMs (36 layers + lm_head), us: cuBLAS / best skinny per shape")
    for m in rows:
        rs = [r for r in results if r["rows"] == m]
        cub = sum(r["cublas_us"] * r["per_step"] for r in rs)
        sk = sum(min(r["cublas_us"], r.get("best_us", math.inf)) * r["per_step"] for r in rs)
        print(f"M={m:3d}: {cub:9.0f} / {sk:9.0f} (x{cub / sk:.3f} with the faster of the two per shape)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if gpu else "cpu", "copy_gbs": copy_gbs,
                       "torch": torch.__version__, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
