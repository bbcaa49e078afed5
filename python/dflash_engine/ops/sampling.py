"""Sampling with per-request parameters; randomness keyed by (seed, position).

Every random row draws one uniform number from a hash of its request's seed and the
absolute position it samples for, then inverts the CDF of the filtered distribution.
Consequences worth the design: a request's sampled tokens do not depend on which other
requests share the batch, and with DFlash on they are the very tokens spec-off decoding
samples (an accepted draft token equals the target's sample at that position, and the
sample at a position only depends on the prefix and the position). Speculation is then
lossless by construction, not only in distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    # x * c mod 2^32 without overflowing int64 (split c into 16-bit halves).
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xorshift-multiply), on non-negative int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_from(seed: Tensor, position: Tensor) -> Tensor:
    """Deterministic uniform in [0, 1) (float64, 53 bits) per (seed, position) pair."""
    seed_lo, seed_hi = seed & _M32, (seed >> 32) & _M32
    a = _mix32((position + 0x9E3779B9) & _M32)
    b = _mix32(a ^ seed_lo)
    c = _mix32(b ^ seed_hi)
    d = _mix32(c ^ 0x68E31DA4)
    return ((c << 21) + (d >> 11)).double() / float(1 << 53)


@dataclass
class SamplingTensors:
    """Per sampled row: the owning request's parameters, built by the engine each step."""

    greedy: Tensor  # [N] bool
    temperature: Tensor  # [N] float32
    top_k: Tensor  # [N] int64, vocab size when off
    top_p: Tensor  # [N] float32
    min_p: Tensor  # [N] float32
    seed: Tensor  # [N] int64 (non-negative)
    position: Tensor  # [N] int64: position of the token being sampled

    @classmethod
    def from_numpy(cls, arrays: dict[str, np.ndarray], device: torch.device) -> SamplingTensors:
        return cls(**{k: torch.from_numpy(v).to(device) for k, v in arrays.items()})


def sample(logits: Tensor, st: SamplingTensors) -> Tensor:
    """logits [N, V] float32 -> tokens [N] int64."""
    out = logits.argmax(dim=-1)
    rand = (~st.greedy).nonzero().squeeze(1)
    if rand.numel() == 0:
        return out
    lg = logits[rand] / st.temperature[rand, None]
    sorted_lg, order = lg.sort(dim=-1, descending=True, stable=True)
    vocab = lg.shape[-1]
    ranks = torch.arange(vocab, device=lg.device)
    sorted_lg = sorted_lg.masked_fill(ranks[None, :] >= st.top_k[rand, None], float("-inf"))
    probs = torch.softmax(sorted_lg, dim=-1)
    cum = probs.cumsum(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays).
    drop = (cum - probs) >= st.top_p[rand, None]
    drop |= probs < st.min_p[rand, None] * probs[:, :1]
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    cdf = probs.double().cumsum(dim=-1)
    u = uniform_from(st.seed[rand], st.position[rand]).to(cdf.device) * cdf[:, -1]
    idx = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=vocab - 1)
    out[rand] = order.gather(1, idx).squeeze(1)
    return out


def accept(draft_tokens: Tensor, target_tokens: Tensor) -> Tensor:
    """draft [n, B-1], target [n, B] int64 -> accepted [n] int64: the number of leading i
    with draft[:, i] == target[:, i] (d_{i+1} == t_i: draft i+1 stands where the target sampled t_i)."""
    n, drafts = draft_tokens.shape
    if target_tokens.shape != (n, drafts + 1):
        raise ValueError(f"target_tokens {tuple(target_tokens.shape)} must be [{n}, {drafts + 1}]")
    miss = draft_tokens != target_tokens[:, :drafts]
    if drafts == 0:
        return torch.zeros(n, dtype=torch.int64, device=draft_tokens.device)
    first_miss = miss.to(torch.int8).argmax(dim=1)  # first mismatch (0 when there is none)
    return torch.where(miss.any(dim=1), first_miss, torch.full_like(first_miss, drafts)).to(torch.int64)


_SYNTHETIC_SALT = 0x5EED_AC1D


def synthetic_accept(drafts: Tensor, sampled: Tensor, seed: Tensor, position: Tensor, rates: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """Benchmark-only acceptance: draft position i (1-based) is accepted when a uniform keyed by
    (request seed, its position) falls below rates[i-1] and every earlier one was accepted.

    drafts [n, B-1], sampled [n, B] (the target's t_0..t_{B-1}), seed [n], position [n] (the
    bonus row's position), rates [>= B-1] float64 -> (accepted [n], tokens [n, B]) where tokens
    puts the accepted drafts d_1..d_a in rows 0..a-1 (the rows the commit appends) followed by
    the target's t_a. The target KV of rows 1..a already holds exactly d_1..d_a (they were its
    inputs), so the committed state stays consistent. Capturable (integer ops, no sync)."""
    n, k = drafts.shape
    rates = rates[:k]  # a shorter block of the draft-length schedule: its first k positions
    steps = torch.arange(1, k + 1, device=drafts.device)
    u = uniform_from((seed[:, None] ^ _SYNTHETIC_SALT), position[:, None] + steps).to(rates.device)
    accepted = (u < rates[None, :]).long().cumprod(dim=1).sum(dim=1)
    take = steps[None, :] <= accepted[:, None]
    tokens = sampled.clone()
    tokens[:, :k] = torch.where(take, drafts, sampled[:, :k])
    return accepted, tokens


_SCAN_BLOCK = 128  # columns per block of `greedy`'s scan


def greedy(logits: Tensor) -> Tensor:
    """logits.argmax(-1) for [M, V], exactly (the first index of each row's maximum). On the
    CPU through the blocks' maxima: torch's CPU argmax over a 49,152-wide row takes ~4x amax's
    time, and an all-greedy step samples nothing else."""
    m, v = logits.shape
    if logits.device.type != "cpu" or v % _SCAN_BLOCK or v < 4 * _SCAN_BLOCK or m == 0:
        return logits.argmax(-1)
    blocks = logits.view(m, v // _SCAN_BLOCK, _SCAN_BLOCK)
    b = blocks.amax(-1).argmax(-1)  # the first block holding the row's maximum
    inner = blocks[torch.arange(m), b].argmax(-1)
    return b * _SCAN_BLOCK + inner
