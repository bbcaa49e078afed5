"""A reduced draft vocabulary: the draft proposes only among the target's N most frequent
tokens (speculative_config `draft_vocab_size`).

A DFlash draft shares the target's lm_head, so every draft pass reads the whole [V, H] logits
weight once more: for Qwen3-8B (V = 151,936) 1.24 GB a step, ~7% of the bytes of a c = 1
step and ~0.6 TFLOP of a c = 32 one. Proposing among N rows of it (EAGLE-3's draft
vocabulary, N = 32k for a 128k-152k vocabulary) reads N / V of that. It stays lossless: the
target verifies every proposal as before; a token outside the N can only be proposed by the
target's own bonus token, so acceptance (tau) drops by how often the target's next token is
outside them (measured on the shipped draft: docs/perf.md "Draft vocabulary").

The ranking lives beside the draft's weights, `draft_vocab.json`: the target's token ids,
most frequent first, counted over the target's own answers to the draft's training prompts
(`dflash-engine draft-vocab`, or `train-draft`'s data). The N chosen ids are kept in ascending
order, so a row's argmax over them is the first maximum in token-id order, as over the whole
vocabulary: with N = V the proposals are the full vocabulary's.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FILE = "draft_vocab.json"
FORMAT = "dflash-draft-vocab/1"


def ranking_from_counts(counts: np.ndarray) -> np.ndarray:
    """Token ids by descending count (ties: lower id first); ids never seen come last."""
    counts = np.asarray(counts, dtype=np.int64)
    return np.lexsort((np.arange(len(counts)), -counts)).astype(np.int64)


def count_tokens(sequences: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        ids = np.asarray(list(seq), dtype=np.int64)
        if len(ids):
            counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def write(path: str | Path, counts: np.ndarray, source: str) -> Path:
    """Write the ranking of `counts` (one per token id of the target's vocabulary)."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    ranking = ranking_from_counts(counts)
    seen = int((np.asarray(counts) > 0).sum())
    path.write_text(json.dumps({"format": FORMAT, "vocab_size": len(counts), "tokens_counted": int(np.sum(counts)),
                                "distinct_tokens_seen": seen, "source": source,
                                "token_ids": ranking.tolist()}) + "\n")
    return path


def load(draft_dir: str | Path, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent token ids of the draft's ranking, ascending (int64).
    ValueError naming the problem: no ranking, a size out of range, a ranking that is not a
    permutation of the target's vocabulary."""
    path = Path(draft_dir) / FILE
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"speculative_config.draft_vocab_size must be a positive integer, got {size!r}")
    if size > vocab_size:
        raise ValueError(f"speculative_config.draft_vocab_size ({size}) is larger than the target's vocabulary "
                         f"({vocab_size})")
    if not path.is_file():
        raise ValueError(f"speculative_config.draft_vocab_size needs the draft's token ranking {path} "
                         f"(write it with `dflash-engine draft-vocab TARGET --out {Path(draft_dir)}`)")
    try:
        data = json.loads(path.read_text())
        ids = np.asarray(data["token_ids"], dtype=np.int64)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a draft vocabulary ranking ({type(e).__name__}: {e})") from None
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    if ids.ndim != 1 or len(ids) != vocab_size or not np.array_equal(np.sort(ids), np.arange(vocab_size)):
        raise ValueError(f"{path}: token_ids must rank every id of the target's vocabulary ({vocab_size}) once")
    return np.sort(ids[:size])
