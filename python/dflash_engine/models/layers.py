"""Decoder-layer pieces shared by the Llama/Qwen3 targets and the DFlash draft.

Module and parameter names mirror Hugging Face, except the packed projections (qkv_proj,
gate_up_proj), whose checkpoint shards packed.py maps. Every op goes through `ops/dispatch`;
a runtime backend may replace whole stages through the model's `backend` hook (backend.py).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import dispatch
from ..ops.attention import AttentionMetadata
from ..ops.norm import RMSNorm
from ..ops.rotary import RotaryEmbedding, apply_rotary
from .backend import TargetBackend
from .config import ModelConfig

KVLayer = tuple[Tensor, Tensor]


class Linear(nn.Linear):
    """nn.Linear whose GEMM is `dispatch.linear`: batch-invariant on CPU when the model's
    exact-mode flag is set (set_batch_invariant), plain otherwise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_invariant = False  # the model's flag, copied here by set_batch_invariant
        # Tensor parallelism: a row-parallel layer's forward (models/parallel.py RowParallel:
        # partial GEMM, all-reduce, bias); None: the whole GEMM (TP = 1, column-parallel layers).
        self.row_parallel = None

    def forward(self, x: Tensor) -> Tensor:
        if self.row_parallel is not None:
            return self.row_parallel(self, x)
        return dispatch.linear(x, self.weight, self.bias, self.batch_invariant)


def set_batch_invariant(model: nn.Module, enabled: bool) -> nn.Module:
    """Put every GEMM of `model` (its Linear layers, and the logits GEMM of a target) in the
    exact batch-invariant mode or the plain one. Per model, so engines of both modes can share
    a process (the loader calls this with the engine's resolved flag).

    The exact mode computes from the parameters alone, in the checkpoint's row-major layout:
    enabling it removes any installed backend (backend.py) and undoes a backend's relayout of
    the weights, so its bits do not depend on what the model ran before."""
    enabled = bool(enabled)
    for m in model.modules():
        if isinstance(m, (Linear, CausalLM)):
            m.batch_invariant = enabled
    if enabled:
        with torch.no_grad():
            for m in model.modules():
                if getattr(m, "backend", None) is not None:
                    m.backend = None
                if isinstance(m, (Linear, nn.Embedding)) and not m.weight.is_contiguous():
                    m.weight.data = m.weight.data.contiguous()
    return model


def make_rotary(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


class Attention(nn.Module):
    """q, k, v from one GEMM: `qkv_proj` packs q_proj/k_proj/v_proj by rows (packed.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        self.window: int | None = None  # a sliding-window layer's window (a DFlash draft sets it)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias, h = cfg.attention_bias, cfg.hidden_size
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, h, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """K (normed, rotated) and V only, from the k, v rows of qkv_proj (a view, no copy):
        the draft's context write computes no q."""
        weight = self.qkv_proj.weight[self.q_size:]
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size:]
        k, v = dispatch.linear(x, weight, bias, self.qkv_proj.batch_invariant).split(self.kv_size, dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = dispatch.rms_norm(k, self.k_norm.weight, self.eps)
        return apply_rotary(k, cos, sin), v.view(-1, self.num_kv_heads, self.head_dim)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_layer: KVLayer
    ) -> Tensor:
        k_cache, v_cache = kv_layer
        qkv = self.qkv_proj(x)
        q = dispatch.qk_norm_rope_store(  # K, V of these rows go into the caches at their slots
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight, self.eps, k_cache, v_cache, meta.slot_mapping,
        )
        # The exact mode's attention follows the model's GEMM flag (set_batch_invariant).
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, self.scale, self.qkv_proj.batch_invariant,
                                       self.window)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU with gate and up from one GEMM: `gate_up_proj` packs gate_proj/up_proj."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = Linear(h, 2 * i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(dispatch.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer in the fused-residual form: takes (sublayer output, residual
    stream) and returns the same pair, so each residual add is fused with the RMSNorm that
    reads it. The residual stream after layer L (what the draft taps) is `x + residual`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, meta: AttentionMetadata,
        kv_layer: KVLayer,
    ) -> tuple[Tensor, Tensor]:
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:  # first layer: x is the embedding, the stream starts here
            h, residual = dispatch.rms_norm(x, norm1.weight, norm1.eps), x
        else:
            h, residual = dispatch.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn(h, cos, sin, meta, kv_layer)
        h, residual = dispatch.add_rms_norm(h, residual, norm2.weight, norm2.eps)
        return self.mlp(h), residual


def run_layers(layers, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_layers,
               final_norm: RMSNorm, tap_layers: list[int] | None = None) -> tuple[Tensor, Tensor | None]:
    """A stack of decoder layers -> (final-normed hidden, concatenated taps or None)."""
    tapped: dict[int, Tensor] = {}
    wanted = set(tap_layers or ())
    residual = None
    for i, (layer, kv_layer) in enumerate(zip(layers, kv_layers)):
        x, residual = layer(x, residual, cos, sin, meta, kv_layer)
        if i in wanted:
            tapped[i] = x + residual
    out, _ = dispatch.add_rms_norm(x, residual, final_norm.weight, final_norm.eps)
    taps = torch.cat([tapped[i] for i in tap_layers], dim=-1) if tap_layers else None
    return out, taps


class DecoderModel(nn.Module):
    """HF `model.*`: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Target model: the TargetModel interface of docs/INTERFACES.md."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.rotary = make_rotary(cfg)
        tied = cfg.tie_word_embeddings
        self.lm_head = None if tied else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.batch_invariant = False  # the logits GEMM's exact-mode flag (set_batch_invariant)
        self.backend: TargetBackend | None = None  # a runtime backend's layer loop and logits (backend.py)
        # Tensor parallelism: this rank's TPShard (models/parallel.py) when the embedding and
        # lm_head hold its slice of the vocabulary; None: the whole vocabulary (TP = 1).
        self.tp = None
        # A reduced draft vocabulary (models/draft_vocab.py): the token ids a draft may propose
        # (ascending) and their rows of the logits weight; None: the whole vocabulary.
        self.draft_vocab: Tensor | None = None
        self.draft_head: Tensor | None = None

    @property
    def logits_weight(self) -> Tensor:
        """[V, H]: lm_head's weight, or the embedding's when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, ids: Tensor) -> Tensor:
        if self.tp is not None:
            return self.tp.embed(self.model.embed_tokens.weight, ids)
        return self.model.embed_tokens(ids)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        meta: AttentionMetadata,
        kv,
        tap_layers: list[int] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        # tap_layers (the draft's target_layer_ids) are range-checked once, at draft load.
        if self.backend is not None:
            return self.backend.run_layers(x, cos, sin, meta, kv.target, tap_layers)
        return run_layers(self.model.layers, x, cos, sin, meta, kv.target, self.model.norm, tap_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits [N, V] of final-normed hidden rows: float32, or the model's bf16/fp16 on the
        GPU kernel path in the default mode (dispatch.logits: sampling widens what it needs)."""
        if self.backend is not None:
            return self.backend.compute_logits(hidden)
        logits = dispatch.logits(hidden, self.logits_weight, self.batch_invariant)
        return logits if self.tp is None else self.tp.gather_columns(logits)  # every rank: [N, V]

    def set_draft_vocab(self, ids: Tensor | None) -> None:
        """Proposals among these token ids only (ascending; None: the whole vocabulary): their
        rows of the logits weight are copied once (N x H)."""
        if ids is None:
            self.draft_vocab = self.draft_head = None
            return
        if self.tp is not None:
            raise ValueError("speculative_config.draft_vocab_size is not supported with tensor_parallel_size > 1 "
                             "(the logits weight is split over the ranks by vocabulary rows)")
        weight = self.logits_weight
        self.draft_vocab = ids.to(device=weight.device, dtype=torch.long)
        self.draft_head = weight.detach().index_select(0, self.draft_vocab).contiguous()

    def propose(self, hidden: Tensor) -> Tensor:
        """A draft's proposed tokens from its final hidden rows: the argmax of their logits
        (the first index of a row's maximum), over the draft vocabulary when one is set."""
        if self.draft_head is not None:
            return self.draft_vocab[dispatch.logits(hidden, self.draft_head, self.batch_invariant).argmax(-1)]
        if self.backend is not None:
            return self.backend.propose(hidden)
        return self.compute_logits(hidden).argmax(-1)
