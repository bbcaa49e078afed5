"""Torch reference ops (GPU kernels plug in behind the same functions)."""
from .activation import silu_and_mul
from .attention import AttentionMetadata, paged_attention, write_kv
from .norm import RMSNorm, rms_norm
from .rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

__all__ = [
    "AttentionMetadata",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "compute_inv_freq",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]
