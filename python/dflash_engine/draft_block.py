"""The draft's block in a decode step: all D rows it was trained on, whatever K is verified.

A DFlash draft is trained on blocks of D = block_size rows `[bonus, MASK x (D-1)]` whose rows
attend to each other (DFLASH.md). Run in a shorter block it proposes much worse: the shipped
SmolLM2 draft's τ on HumanEval falls from 3.57 (K = 15) to 1.62 at K = 7 in a block of K + 1
rows (docs/perf.md, "Shorter draft blocks"). So a step that verifies B = K + 1 rows still
drafts D rows and keeps the first K proposals (rows 1..K of each draft block).

The scheduler reserves KV for max(B, D) rows past `committed` (`draft_block_rows`): the
draft block's rows are scratch at positions committed .. committed+D-1, in the request's own
pages, never read as context (the context write of committed rows overwrites them).

`draft_block` builds the block from each request's first verify row and page table, on the
device: the eager path (model_runner.py) and the decode graphs (decode_graph.py) both use it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DraftBlock:
    input_ids: Tensor  # [n*D] int64: bonus, then MASK
    positions: Tensor  # [n*D] int64: committed .. committed+D-1
    slot_mapping: Tensor  # [n*D] int64 (-1: a padding request's rows, written nowhere)
    query_start_loc: Tensor  # [n+1] int32
    seq_lens: Tensor  # [n] int32: committed + D (0: padding)
    proposal_rows: Tensor  # [n*(B-1)] int64: rows 1..B-1 of each block (the K proposals)


def draft_block(committed: Tensor, bonus: Tensor, page_tables: Tensor, d: int, b: int, page_size: int,
                mask_token_id: int, live: Tensor | None = None) -> DraftBlock:
    """The D-row draft blocks of n decode requests: committed [n] (the bonus row's position),
    bonus [n] (its token), page_tables [n, width] (covering committed + D), B = K + 1 (the
    verify block); live [n] bool marks real requests (None: all are)."""
    n, dev = committed.shape[0], committed.device
    pos = committed[:, None] + torch.arange(d, device=dev)
    pages = torch.gather(page_tables, 1, (pos // page_size).clamp(max=page_tables.shape[1] - 1)).long()
    slots = pages * page_size + pos % page_size
    seq_lens = committed + d
    if live is not None:
        slots = torch.where(live[:, None], slots, -1)
        seq_lens = torch.where(live, seq_lens, 0)
    ids = torch.cat([bonus[:, None], torch.full((n, d - 1), mask_token_id, dtype=torch.int64, device=dev)], 1)
    steps = torch.arange(n + 1, device=dev)
    return DraftBlock(
        input_ids=ids.reshape(-1), positions=pos.reshape(-1), slot_mapping=slots.reshape(-1),
        query_start_loc=(steps * d).to(torch.int32), seq_lens=seq_lens.to(torch.int32),
        proposal_rows=(steps[:n, None] * d + torch.arange(1, b, device=dev)).reshape(-1),
    )
