"""DFlash draft model: a block-diffusion draft conditioned on the target's hidden states.

The target conditions the draft only through context K/V: ctx = hidden_norm(fc(taps)) is
projected by the k/v rows of each layer's qkv_proj (Attention.project_kv: k_norm + RoPE on
K, no input_layernorm, no q) into the draft KV at the committed positions. The block rows
then run as ordinary pre-norm Qwen3 layers attending non-causally over context + block.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ..ops import dispatch
from ..ops.attention import AttentionMetadata
from ..ops.norm import RMSNorm
from .backend import DraftBackend
from .config import DraftConfig
from .layers import DecoderLayer, Linear, make_rotary, run_layers


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        for layer, window in zip(self.layers, cfg.layer_windows):  # sliding_attention layers: their window
            layer.self_attn.window = window
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.rotary = make_rotary(cfg)
        self.backend: DraftBackend | None = None  # a runtime backend's layer loop and context write (backend.py)
        # (every layer's k/v projection rows [L*2*KV*D, H], their bias, k_norm weights [L, D]):
        # the context write as one GEMM and one launch (stack_context_weights); None: per layer
        self.context_kv: tuple[Tensor, Tensor | None, Tensor | None] | None = None

    def stack_context_weights(self) -> None:
        """Copy every layer's k/v projection rows into one weight, so that the context write
        is one GEMM and one norm + RoPE + store launch for all layers (`write_context`) instead
        of ~8 launches per layer. Call once the weights are final (loaded, on their device);
        the copy's bytes are the layers' k/v rows (84 MB for a 5-layer Qwen3-8B draft)."""
        attn = [layer.self_attn for layer in self.layers]
        with torch.no_grad():
            w = torch.cat([a.qkv_proj.weight[a.q_size:] for a in attn])
            bias = None if attn[0].qkv_proj.bias is None else torch.cat([a.qkv_proj.bias[a.q_size:] for a in attn])
            kw = None if attn[0].k_norm is None else torch.stack([a.k_norm.weight for a in attn])
        self.context_kv = (w, bias, kw)

    def write_context(self, taps: Tensor, positions: Tensor, slot_mapping: Tensor, kv) -> None:
        """taps [N, n_taps*H] at absolute `positions` -> draft K/V of every layer at `slot_mapping`."""
        if self.backend is not None:
            return self.backend.write_context(taps, positions, slot_mapping, kv)
        norm = self.hidden_norm
        ctx = dispatch.rms_norm(self.fc(taps.to(self.fc.weight.dtype)), norm.weight, norm.eps)
        cos, sin = self.rotary(positions, ctx.dtype)
        stack = None
        if self.context_kv is not None and dispatch.FUSED_KV_STORE and not self.fc.batch_invariant:
            stack = kv.draft_stack  # (a KVCache's; None without one)
        if stack is not None and stack.dtype == ctx.dtype:
            w, bias, kw = self.context_kv
            dispatch.context_kv_store(dispatch.linear(ctx, w, bias, False), cos, sin, kw, stack, slot_mapping,
                                      self.layers[0].self_attn.eps)
            return
        for layer, (k_cache, v_cache) in zip(self.layers, kv.draft):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            dispatch.store_kv(k_cache, v_cache, k, v, slot_mapping)

    def forward(self, input_embeds: Tensor, positions: Tensor, meta: AttentionMetadata, kv) -> Tensor:
        """Block rows -> final-normed hidden. Block K/V land at meta.slot_mapping as scratch."""
        if meta.causal:
            # Draft attention is non-causal by definition (every block row sees the whole block).
            meta = dataclasses.replace(meta, causal=False)
        cos, sin = self.rotary(positions, input_embeds.dtype)
        if self.backend is not None:
            return self.backend.run_layers(input_embeds, cos, sin, meta, kv.draft, None)[0]
        return run_layers(self.layers, input_embeds, cos, sin, meta, kv.draft, self.norm)[0]
