"""Rotary position embeddings (neox rotate-half) with the Hugging Face scaling variants.

Inverse frequencies follow transformers' modeling_rope_utils exactly for the rope types
"default", "linear", "llama3" and "yarn" (including yarn's attention factor).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .attention import write_kv
from .norm import rms_norm

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def _base_inv_freq(head_dim: int, theta: float) -> Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta ** exponents)


def _llama3_inv_freq(inv_freq: Tensor, s: dict[str, Any]) -> Tensor:
    factor = s["factor"]
    low_freq_factor, high_freq_factor = s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    head_dim: int, theta: float, s: dict[str, Any], max_position_embeddings: int
) -> tuple[Tensor, float]:
    original_max = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = torch.clamp((dims - low) / (high - low), 0, 1)

    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[Tensor, float]:
    """(inv_freq [head_dim/2] float32 on CPU, attention scaling applied to cos/sin)."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, rope_theta, rope_scaling, max_position_embeddings)
    inv_freq = _base_inv_freq(head_dim, rope_theta)
    if rope_type == "linear":
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    return inv_freq, 1.0


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] (already in x's dtype)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary absolute int64 positions."""

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None = None,
        max_position_embeddings: int = 2048,
    ):
        super().__init__()
        inv_freq, self.attention_scaling = compute_inv_freq(
            head_dim, rope_theta, rope_scaling, max_position_embeddings
        )
        # A plain attribute, not a buffer: it stays float32, out of state_dict, and survives
        # meta-device construction in the loader.
        self.inv_freq = inv_freq
        self._inv_freq_by_device: dict[torch.device, Tensor] = {}

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        if device not in self._inv_freq_by_device:
            self._inv_freq_by_device[device] = self.inv_freq.to(device)
        return self._inv_freq_by_device[device]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq_on(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def qk_norm_rope(
    qkv: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: Tensor,
    sin: Tensor,
    q_norm_weight: Tensor | None,
    k_norm_weight: Tensor | None,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Split a merged projection qkv [T, (H + 2*KV) * D] into contiguous q [T, H, D],
    k [T, KV, D], v [T, KV, D]; per-head RMSNorm on q and k where a weight is given
    (Qwen3's q_norm/k_norm; Llama has none), then neox RoPE on q and k.

    cos/sin: [T, D] as RotaryEmbedding returns them, or their first half [T, D/2].
    The same math as Attention.project_q / project_kv.
    """
    t = qkv.shape[0]
    q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    if qkv.shape[-1] != q_dim + 2 * kv_dim:
        raise ValueError(f"qkv width {qkv.shape[-1]} != (H + 2*KV) * D = {q_dim + 2 * kv_dim}")
    if cos.shape[-1] == head_dim // 2:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    q = qkv[:, :q_dim].reshape(t, num_heads, head_dim)
    k = qkv[:, q_dim:q_dim + kv_dim].reshape(t, num_kv_heads, head_dim)
    v = qkv[:, q_dim + kv_dim:].reshape(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q = rms_norm(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm(k, k_norm_weight, eps)
    return (apply_rotary(q, cos, sin).contiguous(), apply_rotary(k, cos, sin).contiguous(),
            v.contiguous())


def context_kv_store(kv_rows: Tensor, cos: Tensor, sin: Tensor, k_norm_weights: Tensor | None, caches: Tensor,
                     slot_mapping: Tensor, eps: float) -> None:
    """The DFlash draft's context write for every layer at once: kv_rows [T, L*2*KV*D] (per
    layer: its K rows, then its V rows) -> layer l's K (per-head RMSNorm by
    `k_norm_weights[l]` when given, then RoPE) and V into `caches[l, 0]` / `caches[l, 1]`
    ([L, 2, pages, page_size, KV, D]) at `slot_mapping`. The per-layer math of
    Attention.project_kv + write_kv."""
    n_layers, _, _, _, kv, d = caches.shape
    t = kv_rows.shape[0]
    for layer, rows in enumerate(kv_rows.view(t, n_layers, 2, kv, d).unbind(1)):
        k, v = rows.unbind(1)
        if k_norm_weights is not None:
            k = rms_norm(k, k_norm_weights[layer], eps)
        write_kv(caches[layer, 0], caches[layer, 1], apply_rotary(k, cos, sin), v, slot_mapping)
