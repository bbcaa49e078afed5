"""Qwen3.5 gated attention's q/k path and output gate (Triton).

Twins: `dflash_engine.ops.dispatch.qk_norm_partial_rope` / `sigmoid_gate`'s torch branches
(ops.norm.zero_centred_rms_norm, ops.partial_rotary.apply_partial_rotary, torch.sigmoid).

- `qk_norm_partial_rope`: the qkv projection [T, q | k | v] (gated: each q head holds
  [query (D) | gate (D)]) -> contiguous q [T, H, D], k [T, KV, D] (zero-centred RMSNorm per
  head, then neox rotate-half on the first `rotary_dim` dims, the rest passed through) and
  v [T, KV, D]; one launch. The gate stays a [T, H, D] view of qkv.
- `sigmoid_gate`: out [T, H*D] * sigmoid(gate [T, H, D] view), one launch.

Numerics: norm statistics and the (1 + w) scale in float32, rounded once to the input dtype
(as the twin); the rotation in float32 from those rounded values, one rounding at the end
(the twin rounds each product in 16-bit dtypes: ulp-level differences). The gate:
sigmoid in float32 rounded to the gate's dtype, the product rounded once (as torch).

Invariants: grids are (T, head blocks) with the head block a function of the head counts
and head_dim only, so a row's numbers never depend on the batch (batch-invariant); no host
reads (CUDA-graph capturable).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["qk_norm_partial_rope", "sigmoid_gate"]

_MAX_TILE = 2048  # elements of one program's [heads, head_dim] tile


@triton.jit
def _norm_rope_heads(
    src, sh, dst, w_ptr, cos_row, sin_row, h0, n_heads, eps,
    D: tl.constexpr, BD: tl.constexpr, RD: tl.constexpr, RH: tl.constexpr, HB: tl.constexpr,
    NORM_ROPE: tl.constexpr,
):
    """HB heads (source head stride `sh`, destination contiguous [heads, D]): with
    NORM_ROPE the zero-centred norm + partial rotary, else a copy."""
    heads = h0 + tl.arange(0, HB)
    hm = (heads < n_heads)[:, None]
    cols = tl.arange(0, BD)
    cm = cols < D
    src_off = heads[:, None] * sh
    dst_off = heads[:, None] * D
    x = tl.load(src + src_off + cols[None, :], mask=hm & cm[None, :], other=0.0)
    out_ty = dst.dtype.element_ty
    if NORM_ROPE:
        in_ty = src.dtype.element_ty
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        w = 1.0 + tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        y = (xf * rstd * w[None, :]).to(in_ty)
        # the pass-through dims [RD, D)
        tl.store(dst + dst_off + cols[None, :], y.to(out_ty), mask=hm & ((cols >= RD) & cm)[None, :])
        # the rotated dims: halves [0, RD/2) and [RD/2, RD), rotate-half pairs
        rc = tl.arange(0, RH)
        rm = rc < RD // 2
        m = hm & rm[None, :]
        x1 = tl.load(src + src_off + rc[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + src_off + RD // 2 + rc[None, :], mask=m, other=0.0).to(tl.float32)
        w1 = 1.0 + tl.load(w_ptr + rc, mask=rm, other=0.0).to(tl.float32)
        w2 = 1.0 + tl.load(w_ptr + RD // 2 + rc, mask=rm, other=0.0).to(tl.float32)
        n1 = (x1 * rstd * w1[None, :]).to(in_ty).to(tl.float32)
        n2 = (x2 * rstd * w2[None, :]).to(in_ty).to(tl.float32)
        c1 = tl.load(cos_row + rc, mask=rm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_row + RD // 2 + rc, mask=rm, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_row + rc, mask=rm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_row + RD // 2 + rc, mask=rm, other=0.0).to(tl.float32)[None, :]
        tl.store(dst + dst_off + rc[None, :], (n1 * c1 - n2 * s1).to(out_ty), mask=m)
        tl.store(dst + dst_off + RD // 2 + rc[None, :], (n2 * c2 + n1 * s2).to(out_ty), mask=m)
    else:
        tl.store(dst + dst_off + cols[None, :], x.to(out_ty), mask=hm & cm[None, :])


@triton.jit
def _qk_norm_partial_rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr,
    s_qkv, s_cos, s_sin, H, KV, eps,
    D: tl.constexpr, BD: tl.constexpr, RD: tl.constexpr, RH: tl.constexpr, HB: tl.constexpr,
    QSH: tl.constexpr,
):
    """Program (token, head block): q blocks, then k blocks, then v blocks. QSH: the q
    heads' stride in qkv (2D gated: [query | gate] per head, else D)."""
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nqb = tl.cdiv(H, HB)
    nkb = tl.cdiv(KV, HB)
    src = qkv_ptr + t * s_qkv
    cos_row = cos_ptr + t * s_cos
    sin_row = sin_ptr + t * s_sin
    if blk < nqb:
        _norm_rope_heads(src, QSH, q_ptr + t * H * D, qw_ptr, cos_row, sin_row, blk * HB, H, eps,
                         D, BD, RD, RH, HB, True)
    elif blk < nqb + nkb:
        _norm_rope_heads(src + H * QSH, D, k_ptr + t * KV * D, kw_ptr, cos_row, sin_row, (blk - nqb) * HB, KV,
                         eps, D, BD, RD, RH, HB, True)
    else:
        _norm_rope_heads(src + H * QSH + KV * D, D, v_ptr + t * KV * D, qw_ptr, cos_row, sin_row,
                         (blk - nqb - nkb) * HB, KV, eps, D, BD, RD, RH, HB, False)


def _head_block(heads: int, bd: int) -> int:
    return min(triton.next_power_of_2(heads), max(1, _MAX_TILE // bd))


def qk_norm_partial_rope(
    qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: Tensor, sin: Tensor,
    q_norm_weight: Tensor, k_norm_weight: Tensor, eps: float, gated: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """qkv [T, H*D*(2 if gated else 1) + 2*KV*D] (any row stride) -> contiguous q [T, H, D],
    k [T, KV, D] (zero-centred RMSNorm, then rotary on the first rotary_dim dims), v [T, KV, D],
    and the gate: a [T, H, D] view of qkv (None when not gated). cos/sin [T, rotary_dim]
    (RotaryEmbedding(rotary_dim)'s output). q, k come back in promote(qkv, cos) dtype."""
    if qkv.dim() != 2:
        raise ValueError("qkv must be 2-D")
    t = qkv.shape[0]
    h, kv, d = num_heads, num_kv_heads, head_dim
    qsh = 2 * d if gated else d
    if qkv.shape[1] != h * qsh + 2 * kv * d:
        raise ValueError(f"qkv width {qkv.shape[1]} != {h * qsh + 2 * kv * d} (H={h}, KV={kv}, D={d}, gated={gated})")
    rd = cos.shape[-1]
    if cos.shape != sin.shape or cos.shape[0] != t or rd % 2 or not 0 < rd <= d:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [T, rotary_dim], rotary_dim even and <= {d}")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    qk_dtype = torch.promote_types(qkv.dtype, cos.dtype)
    q = torch.empty(t, h, d, dtype=qk_dtype, device=qkv.device)
    k = torch.empty(t, kv, d, dtype=qk_dtype, device=qkv.device)
    v = torch.empty(t, kv, d, dtype=qkv.dtype, device=qkv.device)
    gate = qkv[:, :h * qsh].view(t, h, qsh)[..., d:] if gated else None
    if t == 0:
        return q, k, v, gate
    bd = triton.next_power_of_2(d)
    hb = _head_block(max(h, kv), bd)
    grid = (t, triton.cdiv(h, hb) + 2 * triton.cdiv(kv, hb))
    _qk_norm_partial_rope_kernel[grid](
        qkv, cos, sin, q_norm_weight.contiguous(), k_norm_weight.contiguous(), q, k, v,
        qkv.stride(0), cos.stride(0), sin.stride(0), h, kv, float(eps),
        D=d, BD=bd, RD=rd, RH=triton.next_power_of_2(rd // 2), HB=hb, QSH=qsh,
        num_warps=4 if hb * bd >= 1024 else 2,
    )
    return q, k, v, gate


@triton.jit
def _sigmoid_gate_kernel(
    o_ptr, g_ptr, y_ptr, H, so_t, sg_t, sg_h, sy_t,
    D: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr,
):
    """Program (token, head block): y = out * sigmoid(gate), the sigmoid rounded to the
    gate's dtype, the product rounded once."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    cols = tl.arange(0, BD)
    m = (heads < H)[:, None] & (cols < D)[None, :]
    flat = heads[:, None] * D + cols[None, :]
    gate = tl.load(g_ptr + t * sg_t + heads[:, None] * sg_h + cols[None, :], mask=m, other=0.0)
    s = (1.0 / (1.0 + tl.exp(-gate.to(tl.float32)))).to(gate.dtype).to(tl.float32)
    o = tl.load(o_ptr + t * so_t + flat, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * sy_t + flat, (o * s).to(y_ptr.dtype.element_ty), mask=m)


def sigmoid_gate(out: Tensor, gate: Tensor) -> Tensor:
    """out [T, H*D] (unit last stride) * sigmoid(gate [T, H, D], any row and head strides)
    -> a new [T, H*D] tensor in promote(out, gate) dtype."""
    t, h, d = gate.shape
    if out.shape != (t, h * d):
        raise ValueError(f"out {tuple(out.shape)} is not [{t}, {h * d}]")
    out = out if out.stride(-1) == 1 else out.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    y = torch.empty(out.shape, dtype=torch.promote_types(out.dtype, gate.dtype), device=out.device)
    if t == 0:
        return y
    bd = triton.next_power_of_2(d)
    hb = _head_block(h, bd)
    _sigmoid_gate_kernel[(t, triton.cdiv(h, hb))](
        out, gate, y, h, out.stride(0), gate.stride(0), gate.stride(1), y.stride(0),
        D=d, BD=bd, HB=hb, num_warps=4 if hb * bd >= 1024 else 2,
    )
    return y
