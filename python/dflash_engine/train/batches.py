"""Training batches: padded sequences with random anchors on their response tokens, and the
target taps of the samples that were computed once and kept."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .data import Sample


class Batches:
    """Padded batches of sequences with random anchors on their response tokens."""

    def __init__(self, samples: Sequence[Sample], block_size: int, device):
        self.seqs = [torch.tensor(s.ids, dtype=torch.int64) for s in samples]
        self.lo = [len(s.prompt_ids) for s in samples]  # first anchor: the first response token
        self.hi = [len(s.ids) - block_size for s in samples]  # last anchor: a <= len - B
        self.b, self.device = block_size, device
        self.taps: list[Tensor] | None = None  # per sample [len, n_taps*H], when precomputed
        bad = [i for i, (lo, hi) in enumerate(zip(self.lo, self.hi)) if hi < lo]
        if bad:
            raise ValueError(f"{len(bad)} samples have no response anchor (response shorter than the block)")

    def __len__(self) -> int:
        return len(self.seqs)

    def padded(self, rows: Sequence[int]) -> tuple[Tensor, list[int]]:
        lens = [len(self.seqs[r]) for r in rows]
        ids = torch.zeros(len(rows), max(lens), dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, : lens[i]] = self.seqs[r]
        return ids.to(self.device), lens

    @property
    def num_cached(self) -> int:
        """Samples 0..num_cached-1 have their taps kept (precompute_taps)."""
        return 0 if self.taps is None else len(self.taps)

    def batch_taps(self, rows: Sequence[int]) -> Tensor | None:
        if self.taps is None or max(rows) >= len(self.taps):
            return None
        lens = [len(self.seqs[r]) for r in rows]
        out = self.taps[rows[0]].new_zeros(len(rows), max(lens), self.taps[rows[0]].shape[-1])
        for i, r in enumerate(rows):
            out[i, : lens[i]] = self.taps[r]
        return out

    def make(self, rows: Sequence[int], num_anchors: int, gen: torch.Generator
             ) -> tuple[Tensor, Tensor, Tensor, int]:
        """(ids [N, S] zero-padded, anchors [N, A], anchor weights [N, A] (0: padding), tokens)."""
        s = max(len(self.seqs[r]) for r in rows)
        ids = torch.zeros(len(rows), s, dtype=torch.int64)
        anchors = torch.zeros(len(rows), num_anchors, dtype=torch.int64)
        weights = torch.zeros(len(rows), num_anchors)
        for i, r in enumerate(rows):
            ids[i, : len(self.seqs[r])] = self.seqs[r]
            valid = torch.arange(self.lo[r], self.hi[r] + 1)
            pick = valid[torch.randperm(len(valid), generator=gen)[:num_anchors]]
            anchors[i, : len(pick)], weights[i, : len(pick)] = pick, 1.0
            anchors[i, len(pick):] = pick[0]
        d = self.device
        return ids.to(d), anchors.to(d), weights.to(d), sum(len(self.seqs[r]) for r in rows)

