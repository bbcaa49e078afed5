"""SwiGLU on a merged gate_up projection (Triton); twin: `dflash_engine.ops.activation`.

gate_up [T, 2I] (gate columns first, then up) -> silu(gate) * up [T, I]. silu in float32,
rounded to the input dtype (as F.silu returns it), then the product in float32 with one
rounding: the torch twin's numerics. Grid: (row, column block).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import launch_options, wait_then_signal

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, n_cols, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_then_signal(PDL)  # (kernels/pdl.py: before any read)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x_row = x_ptr + row * stride_x
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (act * u).to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    """gate_up [..., 2I] -> [..., I] (`out`: contiguous, that shape, gate_up's dtype)."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError("the last dim of gate_up must be even (gate then up)")
    i = two_i // 2
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(*gate_up.shape[:-1], i, dtype=gate_up.dtype, device=gate_up.device)
    elif out.shape != (*gate_up.shape[:-1], i) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {(*gate_up.shape[:-1], i)}")
    y2 = out.view(-1, i)
    rows = x2.shape[0]
    if rows == 0 or i == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(i))
    _silu_and_mul_kernel[(rows, triton.cdiv(i, block))](
        x2, y2, i, x2.stride(0), y2.stride(0), BLOCK=block, num_warps=4 if block >= 512 else 1,
        **launch_options(x2.device),
    )
    return out
