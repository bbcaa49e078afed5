"""RMSNorm and fused residual-add + RMSNorm (Triton); twins: `dflash_engine.ops.norm`.

Numerics follow Hugging Face: statistics in float32, the normalised value rounded to the
input dtype, then multiplied by the weight (in float32, one rounding to the output dtype,
which is what torch does for a bf16 x bf16 product). The residual sum is rounded to the
input dtype before the norm reads it, as in the unfused layer.

`zero_centred=True` is Qwen3.5's norm (transformers' Qwen3_5RMSNorm): the weight applied as
(1 + weight) to the float32 normalised value, one rounding at the end.

One program per row. A row of up to `_MAX_SINGLE_TILE` elements is read once (one tile);
longer rows are read twice in chunks (statistics, then normalise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl import launch_options, wait_then_signal

_MAX_SINGLE_TILE = 16384
_CHUNK = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    n_cols, stride_x, stride_res, stride_y, stride_res_out, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ZERO_CENTRED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_signal(PDL)  # (kernels/pdl.py: before any read)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * stride_y
    res_row = res_ptr + row * stride_res
    res_out_row = res_out_ptr + row * stride_res_out
    in_ty = x_ptr.dtype.element_ty
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_row + cols, s, mask=mask)
            x = s.to(tl.float32)
            in_ty = res_out_ptr.dtype.element_ty
        var = tl.sum(x * x, axis=0) / n_cols
        rstd = tl.rsqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if ZERO_CENTRED:
            normed = x * rstd
            w = 1.0 + w
        else:
            normed = (x * rstd).to(in_ty).to(tl.float32)
        tl.store(y_row + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1 only reads, pass 2 re-reads and writes: safe when res_out aliases residual.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
                x = (x + r).to(res_out_ptr.dtype.element_ty).to(tl.float32)
            acc += x * x
        var = tl.sum(acc, axis=0) / n_cols
        rstd = tl.rsqrt(var + eps)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            ty = in_ty
            if HAS_RESIDUAL:
                r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
                s = (x + r).to(res_out_ptr.dtype.element_ty)
                tl.store(res_out_row + cols, s, mask=mask)
                x = s.to(tl.float32)
                ty = res_out_ptr.dtype.element_ty
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            if ZERO_CENTRED:
                normed = x * rstd
                w = 1.0 + w
            else:
                normed = (x * rstd).to(ty).to(tl.float32)
            tl.store(y_row + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: Tensor, n: int) -> Tensor:
    """A 2-D [rows, n] view with unit stride along n (copies only when it must)."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
            out: Tensor | None, residual_out: Tensor | None,
            zero_centred: bool = False) -> tuple[Tensor, Tensor | None]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    weight = weight.contiguous()
    x2 = _rows(x, n)
    rows = x2.shape[0]
    if out is None:  # (the zero-centred norm returns x's dtype, as transformers' does)
        dtype = x.dtype if zero_centred else torch.promote_types(weight.dtype, x.dtype)
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    y2 = out.view(-1, n)
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        r2 = _rows(residual, n)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        ro2 = residual_out.view(-1, n)
    else:
        r2 = ro2 = x2  # unused
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(n)
    if block <= _MAX_SINGLE_TILE:
        chunks = 1
    else:
        block = _CHUNK
        chunks = triton.cdiv(n, block)
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_norm_kernel[(rows,)](
        x2, r2, weight, y2, ro2,
        n, x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block, NUM_CHUNKS=chunks, ZERO_CENTRED=zero_centred,
        num_warps=num_warps, **launch_options(x2.device),
    )
    return out, residual_out


def rms_norm(x: Tensor, weight: Tensor, eps: float, out: Tensor | None = None, zero_centred: bool = False) -> Tensor:
    """x [..., N] -> weight * normalise(x), shaped like x (`out`: contiguous, same shape)."""
    return _launch(x, None, weight, eps, out, None, zero_centred)[0]


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float,
    out: Tensor | None = None, residual_out: Tensor | None = None, zero_centred: bool = False,
) -> tuple[Tensor, Tensor]:
    """-> (rms_norm(x + residual), x + residual).

    `residual_out` may be `residual` itself (in-place update of the residual stream);
    `out` and `residual_out` must be contiguous and shaped like x.
    """
    y, r = _launch(x, residual, weight, eps, out, residual_out, zero_centred)
    assert r is not None
    return y, r
