"""Logits and argmax for the fast CPU backend: packed logits refined in float32, and blocked
scans that beat torch's CPU topk / argmax over a wide vocabulary."""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.sampling import greedy as row_argmax  # noqa: F401  (re-exported: the blocked exact argmax)
from .weights import PackedWeight

REFINE_TOP = 8  # logits recomputed in float32 per row (packed_logits)
_SCAN_BLOCK = 128  # columns per block of `row_topk`


def row_topk(x: Tensor, k: int) -> Tensor:
    """The indices of each row's k largest entries of x [M, V] (what x.topk(k).indices holds, up
    to the order among ties at the k-th value), in two passes over blocks of 128 columns: the
    top k elements lie in the k blocks of largest maximum. torch's CPU topk over a 49,152-wide
    row takes ~120 us a row; this ~20. Falls back to topk where V is not whole blocks."""
    m, v = x.shape
    if v % _SCAN_BLOCK or v < 4 * k * _SCAN_BLOCK:
        return x.topk(min(k, v), dim=-1).indices
    blocks = x.view(m, v // _SCAN_BLOCK, _SCAN_BLOCK)
    top = blocks.amax(-1).topk(k, dim=-1).indices  # [M, k] blocks
    cand = blocks.gather(1, top[..., None].expand(m, k, _SCAN_BLOCK)).view(m, k * _SCAN_BLOCK)
    pos = cand.topk(k, dim=-1).indices
    return top.gather(1, pos // _SCAN_BLOCK) * _SCAN_BLOCK + pos % _SCAN_BLOCK


def packed_logits(hidden: Tensor, packed: PackedWeight, weight: Tensor, refine: bool = True) -> Tensor:
    """Float32 logits through the packed (bf16) logits weight, each row's `REFINE_TOP` largest
    recomputed from the float32 `weight` and `hidden`. The bf16 GEMM's output is bf16: at a
    logit of ~25 its step is 0.125, so near-ties (a margin of 0.08 decides the embedded model's
    first answer token to "What is the capital of France?") would tie and flip the greedy choice;
    refined, greedy picks what float32 weights pick unless the bf16 error (~3e-3 relative) pushes
    the winner out of the top 8. The rest of the row keeps the bf16 values (sampling's tail)."""
    logits = packed(hidden).float()
    if refine and logits.shape[0]:
        idx = row_topk(logits, REFINE_TOP)  # [M, k]
        exact = torch.bmm(weight[idx].float(), hidden.float().unsqueeze(-1)).squeeze(-1)  # [M, k]
        logits.scatter_(1, idx, exact)
    return logits


def pack_proposal_weight(weight: Tensor) -> PackedWeight:
    """A logits weight [V, H] rounded to int4 for a draft's proposals (`int4_round`; rows padded
    with zeros to a multiple of 16, the int4 packing's unit: slice the output to V columns). About
    half the bf16 GEMM's time at a K = 3 block, and a proposal is only a guess the target verifies:
    a coarser GEMM moves how often drafts are accepted, never the output."""
    with torch.no_grad():
        pad = -weight.shape[0] % 16
        w = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]) if pad else weight
        return PackedWeight(w, int4=True, rounded=True, bf16=False)
