"""A launched step whose results are on their way to the host (the host/device overlap).

The runner launches all of a step's device work, ending with one non-blocking copy of
(accepted, sampled) into pinned host memory, and records a CUDA event after it. `wait()`
synchronises on that event (the GIL is released meanwhile) and unpacks the host buffer.
Between launch and wait the host is free: the engine turns the previous step's committed
result into outputs there. On CPU the work ran inside the launch; `wait()` just unpacks.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class InFlight:
    def __init__(self, unpack: Callable[[], tuple[np.ndarray, np.ndarray]], device: torch.device):
        self._unpack = unpack
        self._event = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()  # after the step's last launch: its device-to-host copy

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        """(accepted per plan entry, sampled per sample row), as numpy arrays the caller owns."""
        if self._event is not None:
            self._event.synchronize()
        return self._unpack()
