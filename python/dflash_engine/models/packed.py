"""Packed projections: checkpoint tensors that are row shards of one merged parameter.

Attention computes q, k and v with one GEMM (`qkv_proj`) and the MLP gate and up with one
(`gate_up_proj`), so the input is read once. Checkpoints keep the Hugging Face names; inside
each decoder layer they map to rows of the merged parameter (weight and bias alike, both
sharded along dim 0), with q = heads * head_dim, kv = kv_heads * head_dim, i = intermediate:

    checkpoint module       merged parameter        rows
    self_attn.q_proj    ->  self_attn.qkv_proj      [0, q)
    self_attn.k_proj    ->  self_attn.qkv_proj      [q, q + kv)
    self_attn.v_proj    ->  self_attn.qkv_proj      [q + kv, q + 2 kv)
    mlp.gate_proj       ->  mlp.gate_up_proj        [0, i)
    mlp.up_proj         ->  mlp.gate_up_proj        [i, 2 i)

Every other parameter is its checkpoint tensor, whole.
"""
from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

from .config import ModelConfig


def packed_shards(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint module -> (merged module, first row, rows), within one decoder layer."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, i),
        "mlp.up_proj": ("mlp.gate_up_proj", i, i),
    }


def checkpoint_shards(
    params: Iterable[tuple[str, Tensor]], cfg: ModelConfig,
    packing: dict[str, tuple[str, int, int]] | None = None,
) -> dict[str, tuple[str, int, int]]:
    """Every checkpoint tensor name that (parameter name, tensor) pairs load from ->
    (parameter name, first row, rows). Unpacked parameters map to themselves, whole.
    `packing`: a model's own packed_shards-style map (default: packed_shards(cfg))."""
    by_merged: dict[str, list[tuple[str, int, int]]] = {}
    for ckpt_module, (merged, start, rows) in (packed_shards(cfg) if packing is None else packing).items():
        by_merged.setdefault(merged, []).append((ckpt_module, start, rows))
    out: dict[str, tuple[str, int, int]] = {}
    for name, tensor in params:
        module, _, leaf = name.rpartition(".")
        merged = next((m for m in by_merged if module == m or module.endswith("." + m)), None)
        if merged is None:
            out[name] = (name, 0, tensor.shape[0])
            continue
        shards = sorted(by_merged[merged], key=lambda s: s[1])
        end = 0
        for ckpt_module, start, rows in shards:
            if start != end:
                raise RuntimeError(f"shards of {name} do not tile its rows: {shards}")
            end = start + rows
            out[module[: len(module) - len(merged)] + ckpt_module + "." + leaf] = (name, start, rows)
        if end != tensor.shape[0]:
            raise RuntimeError(f"{name} has {tensor.shape[0]} rows, its shards {end}: {shards}")
    return out


def to_checkpoint_state_dict(state_dict: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The inverse, for saving: merged parameters split back into their Hugging Face
    tensors (row views, no copies)."""
    return {
        ckpt: state_dict[param].narrow(0, start, rows)
        for ckpt, (param, start, rows) in checkpoint_shards(state_dict.items(), cfg).items()
    }
