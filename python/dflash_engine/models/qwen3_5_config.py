"""Config of hybrid targets (Qwen3.5): full-attention layers mixed with Gated DeltaNet layers.

Two checkpoint layouts carry the same text model:
- `Qwen3_5ForCausalLM`: the text config at the top level, weights under `model.`;
- `Qwen3_5ForConditionalGeneration` (how Qwen3.5 is published: a vision tower plus the
  language model): the text config under `text_config` (`model_type` "qwen3_5_text"), its
  weights under `model.language_model.`; the vision tower (`model.visual.*`) is ignored.
Multi-token-prediction heads (`mtp.*`) are ignored in both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..ops.partial_rotary import rotary_dim
from .config import ModelConfig, _architecture

HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
# Keys a ConditionalGeneration config may hold at the top level rather than in text_config.
_TOP_LEVEL_FALLBACK = ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "mamba_ssm_dtype")
_STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_hybrid_config(d: dict[str, Any]) -> bool:
    """Whether a config.json dict describes a hybrid target (HybridConfig.from_dict parses it)."""
    return bool(d.get("architectures")) and d["architectures"][0] in HYBRID_ARCHITECTURES


def _default_layer_types(num_layers: int, interval: int) -> list[str]:
    # transformers' default: every `interval`-th layer is full attention
    return [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)]


@dataclass
class HybridConfig(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    attn_output_gate: bool = True  # q_proj also yields a per-head sigmoid gate on the attention output
    mamba_ssm_dtype: str = "float32"  # the recurrent state's dtype
    weight_prefix: str = "model."  # where the text model's tensors sit in the checkpoint

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def rotary_dim(self) -> int:
        return rotary_dim(self.head_dim, self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN short conv: q, k and v of every head."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def state_dtype(self) -> torch.dtype:
        return _STATE_DTYPES[self.mamba_ssm_dtype]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HybridConfig:
        architecture = _architecture(d)
        if architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(f"unsupported hybrid architecture {architecture!r}; "
                             f"supported: {', '.join(HYBRID_ARCHITECTURES)}")
        text, prefix = d, "model."
        if "text_config" in d:
            text = dict(d["text_config"])
            for key in _TOP_LEVEL_FALLBACK:
                if text.get(key) is None and d.get(key) is not None:
                    text[key] = d[key]
            # The top-level flag is the one transformers' ConditionalGeneration ties by.
            if "tie_word_embeddings" in d:
                text["tie_word_embeddings"] = d["tie_word_embeddings"]
            prefix = "model.language_model."
        n = text["num_hidden_layers"]
        layer_types = list(text.get("layer_types") or _default_layer_types(n, text.get("full_attention_interval", 4)))
        unknown = sorted(set(layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown or len(layer_types) != n:
            raise ValueError(f"layer_types must name {n} layers, each {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}; "
                             f"got {len(layer_types)} ({', '.join(unknown) or 'no unknown types'})")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        state_dtype = str(text.get("mamba_ssm_dtype") or "float32").removeprefix("torch.")
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"unsupported mamba_ssm_dtype {state_dtype!r}; choose {', '.join(_STATE_DTYPES)}")
        kw = cls._common(text, architecture)
        cfg = cls(
            **kw,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            attention_bias=bool(text.get("attention_bias", False)),
            layer_types=layer_types,
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            partial_rotary_factor=factor,
            attn_output_gate=bool(text.get("attn_output_gate", True)),
            mamba_ssm_dtype=state_dtype,
            weight_prefix=prefix,
        )
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {cfg.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {cfg.linear_num_key_heads}")
        if cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
            raise ValueError(f"partial_rotary_factor {factor} gives rotary dim {cfg.rotary_dim} of head_dim "
                             f"{cfg.head_dim}; it must be even and in (0, head_dim]")
        return cfg
