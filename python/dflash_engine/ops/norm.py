"""RMSNorm with Hugging Face numerics (float32 statistics, weight applied in input dtype)."""
from __future__ import annotations

import torch
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    input_dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(input_dtype)


def zero_centred_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's RMSNorm (transformers' Qwen3_5RMSNorm): statistics and the (1 + weight)
    scale in float32, one rounding to x's dtype at the end."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The fused "residual add + RMSNorm" of a pre-norm decoder layer.

    Returns (rms_norm(x + residual), x + residual); the sum is rounded to the input dtype
    before the norm reads it, as the unfused layer does.
    """
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
