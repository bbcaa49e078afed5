"""Paged KV writes and paged attention: the torch reference path.

The reference loops over requests so that a request's result never depends on
which other requests share the batch (bit-identical outputs alone or batched).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # [T] int64: where row t's K/V is written (page*block_size + offset)
    query_start_loc: Tensor  # [R+1] int32: rows of request r are [qsl[r], qsl[r+1])
    seq_lens: Tensor  # [R] int32: context length of request r after this step's rows
    block_tables: Tensor  # [R, max_pages] int32, padded with page 0 (the null page)
    causal: bool
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def from_lists(
        cls,
        slot_mapping: Sequence[int],
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        causal: bool,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Build from host lists (or numpy arrays); block tables are padded with page 0."""
        qsl = [int(x) for x in query_start_loc]
        lens = [int(x) for x in seq_lens]
        width = max((len(bt) for bt in block_tables), default=0)
        table = torch.zeros((len(block_tables), max(width, 1)), dtype=torch.int32)
        for r, bt in enumerate(block_tables):
            if len(bt):
                table[r, : len(bt)] = torch.as_tensor(list(bt), dtype=torch.int32)
        return cls(
            slot_mapping=torch.as_tensor(list(slot_mapping), dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            causal=causal,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )

    @classmethod
    def for_batch(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        causal: bool,
        device: torch.device | str = "cpu",
    ) -> tuple["AttentionMetadata", Tensor]:
        """Metadata plus positions for requests whose rows are the last `query_lens[r]`
        positions of their `seq_lens[r]` context. Returns (meta, positions [T] int64)."""
        qsl, slots, positions = [0], [], []
        for q_len, s_len, bt in zip(query_lens, seq_lens, block_tables):
            if q_len > s_len:
                raise ValueError(f"query length {q_len} exceeds sequence length {s_len}")
            if -(-s_len // block_size) > len(bt):
                raise ValueError(f"block table of {len(bt)} pages cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                positions.append(pos)
                slots.append(int(bt[pos // block_size]) * block_size + pos % block_size)
            qsl.append(qsl[-1] + q_len)
        meta = cls.from_lists(slots, qsl, seq_lens, block_tables, causal, device)
        return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Scatter rows k, v [T, n_kv, head_dim] into caches [num_pages, block_size, n_kv, head_dim]."""
    n_kv, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, n_kv, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """Positions [0, seq_len) of one request: [seq_len, n_kv, head_dim]."""
    block_size = cache.shape[1]
    pages = block_table[: -(-seq_len // block_size)].long()
    return cache[pages].flatten(0, 1)[:seq_len]


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """q [T, n_heads, head_dim] -> [T, n_heads, head_dim]; softmax in float32."""
    n_heads = q.shape[1]
    out = torch.empty_like(q)
    for r in range(meta.num_requests):
        start, end = meta.query_start_loc_cpu[r], meta.query_start_loc_cpu[r + 1]
        seq_len = meta.seq_lens_cpu[r]
        q_len = end - start
        if q_len == 0:
            continue
        k = gather_kv(k_cache, meta.block_tables[r], seq_len).float()
        v = gather_kv(v_cache, meta.block_tables[r], seq_len).float()
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
