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

Where it is on: in the step graphs of the smallest batches (`MAX_BUCKET` requests and
`MAX_ROWS` target rows), where a step is a chain of small grids and launch latency shows.
bench_step `--ab dflash_engine.kernels.pdl.PDL` (H100, Qwen3-8B, K = 15), step ms PDL on /
off: run 47: 0.986 (spec on) and 0.985 (spec off) at c = 1, spec off 0.993 / 0.997 at c = 4 /
8, but 1.004-1.067 for spec on at c >= 4 and spec off at c >= 16, where grids of several
waves meet dependents that take SMs early to wait on them; run 49: spec on 0.985 / 1.001 /
1.005 and spec off 0.985 / 0.988 / 0.972 at c = 1 / 2 / 4. So: spec on at c = 1 (16 rows),
spec off up to c = 4. The graph runner captures each decode graph inside
`capture_scope.for_bucket`; eager steps and mixed-step graphs launch without it. `PDL = True`
/ `False` forces it on / off everywhere (bench_step's A/B switch). The interpreter (no GPU)
never launches with it: it cannot run the instructions, and `launch_options` gives it nothing.
"""
from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .. import envs
from . import capture_scope

__all__ = ["MAX_BUCKET", "MAX_ROWS", "PDL", "active", "hopper_or_later", "launch_options", "wait_then_signal"]

# The switch, read at each launch (a step graph captured with it on keeps its edges): None:
# in the capture of a decode graph within MAX_BUCKET and MAX_ROWS only (capture_scope.py); True / False:
# everywhere / nowhere.
PDL: bool | None = None
# The largest decode graphs captured with PDL: decoding requests, and target rows.
MAX_BUCKET = 4
MAX_ROWS = 16


def active() -> bool:
    """Whether a launch now would ask for PDL (before the device checks)."""
    return capture_scope.within(MAX_BUCKET, MAX_ROWS) if PDL is None else PDL


@cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def hopper_or_later(device: torch.device) -> bool:
    """A CUDA device of compute capability 9 or more, with real kernels (not the interpreter)."""
    if device.type != "cuda" or envs.triton_interpreter():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on `device`: `launch_pdl` and the kernel's `PDL`
    constexpr when PDL is on and the device is a Hopper-or-later GPU, else none."""
    if not active() or not hopper_or_later(device):
        return {}
    return {"launch_pdl": True, "PDL": True}


@triton.jit
def wait_then_signal(PDL: tl.constexpr):
    """The first statement of a kernel that opts in: wait for the previous grid (its writes
    visible), then let the next PDL-launched kernel be scheduled. Nothing when PDL is off."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
