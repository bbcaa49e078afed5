"""SwiGLU activation."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up
