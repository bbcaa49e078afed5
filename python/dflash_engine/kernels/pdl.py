"""Programmatic dependent launch (PDL, Hopper and later) for the engine's own Triton kernels.

A kernel launched with PDL may be scheduled before the kernel ahead of it in the stream has
finished, once every program of that one has signalled (`gdc_launch_dependents`) or exited;
it then blocks in `gdc_wait` until the whole previous grid is done and its writes are
visible. So each kernel that opts in calls `gdc_wait` before it reads anything, and signals
its dependents right after: what overlaps is the dependent's launch and its programs'
set-up, never a read of data still being written. Inside a CUDA graph the launch attribute
becomes a programmatic edge, so the captured steps get it too.

The kernels that opt in: RMSNorm (norm.py), SwiGLU (activation.py), q/k-norm + RoPE
(rotary.py), the paged attention and its split combine. The chains it can shorten are ours
only: cuBLAS's GEMMs are launched without the attribute and start when the kernel before
them has finished, as before. Per target layer the consecutive Triton kernels are q/k-norm +
RoPE -> paged attention -> split combine; the others follow a GEMM, and gain only if
cuBLAS's kernel signals its dependents early. tests/test_kernel_pdl.py compiles each for
sm_90 and checks the wait comes before every global read.

`PDL` is off: not measured yet (docs/perf.md "What is left at c = 1"); `bench/bench_step.py
--ab dflash_engine.kernels.pdl.PDL` times it. The interpreter (no GPU) never launches with it:
it cannot run the instructions, and `launch_options` gives it nothing.
"""
from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import envs

__all__ = ["PDL", "launch_options", "wait_then_signal"]

# The switch: read at each launch (a step graph captured with it on keeps its edges).
PDL = False


@cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: `launch_pdl` and the kernel's `PDL`
    constexpr when PDL is on and the device is a Hopper-or-later GPU, else none."""
    if not PDL or device.type != "cuda" or envs.triton_interpreter():
        return {}
    if not _capable(device.index if device.index is not None else torch.cuda.current_device()):
        return {}
    return {"launch_pdl": True, "PDL": True}


@triton.jit
def wait_then_signal(PDL: tl.constexpr):
    """The first statement of a kernel that opts in: wait for the previous grid (its writes
    visible), then let the next PDL-launched kernel be scheduled. Nothing when PDL is off."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
