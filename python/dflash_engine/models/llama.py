"""LlamaForCausalLM target: no q/k norm, optional attention/MLP bias."""
from __future__ import annotations

from .config import ModelConfig
from .layers import CausalLM


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig):
        if cfg.architecture != "LlamaForCausalLM":
            raise ValueError(f"LlamaForCausalLM cannot be built from a {cfg.architecture} config")
        super().__init__(cfg)
