"""The batch-invariant GEMM's numerics in torch: the reference twin of `kernels.gemm.matmul`.

The kernel multiplies x and weight in their dtype with float32 accumulation, adds the bias
to the float32 sum and rounds once to the output dtype. This computes the same function
from float32 copies, so the two agree to float32 summation-order error (the kernel's own
fixed order is what makes it batch-invariant; this twin is only the value to compare with).
"""
from __future__ import annotations

import torch
from torch import Tensor


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype | None = None
           ) -> Tensor:
    """x [..., K] @ weight.T (+ bias) -> [..., N] in `out_dtype` (default: x's dtype)."""
    acc = x.float() @ weight.float().t()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype or x.dtype)
