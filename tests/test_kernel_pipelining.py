"""The hot Triton loops compile to pipelined code for Hopper (sm_90): their K/V or weight
copies are asynchronous and stay in flight across iterations (the paged attention, the
exact mode's GEMM and the skinny GEMM of few-row shapes). Two kernels lost this silently
before (docs/perf.md "Kernels that Triton did not pipeline"): the paged attention waited for
every copy at the top of each iteration (a K/V address depending on a load in its own
iteration), and a GEMM's loads were 2-byte scalars (an offset of unknown alignment).

Compiled on the CPU (no GPU needed: Triton's NVIDIA backend ships ptxas) with the
specialisations a real launch gets (unit strides, 16-divisible pointers and strides), in a
subprocess without TRITON_INTERPRET. The TTGIR must show async copies and, inside the loop,
a wait that leaves copies in flight (`num > 0`)."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = textwrap.dedent('''
    import inspect, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, sys.argv[1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dflash_engine.kernels import attention, gemm, skinny_gemm
    from dflash_engine.ops import gemm_tuning
    which = sys.argv[2]
    if which == "attention":
        k = attention._paged_attention_kernel
        block_m, warps, stages = 64, *attention._launch_config(64, 128)
        consts = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1, GROUP=4, BLOCK_Q=16, BLOCK_M=block_m,
                      BLOCK_N=64, HEAD_DIM=128, PAGE=16, CAUSAL=True, WINDOWED=False, SPLIT=False, SPLIT_TILES=0,
                      ALL_MASKED=True, DOT_PRECISION="tf32")
        fp = {"part_o_ptr", "part_lse_ptr", "qk_scale"}
        i32 = {"qsl_ptr", "seq_lens_ptr", "bt_ptr"}
    elif which == "skinny":
        k = skinny_gemm._skinny_kernel
        cfg = gemm_tuning.CANDIDATES[1]  # a split of K, the weight as the MMA's wide operand
        warps, stages = cfg.num_warps, cfg.num_stages
        consts = dict(stride_xk=1, stride_wk=1, stride_on=1, HAS_BIAS=True, SPLIT=True, FOLD=True,
                      SWAP_AB=cfg.swap_ab, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                      DOT_PRECISION="tf32")
        fp, i32 = {"part_ptr"}, {"count_ptr"}
    else:
        k = gemm._matmul_kernel
        *_, warps, stages = gemm.TILE
        bm, bn, bk = gemm.TILE[:3]
        consts = dict(stride_xk=1, stride_wk=1, stride_on=1, HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                      DOT_PRECISION="tf32")
        fp, i32 = set(), set()
    params = list(inspect.signature(k.fn).parameters)
    def ty(p):
        if p in consts:
            return "constexpr"
        if p.endswith("_ptr"):
            return "*i32" if p in i32 else ("*fp32" if p in fp else "*bf16")
        return "fp32" if p in fp else "i32"
    sig = {p: ty(p) for p in params}
    dyn = set(getattr(k, "do_not_specialize", ())) | {"M"}
    dyn = {params[d] if isinstance(d, int) else d for d in dyn}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
             if p not in consts and p not in dyn and sig[p] != "fp32"}
    src = ASTSource(fn=k, signature=sig, constexprs={(params.index(n),): v for n, v in consts.items()}, attrs=attrs)
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    print(cc.asm["ttgir"])
''')


def _ttgir(which: str) -> str:
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(ROOT / "python"), which],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and ("ptxas" in proc.stderr and "not found" in proc.stderr):
        pytest.skip("Triton's NVIDIA toolchain (ptxas) is not installed here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _loop_waits(ttgir: str) -> list[int]:
    """`num` of the async waits inside scf.for bodies (indented deeper than the loop)."""
    waits, depth = [], None
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        if "scf.for" in line:
            depth = indent
        elif depth is not None and indent <= depth:
            depth = None
        elif depth is not None and "ttg.async_wait" in line:
            waits.append(int(re.search(r"num = (\d+)", line).group(1)))
    return waits


@pytest.mark.parametrize("which", ["attention", "gemm", "skinny"])
def test_hot_loops_keep_their_copies_in_flight(which):
    ttgir = _ttgir(which)
    assert "ttg.async_copy_global_to_local" in ttgir, "loads are synchronous: nothing to pipeline"
    waits = _loop_waits(ttgir)
    assert waits and min(waits) > 0, f"the loop waits for every copy in flight each iteration: {waits}"
