"""Fused split + per-head q/k RMSNorm + neox RoPE of a merged qkv projection (Triton).

Twin: `dflash_engine.ops.rotary.qk_norm_rope`.

Grid: (token, head block). Each program handles HB heads of one kind (q, k or v) of one
token as a [HB, D/2] pair of tiles (the two halves of each head, which rotate-half pairs).
Norm numerics as `ops.norm.rms_norm` (float32 statistics, normalised value rounded to the
input dtype, times the weight rounded to the norm's output dtype); RoPE in float32 with one
rounding at the end (the torch twin rounds after each product: bf16-level differences).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _heads_tile(
    src_row, dst_row, w_ptr, cos, sin, h0, n_heads, eps,
    D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
):
    heads = h0 + tl.arange(0, HB)
    cols = tl.arange(0, HALF)
    mask = (heads < n_heads)[:, None] & (cols < D // 2)[None, :]
    off = heads[:, None] * D + cols[None, :]
    x1 = tl.load(src_row + off, mask=mask, other=0.0)
    x2 = tl.load(src_row + off + D // 2, mask=mask, other=0.0)
    out_ty = dst_row.dtype.element_ty
    if NORM:
        in_ty = src_row.dtype.element_ty
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        var = (tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D
        rstd = tl.rsqrt(var + eps)[:, None]
        cm = cols < D // 2
        w1 = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + D // 2 + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        x1 = ((a * rstd).to(in_ty).to(tl.float32) * w1).to(out_ty)
        x2 = ((b * rstd).to(in_ty).to(tl.float32) * w2).to(out_ty)
    if ROPE:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        o1 = a * cos - b * sin
        o2 = b * cos + a * sin
        tl.store(dst_row + off, o1.to(out_ty), mask=mask)
        tl.store(dst_row + off + D // 2, o2.to(out_ty), mask=mask)
    else:
        tl.store(dst_row + off, x1.to(out_ty), mask=mask)
        tl.store(dst_row + off + D // 2, x2.to(out_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr,
    stride_qkv, stride_cos, stride_sin, stride_q, stride_k, stride_v,
    H, KV, eps,
    D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nqb = tl.cdiv(H, HB)
    nkb = tl.cdiv(KV, HB)
    src = qkv_ptr + t * stride_qkv
    cols = tl.arange(0, HALF)
    cm = cols < D // 2
    if blk < nqb + nkb:
        cos = tl.load(cos_ptr + t * stride_cos + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + t * stride_sin + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        if blk < nqb:
            _heads_tile(src, q_ptr + t * stride_q, qw_ptr, cos, sin, blk * HB, H, eps,
                        D, HALF, HB, Q_NORM, True)
        else:
            _heads_tile(src + H * D, k_ptr + t * stride_k, kw_ptr, cos, sin, (blk - nqb) * HB, KV, eps,
                        D, HALF, HB, K_NORM, True)
    else:
        _heads_tile(src + (H + KV) * D, v_ptr + t * stride_v, qw_ptr, 0.0, 0.0, (blk - nqb - nkb) * HB, KV,
                    eps, D, HALF, HB, False, False)


def qk_norm_rope(
    qkv: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: Tensor,
    sin: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
    out: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [T, (H + 2*KV) * D] -> contiguous q [T, H, D], k [T, KV, D], v [T, KV, D].

    cos/sin: [T, D] (RotaryEmbedding's output: the two halves are equal, the first is read)
    or [T, D/2]; any row stride, unit stride along the last dim.
    `out`: optional (q, k, v) buffers, contiguous and of those shapes.
    """
    if qkv.dim() != 2:
        raise ValueError("qkv must be 2-D [T, (H + 2*KV) * D]")
    t = qkv.shape[0]
    h, kv, d = num_heads, num_kv_heads, head_dim
    if qkv.shape[1] != (h + 2 * kv) * d:
        raise ValueError(f"qkv width {qkv.shape[1]} != (H + 2*KV) * D = {(h + 2 * kv) * d}")
    if d % 2:
        raise ValueError("head_dim must be even")
    if cos.shape != sin.shape or cos.shape[0] != t or cos.shape[-1] not in (d, d // 2):
        raise ValueError(f"cos/sin shape {tuple(cos.shape)} must be [T, D] or [T, D/2]")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    dt = qkv.dtype
    if q_norm_weight is not None:
        q_norm_weight = q_norm_weight.contiguous()
    if k_norm_weight is not None:
        k_norm_weight = k_norm_weight.contiguous()
    if out is None:
        # the twin's result dtypes: (weight * normed) * cos
        def out_dtype(w: Tensor | None) -> torch.dtype:
            return torch.promote_types(dt if w is None else torch.promote_types(dt, w.dtype), cos.dtype)

        qdt, kdt = out_dtype(q_norm_weight), out_dtype(k_norm_weight)
        q = torch.empty(t, h, d, dtype=qdt, device=qkv.device)
        k = torch.empty(t, kv, d, dtype=kdt, device=qkv.device)
        v = torch.empty(t, kv, d, dtype=dt, device=qkv.device)
    else:
        q, k, v = out
        for name, buf, heads in (("q", q, h), ("k", k, kv), ("v", v, kv)):
            if buf.shape != (t, heads, d) or not buf.is_contiguous():
                raise ValueError(f"out {name} must be contiguous [{t}, {heads}, {d}]")
    if t == 0:
        return q, k, v
    half = triton.next_power_of_2(d // 2)
    hb = min(triton.next_power_of_2(max(h, kv)), max(1, 2048 // half))
    grid = (t, triton.cdiv(h, hb) + 2 * triton.cdiv(kv, hb))
    dummy = cos  # never read when the matching *_NORM flag is off
    _qk_norm_rope_kernel[grid](
        qkv, cos, sin,
        q_norm_weight if q_norm_weight is not None else dummy,
        k_norm_weight if k_norm_weight is not None else dummy,
        q, k, v,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k.stride(0), v.stride(0),
        h, kv, float(eps),
        D=d, HALF=half, HB=hb, Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None,
        num_warps=4 if hb * half >= 1024 else 2,
    )
    return q, k, v
