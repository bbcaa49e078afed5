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
    if isinstance(cfg, DraftConfig) and (len(cfg.target_layer_ids) * cfg.hidden_size) % size:
        out.append(f"{what}: its fc input ({len(cfg.target_layer_ids)} taps x hidden_size {cfg.hidden_size}) is "
                   f"not divisible by tensor_parallel_size ({size})")
    return out


def rank_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank builds its model and its KV cache from: attention heads, kv heads,
    intermediate size and (for a target) vocabulary per rank; the rest the model's. The one
    place these per-rank sizes are decided. `size == 1`: `cfg` itself."""
    if size == 1:
        return cfg
    draft = isinstance(cfg, DraftConfig)  # a draft has no vocabulary of its own (it uses the target's)
    problems = shard_problems(cfg, size, "model", split_vocab=not draft)
    if problems:
        raise ValueError("; ".join(problems))
    kv = cfg.num_key_value_heads
    return dataclasses.replace(
        cfg, num_attention_heads=cfg.num_attention_heads // size, num_key_value_heads=max(1, kv // size),
        intermediate_size=cfg.intermediate_size // size,
        vocab_size=cfg.vocab_size if draft else cfg.vocab_size // size)


def checkpoint_slice(name: str, cfg: ModelConfig, shard: TPShard) -> tuple[int, int, int, int] | None:
    """The rank's slice of checkpoint tensor `name` of a model with (whole) config `cfg`:
    (dim, start, length, the dim's full size), or None for a tensor every rank holds whole."""
    module, _, leaf = name.rpartition(".")
    last = module.rpartition(".")[2]
    hd = cfg.head_dim
    if last == "q_proj":
        start, n = shard.span(cfg.num_attention_heads)
        return 0, start * hd, n * hd, cfg.num_attention_heads * hd
    if last in ("k_proj", "v_proj"):
        start, n = shard.kv_heads(cfg.num_key_value_heads)
        return 0, start * hd, n * hd, cfg.num_key_value_heads * hd
    if last == "o_proj" and leaf == "weight":
        start, n = shard.span(cfg.num_attention_heads)
        return 1, start * hd, n * hd, cfg.num_attention_heads * hd
    if last in ("gate_proj", "up_proj"):
        return (0, *shard.span(cfg.intermediate_size), cfg.intermediate_size)
    if last == "down_proj" and leaf == "weight":
        return (1, *shard.span(cfg.intermediate_size), cfg.intermediate_size)
    if last in ("embed_tokens", "lm_head"):
        return (0, *shard.span(cfg.vocab_size), cfg.vocab_size)
    if module == "fc" and isinstance(cfg, DraftConfig):
        width = len(cfg.target_layer_ids) * cfg.hidden_size
        return (1, *shard.span(width), width)
    return None


def read_slice(f, name: str, where: tuple[int, int, int, int]) -> tuple[Tensor | None, tuple[int, ...]]:
    """Read only the rank's slice of checkpoint tensor `name` from an open safetensors file:
    (the slice, or None when the tensor's sliced dim is not the model's; the tensor's shape)."""
    dim, start, length, full = where
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if len(shape) <= dim or shape[dim] != full:
        return None, shape
    return (sl[start:start + length] if dim == 0 else sl[:, start:start + length]), shape


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
    o_proj / down_proj row-parallel, the vocabulary split (a target), and a draft's fc
    row-parallel over its share of the taps' columns (its weight resized to that share)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.o_proj.row_parallel = RowParallel(shard)
        elif isinstance(m, MLP):
            m.down_proj.row_parallel = RowParallel(shard)
    if isinstance(model, CausalLM):
        model.tp = shard
    if isinstance(model, DFlashDraftModel):
        fc = model.fc
        start, n = shard.span(fc.in_features)
        model.fc = Linear(n, fc.out_features, bias=fc.bias is not None, device=fc.weight.device,
                          dtype=fc.weight.dtype)
        model.fc.row_parallel = RowParallel(shard, (start, start + n))
    return model
