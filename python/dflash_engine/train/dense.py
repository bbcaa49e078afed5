"""Dense forwards for training: the frozen target's taps over whole sequences, and the DFlash
blocks of the draft, both without a KV cache (the paged forwards in models/ are the inference
path; tests check the two agree).

A block of anchor `a` is the input `[x_a, MASK x (B-1)]` at positions a..a+B-1. It attends to
the draft context strictly before the anchor (K/V from ctx = hidden_norm(fc(concat taps))
through each layer's k_proj/k_norm/RoPE and v_proj, no input_layernorm) and bidirectionally
within its own block.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.norm import rms_norm


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox rotate-half RoPE; cos/sin broadcast against x [..., T, heads, hd] as [..., T, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm(x, weight, eps)


def _heads(t: Tensor, n: int, kv: int, hd: int, groups: int) -> Tensor:
    """[N, T, kv*hd] -> [N, kv*groups, T, hd] (GQA expanded)."""
    t = t.reshape(n, -1, kv, hd).transpose(1, 2)
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


@torch.no_grad()
def dense_target_taps(target, ids: Tensor, tap_layers: Sequence[int]) -> Tensor:
    """The residual stream after each layer in `tap_layers` (HF hidden_states[L+1]) of a
    causal forward of `target` (an engine target, models/layers.CausalLM) over whole
    sequences ids [N, S] -> [N, S, n_taps*H]. Dense (no KV cache); runs only the layers up to
    the last tap. Trailing padding does not change earlier positions."""
    cfg = target.config
    n, s = ids.shape
    x = target.embed(ids)
    cos, sin = target.rotary(torch.arange(s, device=ids.device), x.dtype)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    wanted, taps = set(tap_layers), {}
    for i, layer in enumerate(target.model.layers[: max(tap_layers) + 1]):
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        qkv = F.linear(h, attn.qkv_proj.weight, attn.qkv_proj.bias)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = q.reshape(n, s, nh, hd), k.reshape(n, s, nkv, hd)
        if attn.q_norm is not None:
            q, k = _rms(q, attn.q_norm.weight, attn.eps), _rms(k, attn.k_norm.weight, attn.eps)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), _heads(k, n, nkv, hd, nh // nkv), _heads(v, n, nkv, hd, nh // nkv),
            is_causal=True, scale=attn.scale)
        x = x + F.linear(o.transpose(1, 2).reshape(n, s, nh * hd), attn.o_proj.weight, attn.o_proj.bias)
        h = _rms(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        gate, up = F.linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        if i in wanted:
            taps[i] = x
    return torch.cat([taps[i] for i in tap_layers], dim=-1)


def dense_block_forward(draft, taps: Tensor, block_embeds: Tensor, anchors: Tensor) -> Tensor:
    """Dense training forward of DFlash blocks from the draft module's own parameters (the
    module's paged forward is the inference path; tests check they agree).

    taps [N, S, n_taps*H]: the target's taps at positions 0..S-1 of every sequence;
    block_embeds [N, A, B, H]: block input embeddings for A anchors per sequence;
    anchors [A] (shared) or [N, A]: block row k of anchor a sits at position a+k.
    The block of anchor a sees the context at positions < a and its own B rows (non-causal).
    Returns the final-normed hidden of the block rows [N, A, B, H]."""
    cfg = draft.config
    n, s, _ = taps.shape
    _, a_num, b, h = block_embeds.shape
    dev = taps.device
    if anchors.dim() == 1:
        anchors = anchors[None, :].expand(n, -1)
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rows = a_num * b

    ctx = draft.hidden_norm(F.linear(taps, draft.fc.weight))  # [N, S, H]
    ctx_cos, ctx_sin = draft.rotary(torch.arange(s, device=dev), ctx.dtype)  # absolute positions, draft RoPE
    ctx_cos, ctx_sin = ctx_cos[None, :, None, :], ctx_sin[None, :, None, :]
    pos = (anchors[:, :, None] + torch.arange(b, device=dev)).reshape(-1)
    blk_cos, blk_sin = draft.rotary(pos, ctx.dtype)
    blk_cos, blk_sin = blk_cos.view(n, rows, 1, hd), blk_sin.view(n, rows, 1, hd)
    # Keys: [context 0..S-1, every block row of every anchor]; block row (a, k) sees the
    # context strictly before a and the B rows of its own block.
    row_anchor = anchors.repeat_interleave(b, dim=1)  # [N, A*B]
    row_block = torch.arange(a_num, device=dev).repeat_interleave(b)
    visible = torch.cat([
        torch.arange(s, device=dev)[None, None, :] < row_anchor[:, :, None],  # [N, A*B, S]
        (row_block[None, :] == row_block[:, None]).expand(n, rows, rows),  # [N, A*B, A*B]
    ], dim=2)[:, None]

    x = block_embeds.reshape(n, rows, h)
    for layer in draft.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # the packed parameters' Hugging Face shards (row views: gradients reach the packed ones)
        wq, wk, wv = attn.qkv_proj.weight.split([nh * hd, nkv * hd, nkv * hd])
        w_gate, w_up = mlp.gate_up_proj.weight.chunk(2)
        # context K/V straight from ctx: no input_layernorm
        kc = _rope(attn.k_norm(F.linear(ctx, wk).view(n, s, nkv, hd)), ctx_cos, ctx_sin)
        vc = F.linear(ctx, wv)
        hn = layer.input_layernorm(x)
        q = _rope(attn.q_norm(F.linear(hn, wq).view(n, rows, nh, hd)), blk_cos, blk_sin)
        kb = _rope(attn.k_norm(F.linear(hn, wk).view(n, rows, nkv, hd)), blk_cos, blk_sin)
        vb = F.linear(hn, wv)
        k = _heads(torch.cat([kc.flatten(2), kb.flatten(2)], dim=1), n, nkv, hd, nh // nkv)
        v = _heads(torch.cat([vc, vb], dim=1), n, nkv, hd, nh // nkv)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible, scale=hd**-0.5)
        x = x + F.linear(o.transpose(1, 2).reshape(n, rows, nh * hd), attn.o_proj.weight)
        hn = layer.post_attention_layernorm(x)
        x = x + F.linear(F.silu(F.linear(hn, w_gate)) * F.linear(hn, w_up), mlp.down_proj.weight)
    return draft.norm(x).view(n, a_num, b, h)

