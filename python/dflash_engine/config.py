"""Engine and speculative-decoding configuration (names follow vLLM)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_SPEC_KEYS = {"method", "model", "num_speculative_tokens"}


@dataclass
class SpeculativeConfig:
    model: str
    method: str = "dflash"
    num_speculative_tokens: int | None = None  # default: the draft's block_size - 1

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        unknown = set(value) - _SPEC_KEYS
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (known: {sorted(_SPEC_KEYS)})")
        method = value.get("method", "dflash")
        if method != "dflash":
            raise ValueError(f"speculative_config.method {method!r} is not supported (only 'dflash')")
        if not value.get("model"):
            raise ValueError("speculative_config.model (path to the DFlash draft) is required")
        n = value.get("num_speculative_tokens")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {n!r}")
        return cls(model=str(value["model"]), method=method, num_speculative_tokens=n)


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded SmolLM2
    speculative_config: SpeculativeConfig | None = None
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped at 8192)
    max_num_batched_tokens: int | None = None  # default: 2048
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # GPU: no CUDA graphs (same shapes and tokens, slower)
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        for name in ("max_num_seqs", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
