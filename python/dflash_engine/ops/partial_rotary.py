"""Partial RoPE: rotate the first `rotary_dim` dims of each head, pass the rest through.

Qwen3.5 rotates a quarter of each attention head (`partial_rotary_factor` 0.25); the rotated
part uses neox rotate-half within itself, with inverse frequencies computed for
`rotary_dim` (RotaryEmbedding(rotary_dim, ...) gives the matching cos/sin).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .rotary import apply_rotary


def rotary_dim(head_dim: int, partial_rotary_factor: float) -> int:
    """transformers' rule: int(head_dim * factor)."""
    return int(head_dim * partial_rotary_factor)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim]; cos/sin [T, rotary_dim] in x's dtype."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat((apply_rotary(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
