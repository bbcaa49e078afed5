"""Ticket counters of the kernels whose last program to finish a tile folds the tile's split
partials together (no second launch): the skinny GEMM's split-K reduce (skinny_gemm.py) and
the attention's split combine (attention.py).

Each split adds 1 to its tile's counter after writing its partial (an acq_rel atomic after a
block barrier); the one that sees count - 1 combines and puts the counter back to 0, so the
counters are zero between launches and a CUDA graph can replay them. One buffer per (user,
device), allocated on first use outside a graph capture (a capture allocates from its graph's
private pool); a call that needs more counters than the buffer holds, or the first one inside
a capture, gets None and launches its separate reduce. Launches that share a buffer must not
run concurrently: the engine has one compute stream per device.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["counters"]

_buffers: dict[tuple[str, torch.device], Tensor] = {}


def counters(user: str, device: torch.device, needed: int, size: int) -> Tensor | None:
    """`user`'s int32 counters on `device` (`size` of them, zero), or None (see above)."""
    buf = _buffers.get((user, device))
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _buffers[(user, device)] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf if needed <= buf.numel() else None
