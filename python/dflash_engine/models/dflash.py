"""DFlash draft model (see shared/design/DFLASH.md).

The target conditions the draft only through context K/V: ctx = hidden_norm(fc(taps)) is
projected by the k/v rows of each layer's qkv_proj (Attention.project_kv: k_norm + RoPE on
K, no input_layernorm, no q) into the draft KV at the committed positions. The block rows
then run as ordinary pre-norm Qwen3 layers attending non-causally over context + block.
"""
from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import dispatch
from ..ops.attention import AttentionMetadata
from ..ops.norm import RMSNorm
from .config import DraftConfig
from .layers import DecoderLayer, Linear, fast_rope, fast_rope_tables, make_rotary, rms_norm_heads, run_layers


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = make_rotary(cfg)
        # The fast CPU mode's packed k, v rows of every layer's qkv_proj, stacked [L * 2 * KV * D, H]
        # (cpu_weights.pack_cpu_weights): the context write in one GEMM.
        self.ctx_kv_packed = None
        self.ctx_k_norm_weight = None  # every layer's k_norm weight stacked [L, 1, D], packed with it

    def write_context(self, taps: Tensor, positions: Tensor, slot_mapping: Tensor, kv) -> None:
        """taps [N, n_taps*H] at absolute `positions` -> draft K/V of every layer at `slot_mapping`."""
        if self.ctx_kv_packed is not None and self.layers[0].fast_cpu(taps):
            return self._write_context_fast_cpu(taps, positions, slot_mapping, kv)
        norm = self.hidden_norm
        ctx = dispatch.rms_norm(self.fc(taps.to(self.fc.weight.dtype)), norm.weight, norm.eps)
        cos, sin = self.rotary(positions, ctx.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv.draft):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            dispatch.store_kv(k_cache, v_cache, k, v, slot_mapping)

    def _write_context_fast_cpu(self, taps: Tensor, positions: Tensor, slot_mapping: Tensor, kv) -> None:
        """`write_context` for the fast CPU mode with packed weights: fc, then every layer's K and
        V from one GEMM, the k_norms and RoPE over all layers at once, then the cache writes."""
        from ..ops.attention import write_kv

        norm, attn = self.hidden_norm, self.layers[0].self_attn
        t, n_layers, nkv, d = taps.shape[0], len(self.layers), attn.num_kv_heads, attn.head_dim
        ctx = F.rms_norm(self.fc.fast(taps), norm.weight.shape, norm.weight, norm.eps)
        kv_rows = self.ctx_kv_packed(ctx).view(t, n_layers, 2, nkv, d)
        k, v = kv_rows[:, :, 0], kv_rows[:, :, 1]  # [T, L, KV, D]
        if attn.k_norm is not None:  # every layer's k_norm at once: weights [L, 1, D]
            k = rms_norm_heads(k, self.ctx_k_norm_weight, attn.eps)
        cos, sin_signed = fast_rope_tables(*self.rotary(positions, k.dtype))  # [T, 1, D]
        k = fast_rope(k, cos[:, None], sin_signed[:, None])
        for i, (k_cache, v_cache) in enumerate(kv.draft):
            write_kv(k_cache, v_cache, k[:, i], v[:, i], slot_mapping)

    def forward(self, input_embeds: Tensor, positions: Tensor, meta: AttentionMetadata, kv) -> Tensor:
        """Block rows -> final-normed hidden. Block K/V land at meta.slot_mapping as scratch."""
        if meta.causal:
            # Draft attention is non-causal by definition (every block row sees the whole block).
            meta = dataclasses.replace(meta, causal=False)
        cos, sin = self.rotary(positions, input_embeds.dtype)
        return run_layers(self.layers, input_embeds, cos, sin, meta, kv.draft, self.norm)[0]
