"""Tensor parallelism inside the models: each rank holds a slice of every large weight.

    checkpoint tensor                 split                        rank r holds                  then
    self_attn.q_proj (+ bias)         column (output rows)         its heads/tp q heads          -
    self_attn.k_proj, v_proj (+ bias) column                       its kv heads (*)              -
      -> merged qkv_proj rows [q_r | k_r | v_r] (packed.py over the rank's config view)
    self_attn.o_proj.weight           row (input columns)          its q heads' columns          all-reduce, + bias
    mlp.gate_proj, up_proj (+ bias)   column                       intermediate/tp rows          -
      -> merged gate_up_proj rows [gate_r | up_r]
    mlp.down_proj.weight              row                          intermediate/tp columns       all-reduce, + bias
    embed_tokens                      vocabulary rows              vocab/tp rows                 mask + all-reduce
    lm_head (or the tied embedding)   vocabulary rows              vocab/tp rows                 all-gather -> [N, V]
    DFlash fc                         row (its input columns)      n_taps*hidden/tp columns      all-reduce
    norms (q/k norms too), rotary     replicated                   all of it                     -
    (*) kv heads >= tp: kv/tp heads each; kv < tp (tp a multiple of kv): one kv head, replicated
        on tp/kv ranks (rank r holds head r*kv//tp, the one its q heads read).

A hybrid (Qwen3.5) target, in addition (its attention as above, q_proj rows per head
[query | gate] when gated; the GDN layers split by heads, H_k/tp key heads and H_v/tp value
heads per rank, so a rank's value heads read its own key heads, GROUP = H_v/H_k unchanged):
    linear_attn.in_proj_qkv           column, 3 spans              [q_r | k_r | v_r] of its heads  -
    linear_attn.conv1d.weight         channels, the same 3 spans   its heads' q, k, v channels   -
    linear_attn.in_proj_z             column                       its value heads' rows         -
    linear_attn.in_proj_b, in_proj_a  column                       its value heads               -
      -> merged in_proj rows [qkv_r | z_r | b_r | a_r] (qwen3_5.py packing over the rank's view)
    linear_attn.A_log, dt_bias        value heads                  its value heads               -
    linear_attn.out_proj.weight       row (input columns)          its value heads' columns      all-reduce
    linear_attn.norm                  replicated (per head_v_dim)  all of it                     -
Its recurrent state (conv window, [H_v, d_k, d_v] state) is then per rank too: a rank's state
slots hold its heads only, sized from its config view (worker/state_pool.py).

So attention runs per rank on its own heads (its KV cache holds its kv heads only), the
residual stream, norms and taps are whole on every rank, and the logits are whole before
sampling: sampling, acceptance and the draft's proposals are the same computation on every
rank. A rank's model is built from its config view (`rank_config`: per-rank heads, kv heads,
intermediate size and vocabulary; everything else the model's), which also sizes its KV cache;
the loader reads only the rank's slice of each checkpoint tensor (`checkpoint_slice`) and
`shard_model` turns on the reductions. At TP = 1 none of this is touched.

The communication goes through `TPShard`: torch.distributed collectives on the rank's device
group; with `group=None` (unit tests of the sharding math) every collective is the identity, so
a row-parallel layer returns the rank's partial sum and the logits the rank's vocabulary slice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..ops import dispatch
from .config import DraftConfig, ModelConfig
from .dflash import DFlashDraftModel
from .layers import MLP, Attention, CausalLM, Linear


@dataclass(frozen=True)
class TPShard:
    """This rank's place in the tensor-parallel group, and the group's collectives."""

    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup (the device group); None: simulated

    def all_reduce(self, x: Tensor) -> Tensor:
        """Sum `x` over the ranks, in place (the partial sums of a row-parallel GEMM)."""
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: Tensor) -> Tensor:
        """[N, C] per rank -> [N, size*C], rank r's columns at [r*C, (r+1)*C)."""
        if self.group is None:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def embed(self, weight: Tensor, ids: Tensor) -> Tensor:
        """Embedding rows of `ids` from a vocabulary-split table (`weight`: this rank's rows):
        each rank looks the ids up in its rows (zeros elsewhere) and the sum over the ranks is
        the embedding (exact: one rank adds the row, the others zeros)."""
        local = ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0.0))

    def span(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `total` (divisible: checked at resolve)."""
        n = total // self.size
        return self.rank * n, n

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first kv head, kv heads) this rank holds (one, replicated, when kv < size)."""
        if num_kv_heads >= self.size:
            return self.span(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1


def shard_problems(cfg: ModelConfig, size: int, what: str, split_vocab: bool = True) -> list[str]:
    """Why `cfg` cannot be split over `size` ranks ([] when it can)."""
    if size == 1:
        return []
    out = []
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % size:
        out.append(f"{what}: num_attention_heads ({heads}) is not divisible by tensor_parallel_size ({size})")
    if kv % size and size % kv:
        out.append(f"{what}: num_key_value_heads ({kv}) must divide or be a multiple of tensor_parallel_size "
                   f"({size})")
    if cfg.intermediate_size % size:
        out.append(f"{what}: intermediate_size ({cfg.intermediate_size}) is not divisible by "
                   f"tensor_parallel_size ({size})")
    if split_vocab and cfg.vocab_size % size:
        out.append(f"{what}: vocab_size ({cfg.vocab_size}) is not divisible by tensor_parallel_size ({size})")
    if hasattr(cfg, "linear_num_key_heads"):  # a hybrid target's GDN layers: split by heads
        for key in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(cfg, key) % size:
                out.append(f"{what}: {key} ({getattr(cfg, key)}) is not divisible by tensor_parallel_size "
                           f"({size})")
    if isinstance(cfg, DraftConfig) and (len(cfg.target_layer_ids) * cfg.hidden_size) % size:
        out.append(f"{what}: its fc input ({len(cfg.target_layer_ids)} taps x hidden_size {cfg.hidden_size}) is "
                   f"not divisible by tensor_parallel_size ({size})")
    return out


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank builds its model and its KV cache from: attention heads, kv heads,
    intermediate size, (for a target) vocabulary and (a hybrid's) GDN key and value heads per
    rank, so its state slots too; the rest the model's. The one
    place these per-rank sizes are decided. `size == 1`: `cfg` itself."""
    if size == 1:
        return cfg
    draft = isinstance(cfg, DraftConfig)  # a draft has no vocabulary of its own (it uses the target's)
    problems = shard_problems(cfg, size, "model", split_vocab=not draft)
    if problems:
        raise ValueError("; ".join(problems))
    kv = cfg.num_key_value_heads
    gdn = {}
    if hasattr(cfg, "linear_num_key_heads"):  # a hybrid target: its GDN heads too (and so its state slots)
        gdn = dict(linear_num_key_heads=cfg.linear_num_key_heads // size,
                   linear_num_value_heads=cfg.linear_num_value_heads // size)
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // size, num_key_value_heads=max(1, kv // size),
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=cfg.vocab_size if draft else cfg.vocab_size // size, **gdn)


Slice = tuple[int, tuple[tuple[int, int], ...], int]  # (dim, ((start, length), ...), the dim's full size)


def _one(dim: int, span: tuple[int, int], full: int) -> Slice:
    return dim, (span,), full


def _gdn_slice(last: str, leaf: str, cfg, shard: TPShard) -> Slice | None:
    """The rank's slice of a hybrid target's GDN tensor (None: not one of the split ones)."""
    k0, nk = shard.span(cfg.linear_num_key_heads)
    v0, nv = shard.span(cfg.linear_num_value_heads)
    dk, dv, key_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.gdn_key_dim
    if last == "in_proj_qkv" or (last == "conv1d" and leaf == "weight"):  # rows / channels [q | k | v]
        return 0, ((k0 * dk, nk * dk), (key_dim + k0 * dk, nk * dk), (2 * key_dim + v0 * dv, nv * dv)), cfg.conv_dim
    if last == "in_proj_z":
        return _one(0, (v0 * dv, nv * dv), cfg.gdn_value_dim)
    if last in ("in_proj_b", "in_proj_a") or (last == "linear_attn" and leaf in ("A_log", "dt_bias")):
        return _one(0, (v0, nv), cfg.linear_num_value_heads)
    if last == "out_proj" and leaf == "weight":
        return _one(1, (v0 * dv, nv * dv), cfg.gdn_value_dim)
    return None


def checkpoint_slice(name: str, cfg: ModelConfig, shard: TPShard) -> Slice | None:
    """The rank's slice of checkpoint tensor `name` of a model with (whole) config `cfg`:
    (dim, its spans along dim (start, length), concatenated in order; the dim's full size), or
    None for a tensor every rank holds whole. One span, except the GDN's [q | k | v] rows."""
    module, _, leaf = name.rpartition(".")
    last = module.rpartition(".")[2]
    hd = cfg.head_dim
    if last == "q_proj":  # a gated attention's rows are per head [query | gate]: twice head_dim
        q_hd = hd * (2 if getattr(cfg, "attn_output_gate", False) else 1)
        start, n = shard.span(cfg.num_attention_heads)
        return _one(0, (start * q_hd, n * q_hd), cfg.num_attention_heads * q_hd)
    if last in ("k_proj", "v_proj"):
        start, n = shard.kv_heads(cfg.num_key_value_heads)
        return _one(0, (start * hd, n * hd), cfg.num_key_value_heads * hd)
    if last == "o_proj" and leaf == "weight":
        start, n = shard.span(cfg.num_attention_heads)
        return _one(1, (start * hd, n * hd), cfg.num_attention_heads * hd)
    if last in ("gate_proj", "up_proj"):
        return _one(0, shard.span(cfg.intermediate_size), cfg.intermediate_size)
    if last == "down_proj" and leaf == "weight":
        return _one(1, shard.span(cfg.intermediate_size), cfg.intermediate_size)
    if last in ("embed_tokens", "lm_head"):
        return _one(0, shard.span(cfg.vocab_size), cfg.vocab_size)
    if module == "fc" and isinstance(cfg, DraftConfig):
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        return _one(1, shard.span(width), width)
    if hasattr(cfg, "linear_num_key_heads"):
        return _gdn_slice(last, leaf, cfg, shard)
    return None


def read_slice(f, name: str, where: Slice) -> tuple[Tensor | None, tuple[int, ...]]:
    """Read only the rank's slice of checkpoint tensor `name` from an open safetensors file:
    (the slice, its spans concatenated along the dim, or None when the tensor's sliced dim is
    not the model's; the tensor's shape)."""
    dim, spans, full = where
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if len(shape) <= dim or shape[dim] != full:
        return None, shape
    parts = [sl[start:start + n] if dim == 0 else sl[:, start:start + n] for start, n in spans]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)), shape


@dataclass
class RowParallel:
    """A row-parallel Linear's forward: the rank's partial GEMM (its input columns), summed
    over the ranks, then the (whole, replicated) bias. `in_cols`: the input is whole on every
    rank (the DFlash fc reads the taps), so the rank first takes its columns of it."""

    shard: TPShard
    in_cols: tuple[int, int] | None = None

    def __call__(self, layer, x: Tensor) -> Tensor:
        if self.in_cols is not None:
            x = x[..., self.in_cols[0]:self.in_cols[1]]
        y = self.shard.all_reduce(dispatch.linear(x, layer.weight, None, layer.batch_invariant))
        return y if layer.bias is None else y + layer.bias


def shard_model(model: torch.nn.Module, shard: TPShard) -> torch.nn.Module:
    """Make a model built from `rank_config` (before its weights are loaded) this rank's part:
    o_proj / down_proj row-parallel (and the layers a module names in its ROW_PARALLEL: a
    hybrid target's o_proj and GDN out_proj), the vocabulary split (a target), and a draft's fc
    row-parallel over its share of the taps' columns (its weight resized to that share)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.o_proj.row_parallel = RowParallel(shard)
        elif isinstance(m, MLP):
            m.down_proj.row_parallel = RowParallel(shard)
        for name in getattr(m, "ROW_PARALLEL", ()):  # another model's mixers (qwen3_5.py: o_proj, out_proj)
            getattr(m, name).row_parallel = RowParallel(shard)
    if isinstance(model, CausalLM):
        model.tp = shard
    if isinstance(model, DFlashDraftModel):
        fc = model.fc
        start, n = shard.span(fc.in_features)
        model.fc = Linear(n, fc.out_features, bias=fc.bias is not None, device=fc.weight.device,
                          dtype=fc.weight.dtype)
        model.fc.row_parallel = RowParallel(shard, (start, start + n))
    return model
