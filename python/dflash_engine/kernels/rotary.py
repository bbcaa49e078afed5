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

from .pdl import launch_options, wait_then_signal


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
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_qkv, stride_cos, stride_sin, stride_q, stride_k, stride_v,
    stride_kcp, stride_kcs, stride_vcp, stride_vcs,
    H, KV, eps,
    D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, STORE: tl.constexpr, PAGE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_signal(PDL)  # (kernels/pdl.py: before any read)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nqb = tl.cdiv(H, HB)
    nkb = tl.cdiv(KV, HB)
    src = qkv_ptr + t * stride_qkv
    cols = tl.arange(0, HALF)
    cm = cols < D // 2
    # K and V rows go to k / v, or (STORE) straight into the paged caches at the row's slot
    # (a negative slot, a graph bucket's padding row, writes nothing).
    k_dst = k_ptr + t * stride_k
    v_dst = v_ptr + t * stride_v
    keep = True
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        keep = slot >= 0
        page = slot // PAGE
        off = slot % PAGE
        k_dst = kc_ptr + page * stride_kcp + off * stride_kcs
        v_dst = vc_ptr + page * stride_vcp + off * stride_vcs
    if blk < nqb + nkb:
        cos = tl.load(cos_ptr + t * stride_cos + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + t * stride_sin + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        if blk < nqb:
            _heads_tile(src, q_ptr + t * stride_q, qw_ptr, cos, sin, blk * HB, H, eps,
                        D, HALF, HB, Q_NORM, True)
        elif keep:
            _heads_tile(src + H * D, k_dst, kw_ptr, cos, sin, (blk - nqb) * HB, KV, eps,
                        D, HALF, HB, K_NORM, True)
    elif keep:
        _heads_tile(src + (H + KV) * D, v_dst, qw_ptr, 0.0, 0.0, (blk - nqb - nkb) * HB, KV,
                    eps, D, HALF, HB, False, False)


def _check(qkv: Tensor, h: int, kv: int, d: int, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if qkv.dim() != 2:
        raise ValueError("qkv must be 2-D [T, (H + 2*KV) * D]")
    t = qkv.shape[0]
    if qkv.shape[1] != (h + 2 * kv) * d:
        raise ValueError(f"qkv width {qkv.shape[1]} != (H + 2*KV) * D = {(h + 2 * kv) * d}")
    if d % 2:
        raise ValueError("head_dim must be even")
    return (qkv if qkv.stride(1) == 1 else qkv.contiguous(), *_check_cos_sin(cos, sin, t, d))


def _check_cos_sin(cos: Tensor, sin: Tensor, t: int, d: int) -> tuple[Tensor, Tensor]:
    """cos/sin of T rows, [T, D] or [T, D/2], with unit stride along the last dim."""
    if cos.shape != sin.shape or cos.shape[0] != t or cos.shape[-1] not in (d, d // 2):
        raise ValueError(f"cos/sin shape {tuple(cos.shape)} must be [T, D] or [T, D/2]")
    return cos if cos.stride(-1) == 1 else cos.contiguous(), sin if sin.stride(-1) == 1 else sin.contiguous()


def result_dtypes(qkv: Tensor, cos: Tensor, q_norm_weight: Tensor | None, k_norm_weight: Tensor | None
                  ) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """The dtypes of q, k, v (the twin's: (weight * normed) * cos; v keeps qkv's)."""
    def out_dtype(w: Tensor | None) -> torch.dtype:
        return torch.promote_types(qkv.dtype if w is None else torch.promote_types(qkv.dtype, w.dtype), cos.dtype)

    return out_dtype(q_norm_weight), out_dtype(k_norm_weight), qkv.dtype


def _half_and_block(h: int, kv: int, d: int) -> tuple[int, int]:
    """(HALF: the padded half head, HB: heads per program)."""
    half = triton.next_power_of_2(d // 2)
    return half, min(triton.next_power_of_2(max(h, kv)), max(1, 2048 // half))


def _launch(qkv, h, kv, d, cos, sin, qw, kw, eps, q, k, v, cache) -> None:
    t = qkv.shape[0]
    if t == 0:
        return
    half, hb = _half_and_block(h, kv, d)
    grid = (t, triton.cdiv(h, hb) + 2 * triton.cdiv(kv, hb))
    dummy = cos  # never read when the matching *_NORM / STORE flag is off
    kc, vc, slots = cache if cache is not None else (k, v, dummy)
    _qk_norm_rope_kernel[grid](
        qkv, cos, sin,
        qw.contiguous() if qw is not None else dummy,
        kw.contiguous() if kw is not None else dummy,
        q, k, v, kc, vc, slots,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), k.stride(0), v.stride(0),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        h, kv, float(eps),
        D=d, HALF=half, HB=hb, Q_NORM=qw is not None, K_NORM=kw is not None, STORE=cache is not None,
        PAGE=kc.shape[1] if cache is not None else 1,
        num_warps=4 if hb * half >= 1024 else 2, **launch_options(qkv.device),
    )


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
    qkv, cos, sin = _check(qkv, num_heads, num_kv_heads, head_dim, cos, sin)
    t, h, kv, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    if out is None:
        qdt, kdt, vdt = result_dtypes(qkv, cos, q_norm_weight, k_norm_weight)
        q = torch.empty(t, h, d, dtype=qdt, device=qkv.device)
        k = torch.empty(t, kv, d, dtype=kdt, device=qkv.device)
        v = torch.empty(t, kv, d, dtype=vdt, device=qkv.device)
    else:
        q, k, v = out
        for name, buf, heads in (("q", q, h), ("k", k, kv), ("v", v, kv)):
            if buf.shape != (t, heads, d) or not buf.is_contiguous():
                raise ValueError(f"out {name} must be contiguous [{t}, {heads}, {d}]")
    _launch(qkv, h, kv, d, cos, sin, q_norm_weight, k_norm_weight, eps, q, k, v, None)
    return q, k, v


def cache_fits(k_cache: Tensor, v_cache: Tensor, k_dtype: torch.dtype, v_dtype: torch.dtype,
               num_kv_heads: int, head_dim: int) -> bool:
    """Whether K/V rows of these dtypes can be written into these caches by a fused store with
    the same bits as a separate store: caches [pages, page_size, KV, D] of the rows' own dtypes,
    each slot's KV x D block contiguous (the plain and the flat pools both are)."""
    return all(c.dim() == 4 and tuple(c.shape[2:]) == (num_kv_heads, head_dim) and c.dtype == dt
               and c.stride(3) == 1 and c.stride(2) == head_dim
               for c, dt in ((k_cache, k_dtype), (v_cache, v_dtype)))


def qk_norm_rope_store(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: Tensor, sin: Tensor,
                       q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
                       k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """`qk_norm_rope` whose K and V rows go straight into the paged caches at `slot_mapping`
    (int64 flat slots; a negative slot writes nothing), as `kv_store.store_kv` would write
    them, in the same launch: -> q [T, H, D]. The caches must `cache_fits` the rows."""
    qkv, cos, sin = _check(qkv, num_heads, num_kv_heads, head_dim, cos, sin)
    t, h, kv, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    qdt, kdt, vdt = result_dtypes(qkv, cos, q_norm_weight, k_norm_weight)
    if not cache_fits(k_cache, v_cache, kdt, vdt, kv, d):
        raise ValueError(f"caches {tuple(k_cache.shape)} {k_cache.dtype} / {v_cache.dtype} do not take "
                         f"K ({kdt}) and V ({vdt}) rows of {kv} heads x {d} in place")
    if slot_mapping.shape[0] < t:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {t} rows")
    q = torch.empty(t, h, d, dtype=qdt, device=qkv.device)
    _launch(qkv, h, kv, d, cos, sin, q_norm_weight, k_norm_weight, eps, q, k_cache, v_cache,
            (k_cache, v_cache, slot_mapping))
    return q


@triton.jit
def _context_kv_kernel(
    x_ptr, cos_ptr, sin_ptr, kw_ptr, cache_ptr, slot_ptr,
    stride_x, stride_cos, stride_sin, stride_kw, stride_cl, stride_ck, stride_cp, stride_cs,
    KV, eps,
    D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr, K_NORM: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    nkb = tl.cdiv(KV, HB)
    layer = (blk // (2 * nkb)).to(tl.int64)
    kind = ((blk % (2 * nkb)) // nkb).to(tl.int64)  # 0: K, 1: V
    h0 = (blk % nkb) * HB
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # (a graph bucket's padding row writes nothing)
        src = x_ptr + t * stride_x + (layer * 2 + kind) * KV * D
        dst = cache_ptr + layer * stride_cl + kind * stride_ck + (slot // PAGE) * stride_cp + (slot % PAGE) * stride_cs
        if kind == 0:
            cols = tl.arange(0, HALF)
            cm = cols < D // 2
            cos = tl.load(cos_ptr + t * stride_cos + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
            sin = tl.load(sin_ptr + t * stride_sin + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
            _heads_tile(src, dst, kw_ptr + layer * stride_kw, cos, sin, h0, KV, eps, D, HALF, HB, K_NORM, True)
        else:
            _heads_tile(src, dst, kw_ptr, 0.0, 0.0, h0, KV, eps, D, HALF, HB, False, False)


def context_kv_store(kv_rows: Tensor, cos: Tensor, sin: Tensor, k_norm_weights: Tensor | None, caches: Tensor,
                     slot_mapping: Tensor, eps: float) -> None:
    """The DFlash draft's context write for every layer in one launch: kv_rows [T, L*2*KV*D]
    (per layer l: its K rows then its V rows, the k/v part of layer l's qkv projection) ->
    K (per-head RMSNorm by `k_norm_weights[l]` when given, then RoPE) and V of layer l into
    `caches[l, 0]` / `caches[l, 1]` ([L, 2, pages, page_size, KV, D], a view of the draft
    layers' caches: KVCache.draft_stack) at `slot_mapping` (a negative slot writes nothing).
    Each layer's rows come out as `qk_norm_rope` of that layer then `store_kv` would write them."""
    if caches.dim() != 6 or caches.shape[1] != 2:
        raise ValueError(f"caches must be [L, 2, pages, page_size, KV, D], got {tuple(caches.shape)}")
    n_layers, _, _, page, kv, d = caches.shape
    t = kv_rows.shape[0]
    if kv_rows.dim() != 2 or kv_rows.shape[1] != n_layers * 2 * kv * d or kv_rows.stride(1) != 1:
        raise ValueError(f"kv_rows {tuple(kv_rows.shape)} must be [T, {n_layers} * 2 * {kv} * {d}], unit column stride")
    if caches.dtype != kv_rows.dtype:
        raise ValueError(f"caches {caches.dtype} must have the rows' dtype {kv_rows.dtype}")
    if caches.stride(5) != 1 or caches.stride(4) != d:
        raise ValueError("each slot's KV x D block of the caches must be contiguous")
    if k_norm_weights is not None and tuple(k_norm_weights.shape) != (n_layers, d):
        raise ValueError(f"k_norm_weights {tuple(k_norm_weights.shape)} must be [{n_layers}, {d}]")
    cos, sin = _check_cos_sin(cos, sin, t, d)
    if slot_mapping.shape[0] < t:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {t} rows")
    if t == 0:
        return
    kw = cos if k_norm_weights is None else k_norm_weights.contiguous()  # (never read without a norm)
    half, hb = _half_and_block(kv, kv, d)
    grid = (t, n_layers * 2 * triton.cdiv(kv, hb))
    _context_kv_kernel[grid](
        kv_rows, cos, sin, kw, caches, slot_mapping,
        kv_rows.stride(0), cos.stride(0), sin.stride(0), kw.stride(0),
        caches.stride(0), caches.stride(1), caches.stride(2), caches.stride(3),
        kv, float(eps),
        D=d, HALF=half, HB=hb, K_NORM=k_norm_weights is not None, PAGE=page,
        num_warps=4 if hb * half >= 1024 else 2,
    )
