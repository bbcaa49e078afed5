"""SwiGLU activation."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(gate: Tensor, up: Tensor | None = None) -> Tensor:
    """silu(gate) * up.

    With one argument, `gate` is the merged gate_up projection output [..., 2*I] (gate
    first, then up) and the result is [..., I].
    """
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return F.silu(gate) * up
