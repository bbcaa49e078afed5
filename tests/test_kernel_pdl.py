"""Programmatic dependent launch (kernels/pdl.py): a kernel compiled with PDL waits for the
previous grid before its first global read, and signals its dependents; compiled without
it, neither instruction is there. The interpreter cannot run these instructions, so the
kernels are compiled for Hopper (sm_90) on the CPU, as tests/test_kernel_pipelining.py does,
and the PTX is read: `griddepcontrol.wait` must come before every `ld.global` / `cp.async`
(a read before it could see the previous kernel's output half written)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = textwrap.dedent('''
    import inspect, json, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, sys.argv[1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dflash_engine.kernels import activation, attention, attention_splits, norm, rotary

    attn = dict(GROUP=4, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=32, HEAD_DIM=128, PAGE=16, CAUSAL=True, WINDOWED=False)
    KERNELS = {  # kernel, constexprs, pointer types other than bf16 (by name), fp32 scalars
        "rms_norm": (norm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096, NUM_CHUNKS=1, ZERO_CENTRED=False),
                     {"w_ptr": "*bf16"}, {"eps"}),
        "silu_and_mul": (activation._silu_and_mul_kernel, dict(BLOCK=1024), {}, set()),
        "qk_norm_rope": (rotary._qk_norm_rope_kernel, dict(D=128, HALF=64, HB=8, Q_NORM=True, K_NORM=True,
                                                           STORE=True, PAGE=16),
                         {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}, {"eps"}),
        "paged_attention": (attention._paged_attention_kernel,
                            dict(attn, SPLIT=True, SPLIT_TILES=4, ALL_MASKED=True, DOT_PRECISION="tf32"),
                            {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "qsl_ptr": "*i32",
                             "seq_lens_ptr": "*i32", "bt_ptr": "*i32"}, {"qk_scale"}),
        "combine_splits": (attention_splits._combine_splits_kernel,
                           dict(attn, SPLIT_TILES=4, SUB_M=16, BLOCK_D=64),
                           {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "qsl_ptr": "*i32",
                            "seq_lens_ptr": "*i32"}, set()),
    }
    out = {}
    for name, (k, consts, ptrs, floats) in KERNELS.items():
        for pdl in (True, False):
            c = dict(consts, PDL=pdl)
            params = list(inspect.signature(k.fn).parameters)
            sig = {p: "constexpr" if p in c else ptrs.get(p, "*bf16") if p.endswith("_ptr")
                   else "fp32" if p in floats else "i32" for p in params}
            src = ASTSource(fn=k, signature=sig, constexprs={(params.index(n),): v for n, v in c.items()})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
            lines = [ln.strip() for ln in ptx.splitlines()]
            def first(*ops):
                hits = [i for i, ln in enumerate(lines) if ln.startswith(ops) or any(f" {o}" in ln for o in ops)]
                return hits[0] if hits else None
            out[f"{name}:{pdl}"] = dict(wait=first("griddepcontrol.wait"),
                                         signal=first("griddepcontrol.launch_dependents"),
                                         read=first("ld.global", "cp.async"))
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def compiled() -> dict:
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(ROOT / "python")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and ("ptxas" in proc.stderr and "not found" in proc.stderr):
        pytest.skip("Triton's NVIDIA toolchain (ptxas) is not installed here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["rms_norm", "silu_and_mul", "qk_norm_rope", "paged_attention", "combine_splits"])
def test_a_pdl_kernel_waits_for_the_previous_grid_before_any_global_read(compiled, kernel):
    on, off = compiled[f"{kernel}:True"], compiled[f"{kernel}:False"]
    assert on["read"] is not None, on  # (the PTX scan found the kernel's reads)
    assert on["wait"] is not None and on["wait"] < on["read"], on
    assert on["signal"] is not None and on["wait"] < on["signal"], on
    assert off["wait"] is None and off["signal"] is None, off


def test_pdl_is_asked_only_inside_a_small_decode_graph_unless_forced(monkeypatch):
    from dflash_engine.kernels import capture_scope, pdl

    assert pdl.PDL is None  # by graph (run 47 / 49: spec on c = 1, spec off c <= 4 gained)
    assert not pdl.active()  # eager launches
    with capture_scope.for_bucket(1, 16):  # spec on (B = 16), one request
        assert pdl.active()
        with capture_scope.for_bucket(1, 16 + 32, mixed=True):  # a mixed step's graph: not asked
            assert not pdl.active()
        assert pdl.active()  # restored on exit
    with capture_scope.for_bucket(2, 32):  # spec on, two requests: 32 rows
        assert not pdl.active()
    with capture_scope.for_bucket(4, 4):  # spec off, four requests
        assert pdl.active()
    with capture_scope.for_bucket(8, 8):
        assert not pdl.active()
    assert not pdl.active()
    monkeypatch.setattr(pdl, "PDL", False)
    with capture_scope.for_bucket(1, 1):
        assert not pdl.active()
    monkeypatch.setattr(pdl, "PDL", True)
    assert pdl.active()


def test_launch_options_give_nothing_off_the_gpu_or_with_the_switch_off(monkeypatch):
    from dflash_engine.kernels import pdl

    assert pdl.launch_options(torch.device("cpu")) == {}
    monkeypatch.setattr(pdl, "PDL", False)
    assert pdl.launch_options(torch.device("cuda", 0)) == {}  # (no device query when off)
    monkeypatch.setattr(pdl, "PDL", True)
    assert pdl.launch_options(torch.device("cpu")) == {}  # the interpreter cannot run it
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.launch_options(torch.device("cuda", 0)) == {}

