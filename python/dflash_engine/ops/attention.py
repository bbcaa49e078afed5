"""Paged KV writes and paged attention: the torch reference path.

The reference loops over requests so that a request's result never depends on
which other requests share the batch (bit-identical outputs alone or batched).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    """Device tensors plus static maxima: what a kernel launch (and a CUDA graph) needs.
    The host lists are only for the reference loop; they are derived when absent."""

    slot_mapping: Tensor  # [T] int64: where row t's K/V is written (page*page_size + offset; < 0: nowhere)
    query_start_loc: Tensor  # [R+1] int32: rows of request r are [qsl[r], qsl[r+1])
    seq_lens: Tensor  # [R] int32: context length of request r after this step's rows
    page_tables: Tensor  # [R, max_pages] int32, padded with page 0 (the null page)
    causal: bool
    max_query_len: int  # >= every request's q_len (fixes kernel grids)
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None

    def host_lists(self) -> tuple[list[int], list[int]]:
        if self.query_start_loc_cpu is None or self.seq_lens_cpu is None:
            self.query_start_loc_cpu = self.query_start_loc.tolist()
            self.seq_lens_cpu = self.seq_lens.tolist()
        return self.query_start_loc_cpu, self.seq_lens_cpu


# ------------------------------------------------------------------- sliding windows
# A layer with window W (a DFlash draft's "sliding_attention" layers) lets a query at position
# p see the keys at positions [p - W + 1, p + W - 1] (within what the mask allows otherwise:
# causal [0, p], non-causal [0, seq_len)). This is transformers' reading: its masks keep
# `kv_idx > q_idx - sliding_window` (masking_utils.sliding_window_overlay: W keys up to and
# including p), and its flash-attention path, the one the DFlash reference drafts run
# non-causally, passes window_size=(W - 1, W - 1), which also caps the keys after p at
# p + W - 1 (only block rows lie after p, so a window >= the block size never cuts them).


def window_start(position: int, window: int | None) -> int:
    """The first key position a query at `position` reads under `window` (None: 0)."""
    return 0 if window is None else max(0, position - window + 1)


def dead_positions(committed: int, windows) -> int:
    """Leading context positions that layers with `windows` (None: full attention) never read
    again once a request has `committed` tokens: its next query (the draft block's first row)
    sits at `committed` and later ones only further on. The minimum over the layers."""
    return min((window_start(committed, w) for w in windows), default=0)


def _window_mask(q_pos: Tensor, k_pos: Tensor, causal: bool, window: int | None) -> Tensor | None:
    """[Q, S] bool: which keys each query row sees; None when it sees all of them."""
    if not causal and window is None:
        return None
    d = k_pos[None, :] - q_pos[:, None]  # key minus query position
    mask = torch.ones_like(d, dtype=torch.bool)
    if causal:
        mask &= d <= 0
    if window is not None:
        mask &= (d > -window) & (d < window)
    return mask


def _rows_view(cache: Tensor) -> Tensor | None:
    """The cache as [num_pages * page_size, n_kv, head_dim] without a copy, or None when its
    pages are strided apart (a hybrid target's flat pool: KVCache.allocate(flat=True))."""
    if cache.stride(0) != cache.shape[1] * cache.stride(1):
        return None
    return cache.view(-1, *cache.shape[2:])


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter rows k, v [T, n_kv, head_dim] into caches [num_pages, page_size, n_kv, head_dim]."""
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = _rows_view(cache)
        if rows is not None:
            rows.index_copy_(0, slot_mapping, x.to(cache.dtype))
        else:
            page_size = cache.shape[1]
            cache[slot_mapping // page_size, slot_mapping % page_size] = x.to(cache.dtype)


def gather_kv(cache: Tensor, page_table: Tensor, seq_len: int, first: int = 0) -> Tensor:
    """Positions [first, seq_len) of one request: [seq_len - first, n_kv, head_dim]. Pages
    wholly before `first` are not read."""
    page_size = cache.shape[1]
    first_page = first // page_size
    pages = page_table[first_page: -(-seq_len // page_size)].long()
    return cache[pages].flatten(0, 1)[first - first_page * page_size: seq_len - first_page * page_size]


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
    window: int | None = None,
) -> Tensor:
    """q [T, n_heads, head_dim] -> [T, n_heads, head_dim]; softmax in float32. `window`: the
    layer's sliding window (see window_start); keys before the first row's window are not read."""
    n_heads = q.shape[1]
    out = torch.empty_like(q)
    qsl, seq_lens = meta.host_lists()
    for r in range(len(seq_lens)):
        start, end = qsl[r], qsl[r + 1]
        seq_len = seq_lens[r]
        q_len = end - start
        if q_len == 0:
            continue
        first = window_start(seq_len - q_len, window)
        k = gather_kv(k_cache, meta.page_tables[r], seq_len, first).float()
        v = gather_kv(v_cache, meta.page_tables[r], seq_len, first).float()
        groups = n_heads // k.shape[1]
        k = k.repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
        qr = q[start:end].float().transpose(0, 1)  # [H, Q, D]
        scores = torch.matmul(qr, k.transpose(1, 2)) * scale  # [H, Q, S]
        mask = _window_mask(torch.arange(seq_len - q_len, seq_len, device=q.device),
                            torch.arange(first, seq_len, device=q.device), meta.causal, window)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


# --------------------------------------------------------------------------- fast CPU path

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)  # enable_gqa


def _sdpa_plan(meta: AttentionMetadata, page_size: int, device, window: int | None = None
               ) -> list[tuple[int, int, Tensor | slice, Tensor | None]]:
    """Per request with query rows: (first row, end row, slots of the positions it reads,
    [window_start of its first row, seq_len) (a slice when their pages are consecutive), mask
    [q_len, keys] or None). Built once per step and window (cached on `meta`) and shared by
    every layer of that window."""
    plans = meta.__dict__.setdefault("_sdpa_plans", {})
    cached = plans.get((page_size, window))
    if cached is not None:
        return cached
    qsl, seq_lens = meta.host_lists()
    offsets = torch.arange(page_size, device=device)
    plan = []
    for r, seq_len in enumerate(seq_lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        q_len = end - start
        lo = window_start(seq_len - q_len, window)
        pages = meta.page_tables[r, lo // page_size: -(-seq_len // page_size)].long()
        base, n = lo - lo // page_size * page_size, seq_len - lo
        first = int(pages[0])
        if bool((pages == torch.arange(first, first + len(pages), device=device)).all()):
            slots = slice(first * page_size + base, first * page_size + base + n)  # consecutive pages: a view
        else:
            slots = (pages[:, None] * page_size + offsets).flatten()[base: base + n]
        mask = None
        if q_len > 1 or window is not None:
            mask = _window_mask(torch.arange(seq_len - q_len, seq_len, device=device),
                                torch.arange(lo, seq_len, device=device), meta.causal, window)
        plan.append((start, end, slots, mask))
    plans[(page_size, window)] = plan
    return plan


def paged_attention_sdpa(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
    window: int | None = None,
) -> Tensor:
    """The same attention as `paged_attention`, for the fast CPU mode: torch's fused
    scaled_dot_product_attention per request (GQA without repeating K/V), the gather
    indices and masks built once per step. Not bit-identical to the reference loop (nor
    batch-invariant by contract): the exact mode uses `paged_attention`."""
    n_kv, head_dim = k_cache.shape[-2:]
    kf, vf = _rows_view(k_cache), _rows_view(v_cache)
    if kf is None or vf is None:
        raise ValueError("the fast CPU attention needs page-contiguous K/V caches (not a hybrid's flat pool)")
    plan = _sdpa_plan(meta, k_cache.shape[1], q.device, window)
    out = torch.empty_like(q) if len(plan) != 1 or plan[0][1] - plan[0][0] != q.shape[0] else None
    for start, end, slots, mask in plan:
        if isinstance(slots, slice):
            k, v = kf[slots].transpose(0, 1), vf[slots].transpose(0, 1)  # [n_kv, S, D]
        else:
            k, v = kf.index_select(0, slots).transpose(0, 1), vf.index_select(0, slots).transpose(0, 1)
        if _SDPA_GQA:
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            groups = q.shape[1] // n_kv
            o = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0),
                attn_mask=mask, scale=scale)
        o = o.transpose(0, 1)  # [Q, n_heads, D]
        if out is None:
            return o
        out[start:end] = o
    return out if out is not None else torch.empty_like(q)
