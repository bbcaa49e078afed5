"""AttentionMetadata built from Python lists, for tests (the engine gets slots from the Rust core)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dflash_engine.ops import AttentionMetadata


def meta_from_lists(
    slot_mapping: Sequence[int],
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    causal: bool,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata from host lists; page tables are padded with page 0 (the null page)."""
    qsl = [int(x) for x in query_start_loc]
    lens = [int(x) for x in seq_lens]
    width = max((len(bt) for bt in page_tables), default=0)
    table = torch.zeros((len(page_tables), max(width, 1)), dtype=torch.int32)
    for r, bt in enumerate(page_tables):
        if len(bt):
            table[r, : len(bt)] = torch.as_tensor(list(bt), dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.as_tensor(list(slot_mapping), dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        page_tables=table.to(device),
        causal=causal,
        max_query_len=max((b - a for a, b in zip(qsl, qsl[1:])), default=0),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )


def meta_for_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    page_tables: Sequence[Sequence[int]],
    page_size: int,
    causal: bool,
    device: torch.device | str = "cpu",
) -> tuple[AttentionMetadata, Tensor]:
    """Metadata plus positions for requests whose rows are the last `query_lens[r]`
    positions of their `seq_lens[r]` context. Returns (meta, positions [T] int64)."""
    qsl, slots, positions = [0], [], []
    for q_len, s_len, bt in zip(query_lens, seq_lens, page_tables):
        if q_len > s_len:
            raise ValueError(f"query length {q_len} exceeds sequence length {s_len}")
        if -(-s_len // page_size) > len(bt):
            raise ValueError(f"page table of {len(bt)} pages cannot hold {s_len} tokens")
        for pos in range(s_len - q_len, s_len):
            positions.append(pos)
            slots.append(int(bt[pos // page_size]) * page_size + pos % page_size)
        qsl.append(qsl[-1] + q_len)
    meta = meta_from_lists(slots, qsl, seq_lens, page_tables, causal, device)
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)
