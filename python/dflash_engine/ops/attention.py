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


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter rows k, v [T, n_kv, head_dim] into caches [num_pages, page_size, n_kv, head_dim]."""
    n_kv, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: Tensor, page_table: Tensor, seq_len: int) -> Tensor:
    """Positions [0, seq_len) of one request: [seq_len, n_kv, head_dim]."""
    page_size = cache.shape[1]
    pages = page_table[: -(-seq_len // page_size)].long()
    return cache[pages].flatten(0, 1)[:seq_len]


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """q [T, n_heads, head_dim] -> [T, n_heads, head_dim]; softmax in float32."""
    n_heads = q.shape[1]
    out = torch.empty_like(q)
    qsl, seq_lens = meta.host_lists()
    for r in range(len(seq_lens)):
        start, end = qsl[r], qsl[r + 1]
        seq_len = seq_lens[r]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, meta.page_tables[r], seq_len).float()
        v = gather_kv(v_cache, meta.page_tables[r], seq_len).float()
        groups = n_heads // k.shape[1]
        k = k.repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, S, D]
        v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
        qr = q[start:end].float().transpose(0, 1)  # [H, Q, D]
        scores = torch.matmul(qr, k.transpose(1, 2)) * scale  # [H, Q, S]
        if meta.causal:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            k_pos = torch.arange(seq_len, device=q.device)
            scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


# --------------------------------------------------------------------------- fast CPU path

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)  # enable_gqa


def _sdpa_plan(meta: AttentionMetadata, page_size: int, device
               ) -> list[tuple[int, int, Tensor | slice, Tensor | None]]:
    """Per request with query rows: (first row, end row, slots of positions [0, seq_len) (a
    slice when its pages are consecutive), causal mask [q_len, seq_len] or None). Built once per step (cached on `meta`) and shared
    by every layer."""
    cached = meta.__dict__.get("_sdpa_plan")
    if cached is not None and cached[0] == page_size:
        return cached[1]
    qsl, seq_lens = meta.host_lists()
    offsets = torch.arange(page_size, device=device)
    plan = []
    for r, seq_len in enumerate(seq_lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        pages = meta.page_tables[r, : -(-seq_len // page_size)].long()
        first = int(pages[0])
        if bool((pages == torch.arange(first, first + len(pages), device=device)).all()):
            slots = slice(first * page_size, first * page_size + seq_len)  # consecutive pages: a view
        else:
            slots = (pages[:, None] * page_size + offsets).flatten()[:seq_len]
        mask = None
        q_len = end - start
        if meta.causal and q_len > 1:  # a query row sees keys up to its own position
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        plan.append((start, end, slots, mask))
    meta.__dict__["_sdpa_plan"] = (page_size, plan)
    return plan


def paged_attention_sdpa(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """The same attention as `paged_attention`, for the fast CPU mode: torch's fused
    scaled_dot_product_attention per request (GQA without repeating K/V), the gather
    indices and masks built once per step. Not bit-identical to the reference loop (nor
    batch-invariant by contract): the exact mode uses `paged_attention`."""
    n_kv, head_dim = k_cache.shape[-2:]
    kf, vf = k_cache.view(-1, n_kv, head_dim), v_cache.view(-1, n_kv, head_dim)
    plan = _sdpa_plan(meta, k_cache.shape[1], q.device)
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
