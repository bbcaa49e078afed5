"""Paged K/V writes in Triton: rows k, v scattered into the caches at their slots (the
twin of `dflash_engine.ops.attention.write_kv`). Layout: kernels/attention.py's docstring
(caches ``[num_pages, page_size, n_kv, head_dim]``, slot ``s`` at page ``s // page_size``,
offset ``s % page_size``). A negative slot (a graph bucket's padding row) writes nothing."""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    N_KV: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding row of a graph bucket: writes nothing
        return
    page = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < N_KV
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    tl.store(
        k_cache_ptr + page * stride_kcp + off * stride_kcs + h * stride_kch + d * stride_kcd,
        k.to(k_cache_ptr.dtype.element_ty), mask=mask,
    )
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(
        v_cache_ptr + page * stride_vcp + off * stride_vcs + h * stride_vch + d * stride_vcd,
        v.to(v_cache_ptr.dtype.element_ty), mask=mask,
    )


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter rows k, v ``[T, n_kv, head_dim]`` into caches ``[num_pages, page_size, n_kv,
    head_dim]`` at flat slots ``slot_mapping[t]`` (int64, ``page * page_size + offset``).
    Rows whose slot is negative are skipped. One launch of T programs; capturable."""
    num_tokens, n_kv, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert tuple(k_cache.shape[2:]) == (n_kv, head_dim), (k_cache.shape, k.shape)
    assert slot_mapping.shape[0] >= num_tokens
    page_size = k_cache.shape[1]
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} is not a power of two"
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        N_KV=n_kv, BLOCK_H=triton.next_power_of_2(n_kv), HEAD_DIM=head_dim, PAGE=page_size,
    )
