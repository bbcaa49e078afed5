"""The GEMM of every Linear layer and of the logits: plain, or the exact (batch-invariant) mode.

The mode is a per-model flag (`models.layers.set_batch_invariant`, set by the loader from the
engine's resolved configuration), passed in by the caller: nothing here reads the environment.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ROWS = 16  # rows per fixed-shape GEMM of the exact mode on CPU


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight.T, each row's bits independent of M on CPU.

    CPU BLAS picks its kernel (GEMV vs GEMM, blocking) from the row count, so a plain
    F.linear gives a request different bits alone and batched. Here every row goes through
    the same fixed-shape GEMM: 16-row blocks, the last one zero-padded. The weight is read
    once per block and never copied. Other devices use F.linear.
    """
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    m, k = x.shape
    wt = weight.t()
    out = x.new_empty(m, wt.shape[1])
    for i in range(0, m, ROWS):
        blk = x[i:i + ROWS]
        n = blk.shape[0]
        if n < ROWS:
            blk = torch.cat([blk, blk.new_zeros(ROWS - n, k)])
        out[i:i + n] = torch.mm(blk, wt)[:n]
    return out if bias is None else out + bias


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, batch_invariant: bool) -> Tensor:
    """x @ weight.T (+ bias): `invariant_linear` in the exact mode, F.linear otherwise."""
    if batch_invariant:
        return invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)
