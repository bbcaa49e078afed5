"""Qwen3ForCausalLM target: per-head q_norm/k_norm before RoPE, no bias."""
from __future__ import annotations

from .config import ModelConfig
from .layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        if cfg.architecture != "Qwen3ForCausalLM":
            raise ValueError(f"Qwen3ForCausalLM cannot be built from a {cfg.architecture} config")
        super().__init__(cfg)
