"""The draft's block in a decode step: all D rows it was trained on, whatever K is verified.

A DFlash draft is trained on blocks of D = block_size rows `[bonus, MASK x (D-1)]` whose rows
attend to each other (DFLASH.md). Run in a shorter block it proposes much worse: the shipped
SmolLM2 draft's τ on HumanEval falls from 3.57 (K = 15) to 1.62 at K = 7 in a block of K + 1
rows (docs/perf.md, "Shorter draft blocks"). So a step that verifies B = K + 1 rows still
drafts D rows and keeps the first K proposals (rows 1..K of each draft block).

The scheduler reserves KV for max(B, D) rows past `committed` (`draft_block_rows`): the
draft block's rows are scratch at positions committed .. committed+D-1, in the request's own
pages, never read as context (the context write of committed rows overwrites them).

`draft_block` builds the block's arrays from a step plan on the host (the eager path); the
decode graphs build the same on the device (decode_graph.py, `_draft`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class DraftBlock:
    input_ids: np.ndarray  # [n*D] int64: bonus, then MASK
    positions: np.ndarray  # [n*D] int64: committed .. committed+D-1
    slot_mapping: np.ndarray  # [n*D] int64
    query_start_loc: np.ndarray  # [n+1] int32
    seq_lens: np.ndarray  # [n] int32: committed + D
    page_tables: np.ndarray  # [n, width] int32
    proposal_rows: np.ndarray  # [n*K] int64: rows 1..K of each block (the K proposals)


def draft_block(plan, d: int, mask_token_id: int, page_size: int) -> DraftBlock:
    """The draft pass of `plan`'s decode requests with blocks of max(d, B) rows."""
    n, b = plan.num_decode, plan.block_rows
    if d <= b:  # the verify block itself: the plan's draft views (a prefix of the target pass)
        return DraftBlock(plan.draft_input_ids, plan.draft_positions, plan.draft_slot_mapping,
                          plan.draft_query_start_loc, plan.draft_seq_lens, plan.draft_page_tables,
                          np.asarray(plan.verify_target_rows[:n * (b - 1)], np.int64))
    first = np.asarray(plan.draft_positions[::b][:n], np.int64)  # committed: each block's bonus row
    pos = first[:, None] + np.arange(d)
    tables = np.asarray(plan.draft_page_tables)
    pages = np.take_along_axis(tables, pos // page_size, axis=1).astype(np.int64)
    ids = np.full((n, d), mask_token_id, np.int64)
    ids[:, 0] = plan.draft_input_ids[::b][:n]
    return DraftBlock(
        input_ids=ids.reshape(-1), positions=pos.reshape(-1),
        slot_mapping=(pages * page_size + pos % page_size).reshape(-1),
        query_start_loc=(np.arange(n + 1) * d).astype(np.int32), seq_lens=(first + d).astype(np.int32),
        page_tables=tables, proposal_rows=(np.arange(n)[:, None] * d + np.arange(1, b)).reshape(-1),
    )
