"""Qwen3.5 hybrid target: Gated DeltaNet layers and gated full-attention layers.

Each decoder layer is pre-norm, `x + mixer(norm(x))` then `x + mlp(norm(x))`, its mixer
chosen by `layer_types`:
- linear_attention (GDN): in_proj -> (q, k, v | z | b | a); silu(short causal conv) of
  q, k, v; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
  (q, k l2-normed); RMSNorm(o) * silu(z); out_proj. Its state lives in a HybridState slot.
- full_attention: q_proj yields per head [query | gate]; q/k RMSNorm; RoPE on the first
  `rotary_dim` dims of each head; paged attention; o * sigmoid(gate); o_proj.
Every RMSNorm but the GDN output norm is zero-centred (scale 1 + weight), as transformers'.

Packed projections (one GEMM each), in checkpoint row order:
    self_attn.qkv_proj  = q_proj | k_proj | v_proj
    mlp.gate_up_proj    = gate_proj | up_proj
    linear_attn.in_proj = in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ..ops import dispatch, gdn
from ..ops.attention import AttentionMetadata
from ..ops.rotary import RotaryEmbedding
from .config import resolve_dtype
from .hybrid_state import HybridState, StateMetadata
from .layers import MLP, CausalLM, Linear
from .loader import _build, read_config
from .packed import checkpoint_shards
from .parallel import TPShard
from .qwen3_5_config import LINEAR_ATTENTION, HybridConfig

# Checkpoint tensors that are not the text model (the vision tower, multi-token prediction).
IGNORED_PREFIXES = ("model.visual.", "mtp.")


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), statistics and scale in float32, cast back after."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return dispatch.zero_centred_rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: RMSNorm(x) * weight * silu(gate) (plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return gdn.gated_rms_norm(x, gate, self.weight, self.eps)


@dataclass
class HybridStep:
    """What every layer of one forward pass reads (built once per pass)."""

    cos: Tensor  # [T, rotary_dim]
    sin: Tensor
    meta: AttentionMetadata
    state_meta: StateMetadata
    query_start_loc: list[int] | Tensor  # host list; the device tensor on a graph-safe step
    per_token: list[bool]  # per request: the GDN's recurrent (True) or chunked form
    write_host: list[int]  # state_meta.write on the host (empty on a graph-safe step: unused)


class GatedDeltaNet(nn.Module):
    # Tensor parallelism (models/parallel.py): split by heads, out_proj sums the ranks' parts.
    ROW_PARALLEL = ("out_proj",)

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.num_v_heads, self.head_v_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.num_k_heads, self.head_k_dim = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.gdn_key_dim, cfg.gdn_value_dim, cfg.conv_dim
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        # Only its weight [conv_dim, 1, K] is used (ops.gdn.causal_conv1d); a Conv1d keeps HF's name and shape.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.linear_conv_kernel_dim, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, step: HybridStep, conv_pool: Tensor, state_pool: Tensor) -> Tensor:
        t = x.shape[0]
        sm = step.state_meta
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads],
                                               dim=-1)
        mixed = gdn.causal_conv1d(mixed, self.conv1d.weight[:, 0], step.query_start_loc, conv_pool, sm.read,
                                  sm.write)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (gdn.gdn_gates): in torch
        # on the reference path, inside the recurrent kernel on the kernel path
        o = gdn.gated_delta_rule(
            q.reshape(t, self.num_k_heads, self.head_k_dim), k.reshape(t, self.num_k_heads, self.head_k_dim),
            v.reshape(t, self.num_v_heads, self.head_v_dim), None, None, step.query_start_loc, state_pool,
            sm.read, sm.write, step.write_host, step.per_token, query_start_loc=step.meta.query_start_loc,
            gates=(a, b, self.A_log, self.dt_bias))
        o = self.norm(o, z.reshape(t, self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(t, self.value_dim))


class GatedAttention(nn.Module):
    ROW_PARALLEL = ("o_proj",)  # tensor parallelism: split by heads (models/parallel.py)

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.q_size = self.num_heads * self.head_dim * (2 if self.gated else 1)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias, h = cfg.attention_bias, cfg.hidden_size
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, step: HybridStep, kv_layer: tuple[Tensor, Tensor]) -> Tensor:
        # split; q/k zero-centred RMSNorm (both eps are cfg.rms_norm_eps) + partial rotary;
        # contiguous q, k, v (one launch on the kernel path); the gate: per q head
        # [query (head_dim) | gate (head_dim)]
        q, k, v, gate = dispatch.qk_norm_partial_rope(
            self.qkv_proj(x), self.num_heads, self.num_kv_heads, self.head_dim, step.cos, step.sin,
            self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.gated)
        k_cache, v_cache = kv_layer
        dispatch.store_kv(k_cache, v_cache, k, v, step.meta.slot_mapping)
        out = dispatch.paged_attention(q, k_cache, v_cache, step.meta, self.scale,
                                       self.qkv_proj.batch_invariant).flatten(1)
        if gate is not None:
            out = dispatch.sigmoid_gate(out, gate)
        return self.o_proj(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_type: str):
        super().__init__()
        self.is_gdn = layer_type == LINEAR_ATTENTION
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, step: HybridStep, cache: tuple[Tensor, Tensor]) -> Tensor:
        """cache: (conv pool, state pool) of a GDN layer; (K cache, V cache) of an attention layer."""
        h = self.input_layernorm(x)
        h = self.linear_attn(h, step, *cache) if self.is_gdn else self.self_attn(h, step, cache)
        norm = self.post_attention_layernorm
        h, x = dispatch.add_zero_centred_rms_norm(h, x, norm.weight, norm.eps)  # x + h, then its norm
        return x + self.mlp(h)


class Qwen3_5ForCausalLM(CausalLM):
    """A hybrid target: CausalLM's embedding, logits and proposals over its own layer stack.

    forward(input_ids, positions, meta, kv, tap_layers, *, state, state_meta):
    - `kv.target[j]`: the (K, V) caches of the j-th full-attention layer (attention layers
      only, in layer order: cfg.attention_layer_ids);
    - `state`: the GDN layers' slot pools; `state_meta`: the slots each request reads and
      writes (hybrid_state.py states the contract). `meta` is the attention metadata; its
      query_start_loc also delimits the requests of the GDN layers.
    Returns (final-normed hidden [T, H], taps: the residual stream after each layer of
    `tap_layers`, concatenated, or None), as the dense targets do."""

    def __init__(self, cfg: HybridConfig):
        # CausalLM builds the embedding, lm_head and the logits flags; its dense stack is
        # built empty and replaced by the hybrid one.
        super().__init__(replace(cfg, num_hidden_layers=0))
        self.config = cfg
        self.model.layers = nn.ModuleList(HybridDecoderLayer(cfg, t) for t in cfg.layer_types)
        self.model.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)

    def forward(
        self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv, tap_layers: list[int] | None = None,
        *, state: HybridState, state_meta: StateMetadata,
    ) -> tuple[Tensor, Tensor | None]:
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        if state_meta.all_per_token and dispatch.use_kernels(x):
            # A decode/verify step on the kernel path (what a CUDA graph captures): every
            # request runs per token, and nothing is read back to the host.
            n = meta.query_start_loc.shape[0] - 1
            step = HybridStep(cos, sin, meta, state_meta, meta.query_start_loc, [True] * n, [])
        else:
            qsl, _ = meta.host_lists()
            # The exact mode runs every sequence per token: a token's state then never depends on
            # how the engine split the sequence into chunks and steps (the chunked form's does).
            per_token = [True] * (len(qsl) - 1) if self.batch_invariant else state_meta.per_token(qsl)
            step = HybridStep(cos, sin, meta, state_meta, qsl, per_token, state_meta.host_lists()[1])
        caches = iter(kv.target)
        gdn_caches = iter(zip(state.conv, state.recurrent))
        wanted, tapped = set(tap_layers or ()), {}
        for i, layer in enumerate(self.model.layers):
            x = layer(x, step, next(gdn_caches) if layer.is_gdn else next(caches))
            if i in wanted:
                tapped[i] = x
        taps = torch.cat([tapped[i] for i in tap_layers], dim=-1) if tap_layers else None
        return self.model.norm(x), taps

    def packing(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint module -> (merged module, first row, rows), within one decoder layer."""
        a, c = self.model.layers, self.config
        attn = next((layer.self_attn for layer in a if not layer.is_gdn), None)
        out = {"mlp.gate_proj": ("mlp.gate_up_proj", 0, c.intermediate_size),
               "mlp.up_proj": ("mlp.gate_up_proj", c.intermediate_size, c.intermediate_size)}
        if attn is not None:
            q, kv = attn.q_size, attn.kv_size
            out.update({"self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
                        "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
                        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv)})
        start = 0
        for name, rows in (("qkv", c.conv_dim), ("z", c.gdn_value_dim), ("b", c.linear_num_value_heads),
                           ("a", c.linear_num_value_heads)):
            out[f"linear_attn.in_proj_{name}"] = ("linear_attn.in_proj", start, rows)
            start += rows
        return out

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint tensor name -> (parameter, first row, rows) for the loader, the text
        model's tensors under cfg.weight_prefix."""
        shards = checkpoint_shards(self.named_parameters(), self.config, self.packing())
        prefix = self.config.weight_prefix
        return {(prefix + name.removeprefix("model.") if name.startswith("model.") else name): shard
                for name, shard in shards.items()}

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith(IGNORED_PREFIXES)


def load_qwen3_5(path: str | Path, dtype: str | torch.dtype = "auto", device="cpu",
                 batch_invariant: bool | None = None, tp: TPShard | None = None) -> Qwen3_5ForCausalLM:
    """A Qwen3.5 target from a Hugging Face directory (either checkpoint layout); `tp`: this
    rank's shard under tensor parallelism (models/parallel.py; None: the whole model)."""
    cfg = HybridConfig.from_dict(read_config(path))
    return _build(Qwen3_5ForCausalLM, cfg, path, resolve_dtype(dtype, cfg.torch_dtype, device), device,
                  batch_invariant, tp)
