"""The L2 prefetch of o_proj's weight (kernels/l2_prefetch.py): compiled for Hopper (sm_90) on
the CPU, its PTX holds the bulk L2 prefetch on a global address (the asm is not dropped as
dead code); the switch asks for it only in small decode graphs on a capable GPU; on the GPU a
lone request through graphs that prefetch gives eager's tokens (tests/test_gpu_step.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

_COMPILE = textwrap.dedent('''
    import os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, sys.argv[1])
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dflash_engine.kernels import l2_prefetch

    k = l2_prefetch._prefetch_kernel
    src = ASTSource(fn=k, signature={"base": "i64", "last": "i64", "CHUNK_BYTES": "constexpr",
                                     "PER_PROGRAM": "constexpr"},
                    constexprs={(2,): l2_prefetch.CHUNK, (3,): l2_prefetch.PER_PROGRAM})
    print(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"])
''')


def test_the_kernel_compiles_to_bulk_l2_prefetches_for_sm90():
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(ROOT / "python")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and ("ptxas" in proc.stderr and "not found" in proc.stderr):
        pytest.skip("Triton's NVIDIA toolchain (ptxas) is not installed here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = proc.stdout
    # PER_PROGRAM prefetches over one warp: each thread issues PER_PROGRAM / 32 of them.
    from dflash_engine.kernels import l2_prefetch

    assert ptx.count("cp.async.bulk.prefetch.L2.global") == l2_prefetch.PER_PROGRAM // 32, ptx[-3000:]
    assert "cvta.to.global.u64" in ptx
    assert "st.global" not in ptx and "ld.global" not in ptx  # it reads and writes nothing itself


def test_prefetch_is_asked_only_in_small_decode_graphs_on_a_capable_gpu(monkeypatch):
    from dflash_engine.kernels import capture_scope, l2_prefetch, pdl

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert l2_prefetch.PREFETCH is False  # off until a device run times it
    with capture_scope.for_bucket(1, 16):
        assert not l2_prefetch.active(cuda)
    monkeypatch.setattr(l2_prefetch, "PREFETCH", None)  # by bucket
    assert not l2_prefetch.active(cuda)  # eager launches
    assert not l2_prefetch.active(torch.device("cpu"))
    with capture_scope.for_bucket(4, 64):
        assert l2_prefetch.active(cuda)
        assert not l2_prefetch.active(torch.device("cpu"))
    with capture_scope.for_bucket(8, 8):
        assert not l2_prefetch.active(cuda)
    with capture_scope.for_bucket(1, 16, mixed=True):
        assert not l2_prefetch.active(cuda)
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # below sm_90
    with capture_scope.for_bucket(1, 16):
        assert not l2_prefetch.active(cuda)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setattr(l2_prefetch, "PREFETCH", True)
    assert l2_prefetch.active(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not l2_prefetch.active(cuda)  # the interpreter cannot run it


def test_nothing_is_started_for_tensors_it_cannot_prefetch():
    from dflash_engine.ops import dispatch

    assert dispatch.prefetch_ahead(torch.zeros(64, 64)) is None  # CPU
    dispatch.prefetch_join(None)  # a no-op
