"""Registers, spills and pipelining of the hot Triton kernels at the Qwen3-8B step's launch
shapes, compiled for sm_90 on the CPU (no device needed).

    python bench/kernel_regs.py                   # the local Triton
    PYTHONPATH=/tmp/tr36 python bench/kernel_regs.py   # the device's (3.6 with torch 2.11):
                                                  # pip install --no-deps --target /tmp/tr36 triton==3.6.0

Each row: the kernel and its shape, registers and spilled bytes (Triton's own `ptxas -v`),
shared memory, whether the PTX has async copies (a pipelined loop) and which MMA it uses.
The constexprs come from the engine's own launch helpers (attention.tile_geometry and
_launch_config, ops/gemm_tuning.CANDIDATES), with a GPU launch's specialisations: unit strides
as constants, 16-divisible pointers and sizes (bench/compile_check.py compiles the variants the
CPU tests launch instead). Registers over ~128 at 4 warps halve the CTAs an SM holds; spills
put the loop's operands in local memory. docs/perf.md "Run 50" has a reading.
"""
from __future__ import annotations

import inspect
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), d) for d in (".", "../python")]

import triton  # noqa: E402
from compile_check import _ptxas_report, compile_sm90  # noqa: E402

from dflash_engine.kernels import attention, attention_splits, skinny_gemm  # noqa: E402
from dflash_engine.ops.gemm_tuning import CANDIDATES  # noqa: E402

GROUP, HEAD_DIM, PAGE = 4, 128, 16  # Qwen3-8B: 32 query heads over 8 KV heads of 128


def report(kernel, consts: dict, fp32: set, i32: set, warps: int, stages: int) -> str:
    params = list(inspect.signature(kernel.fn).parameters)

    def ty(p):
        if p in consts:
            return "constexpr"
        if p.endswith("_ptr"):
            return "*i32" if p in i32 else "*fp32" if p in fp32 else "*bf16"
        return "fp32" if p in fp32 else "i32"

    sig = {p: ty(p) for p in params}
    aligned = [p for p in params if sig[p] not in ("constexpr", "fp32")]  # (as a launch with aligned sizes)
    k = compile_sm90(kernel, sig, consts, dict(num_warps=warps, num_stages=stages), aligned=aligned)
    ptx = k.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "-"
    return (f"{_ptxas_report(ptx)}, smem {k.metadata.shared // 1024} KB, async copies "
            f"{'yes' if 'cp.async' in ptx else 'no'}, mma {mma}, {warps} warps / {stages} stages")


def main() -> int:
    print(f"triton {triton.__version__}, sm_90")
    att_fp, att_i32 = {"part_o_ptr", "part_lse_ptr", "qk_scale"}, {"qsl_ptr", "seq_lens_ptr", "bt_ptr"}
    for what, q_len, causal in (("decode", 1, True), ("verify (K = 15)", 16, True), ("draft (non-causal)", 16, False),
                                ("prefill chunk", 512, True)):
        bq, bm, bn = attention.tile_geometry(q_len, GROUP, HEAD_DIM, False)
        warps, stages = attention._launch_config(bm, HEAD_DIM)
        consts = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, GROUP=GROUP, BLOCK_Q=bq, BLOCK_M=bm,
                      BLOCK_N=bn, HEAD_DIM=HEAD_DIM, PAGE=PAGE, CAUSAL=causal, WINDOWED=False, SPLIT=True,
                      SPLIT_TILES=4 if causal and q_len <= 16 else 0, ALL_MASKED=causal and q_len <= 16,
                      DOT_PRECISION="tf32")
        print(f"attention {what:22s} {bm:3d} x {bn} tile: "
              + report(attention._paged_attention_kernel, consts, att_fp, att_i32, warps, stages))
    consts = dict(stride_od=1, GROUP=GROUP, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=32, HEAD_DIM=HEAD_DIM, PAGE=PAGE,
                  CAUSAL=True, WINDOWED=False, SPLIT_TILES=4, SUB_M=attention.COMBINE_SUB_M,
                  BLOCK_D=attention.COMBINE_BLOCK_D)
    print(f"split combine:{'':24s} "
          + report(attention_splits._combine_splits_kernel, consts, {"part_o_ptr", "part_lse_ptr"},
                   {"qsl_ptr", "seq_lens_ptr"}, 4, 3))
    for rows in (16, 64):
        for cfg in CANDIDATES:
            split = cfg.split_k > 1
            consts = dict(stride_xk=1, stride_wk=1, stride_on=1, HAS_BIAS=False, SPLIT=split,
                          FOLD=split and cfg.fold_reduce, SWAP_AB=cfg.swap_ab, BLOCK_M=skinny_gemm.bucket_rows(rows),
                          BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="tf32")
            print(f"skinny GEMM M = {rows:2d} {cfg.label():18s} "
                  + report(skinny_gemm._skinny_kernel, consts, {"part_ptr"}, {"count_ptr"}, cfg.num_warps,
                           cfg.num_stages))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
