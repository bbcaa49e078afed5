"""The fast CPU backend's layer loop and draft-context write: the model's decoder layers in as
few torch calls as they take.

A CPU decode step at one request makes ~20 torch calls per layer here, so the step stays bound
by reading the weights rather than by Python: each layer's weights and GEMMs are looked up once
at install (a plain object, no nn.Module attribute lookups, ~1 us each), the norms are torch's
fused rms_norm, q_norm and k_norm run as one op, RoPE as a roll and an addcmul over q and k at
once, and attention is torch's SDPA (`paged_attention_sdpa`). Not batch-invariant: the exact
mode runs the models' reference layers (models/layers.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.layers import DecoderLayer
from ..ops.attention import AttentionMetadata, paged_attention_sdpa, write_kv
from ..ops.norm import RMSNorm, add_rms_norm
from .weights import Gemm


def rms_norm_heads(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """F.rms_norm's math over the last dim of x [..., heads, D] with a weight per head
    ([heads, D], broadcast): several norms (q_norm and k_norm, or every layer's k_norm) in one."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps)) * weight


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, D] (RotaryEmbedding's) -> (cos, sin_signed) [T, 1, D] for `rope`:
    rotate_half(x) * sin == x.roll(D/2, -1) * sin_signed, sin_signed = cat(-sin1, sin2)."""
    half = cos.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)


def rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Neox RoPE of x [..., D] with `rope_tables`' cos and sin_signed (broadcast against x)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


class FastLayer:
    """One decoder layer (models.layers.DecoderLayer) in the fused-residual form: the same
    (sublayer output, residual) in and out, the same math."""

    __slots__ = ("w1", "eps1", "w2", "eps2", "qkv", "o", "gate_up", "down", "qk_norm", "eps",
                 "nh", "nkv", "d", "q_size", "kv_size", "scale", "window")

    def __init__(self, layer: DecoderLayer, gemm_of):
        """gemm_of(linear module) -> its Gemm (the backend's choice of packed form)."""
        attn, mlp = layer.self_attn, layer.mlp
        self.w1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.w2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.qkv, self.o = gemm_of(attn.qkv_proj), gemm_of(attn.o_proj)
        self.gate_up, self.down = gemm_of(mlp.gate_up_proj), gemm_of(mlp.down_proj)
        self.nh, self.nkv, self.d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size, self.scale, self.eps = attn.q_size, attn.kv_size, attn.scale, attn.eps
        self.window = attn.window  # a sliding-window draft layer's window (None: full attention)
        # q_norm and k_norm as one per-head weight [H + KV, D] (rms_norm_heads)
        self.qk_norm = None if attn.q_norm is None else torch.cat(
            (attn.q_norm.weight.expand(self.nh, self.d), attn.k_norm.weight.expand(self.nkv, self.d)))

    def gemms(self) -> list[Gemm]:
        return [self.qkv, self.o, self.gate_up, self.down]

    def __call__(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin_signed: Tensor, meta: AttentionMetadata,
                 kv_layer) -> tuple[Tensor, Tensor]:
        """cos, sin_signed: `rope_tables` ([T, 1, D]). x is the previous layer's fresh output
        (or the embedding, with residual None): updated in place."""
        residual = x if residual is None else x.add_(residual)
        w1 = self.w1
        h = F.rms_norm(residual, w1.shape, w1, self.eps1)
        qkv = self.qkv(h)
        t, nh, nkv, d = qkv.shape[0], self.nh, self.nkv, self.d
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(t, nkv, d)
        qk = qkv[:, :qk_size].view(t, nh + nkv, d)
        if self.qk_norm is not None:
            qk = rms_norm_heads(qk, self.qk_norm, self.eps)
        qk = rope(qk, cos, sin_signed)  # q and k together
        q, k = qk[:, :nh], qk[:, nh:]
        k_cache, v_cache = kv_layer
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention_sdpa(q, k_cache, v_cache, meta, self.scale, self.window)
        h = self.o(o.reshape(t, nh * d))
        residual = h.add_(residual)
        w2 = self.w2
        h = F.rms_norm(residual, w2.shape, w2, self.eps2)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(gate).mul_(up)), residual


class FastStack:
    """A model's decoder layers and final norm: the `run_layers` of a backend (models/backend.py)."""

    def __init__(self, layers, final_norm: RMSNorm, gemm_of):
        self.layers = [FastLayer(layer, gemm_of) for layer in layers]
        self.final_norm = final_norm

    def gemms(self) -> list[Gemm]:
        return [g for layer in self.layers for g in layer.gemms()]

    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_layers,
                   tap_layers: list[int] | None) -> tuple[Tensor, Tensor | None]:
        cos, sin_signed = rope_tables(cos, sin)  # once per pass, shared by every layer
        tapped: dict[int, Tensor] = {}
        wanted = set(tap_layers or ())
        residual = None
        for i, (layer, kv_layer) in enumerate(zip(self.layers, kv_layers)):
            x, residual = layer(x, residual, cos, sin_signed, meta, kv_layer)
            if i in wanted:
                tapped[i] = x + residual
        norm = self.final_norm
        out, _ = add_rms_norm(x, residual, norm.weight, norm.eps)
        taps = torch.cat([tapped[i] for i in tap_layers], dim=-1) if tap_layers else None
        return out, taps


class ConcatGemm:
    """Several GEMMs of one input, their outputs side by side: the context write's k, v rows of
    every layer when they are not packed into one stacked weight (no float32 copy of them)."""

    def __init__(self, gemms: list[Gemm]):
        self.parts = gemms

    @property
    def format(self) -> str:
        return self.parts[0].format

    def __call__(self, x: Tensor) -> Tensor:
        return torch.cat([g(x) for g in self.parts], dim=-1)


class FastContextWrite:
    """DFlashDraftModel.write_context: fc and hidden_norm, then every layer's K and V from one
    GEMM (`kv`: the layers' k, v rows of qkv_proj stacked, [L * 2 * KV * D, H]), the k_norms and
    RoPE over all layers at once, then the cache writes."""

    def __init__(self, draft, fc: Gemm, kv):
        attn = draft.layers[0].self_attn
        self.fc, self.kv, self.rotary = fc, kv, draft.rotary
        self.norm_w, self.norm_eps = draft.hidden_norm.weight, draft.hidden_norm.eps
        self.n_layers, self.nkv, self.d, self.eps = len(draft.layers), attn.num_kv_heads, attn.head_dim, attn.eps
        # every layer's k_norm weight stacked [L, 1, D] (rms_norm_heads)
        self.k_norm = None if attn.k_norm is None else torch.stack(
            [layer.self_attn.k_norm.weight for layer in draft.layers])[:, None]

    def __call__(self, taps: Tensor, positions: Tensor, slot_mapping: Tensor, kv) -> None:
        t = taps.shape[0]
        ctx = F.rms_norm(self.fc(taps), self.norm_w.shape, self.norm_w, self.norm_eps)
        kv_rows = self.kv(ctx).view(t, self.n_layers, 2, self.nkv, self.d)
        k, v = kv_rows[:, :, 0], kv_rows[:, :, 1]  # [T, L, KV, D]
        if self.k_norm is not None:
            k = rms_norm_heads(k, self.k_norm, self.eps)
        cos, sin_signed = rope_tables(*self.rotary(positions, k.dtype))  # [T, 1, D]
        k = rope(k, cos[:, None], sin_signed[:, None])
        for i, (k_cache, v_cache) in enumerate(kv.draft):
            write_kv(k_cache, v_cache, k[:, i], v[:, i], slot_mapping)
