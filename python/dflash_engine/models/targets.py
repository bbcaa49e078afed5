"""The one entry point that loads any target: a dense one (loader.load_target: Llama, Qwen3)
or a hybrid one (qwen3_5.load_qwen3_5: Qwen3.5, attention + Gated DeltaNet layers), chosen
by the checkpoint's architecture (qwen3_5_config.is_hybrid_config)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from . import loader
from .parallel import TPShard
from .qwen3_5 import load_qwen3_5
from .qwen3_5_config import is_hybrid_config


def load_target(path: str | Path, dtype: str | torch.dtype = "auto", device="cpu",
                batch_invariant: bool | None = None, tp: TPShard | None = None) -> nn.Module:
    """batch_invariant: the exact mode's flag (None: `envs.batch_invariant()`), as loader.load_target;
    tp: this rank's shard under tensor parallelism (models/parallel.py)."""
    if is_hybrid_config(loader.read_config(path)):
        return load_qwen3_5(path, dtype, device, batch_invariant, tp)
    return loader.load_target(path, dtype, device, batch_invariant, tp)
