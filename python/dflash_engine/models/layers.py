"""Decoder-layer pieces shared by the Llama/Qwen3 targets and the DFlash draft.

Module and parameter names mirror Hugging Face, except the packed projections (qkv_proj,
gate_up_proj), whose checkpoint shards packed.py maps.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops import dispatch
from ..ops.attention import AttentionMetadata, paged_attention_sdpa, write_kv
from ..ops.norm import RMSNorm
from ..ops.rotary import RotaryEmbedding, apply_rotary
from .config import ModelConfig

KVLayer = tuple[Tensor, Tensor]


_ROWS = 16  # rows per fixed-shape GEMM on CPU
_ENV_VARS = ("VLLM_BATCH_INVARIANT", "DFLASH_BATCH_INVARIANT")


def batch_invariant_from_env() -> bool:
    """The process default of the exact mode: `VLLM_BATCH_INVARIANT=1` (vLLM's name) or
    `DFLASH_BATCH_INVARIANT=1`. Read when a model is built or an engine configured, so one
    process can still hold engines of both modes (pass `batch_invariant=` explicitly)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in _ENV_VARS)


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ weight.T, each row's bits independent of M on CPU.

    CPU BLAS picks its kernel (GEMV vs GEMM, blocking) from the row count, so a plain
    F.linear gives a request different bits alone and batched. Here every row goes through
    the same fixed-shape GEMM: 16-row blocks, the last one zero-padded. The weight is read
    once per block and never copied. Other devices use F.linear.
    """
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    m, k = x.shape
    wt = weight.t()
    out = x.new_empty(m, wt.shape[1])
    for i in range(0, m, _ROWS):
        blk = x[i:i + _ROWS]
        n = blk.shape[0]
        if n < _ROWS:
            blk = torch.cat([blk, blk.new_zeros(_ROWS - n, k)])
        out[i:i + n] = torch.mm(blk, wt)[:n]
    return out if bias is None else out + bias


_SPLIT_MAX_ROWS = 4  # fast_linear splits the weight across threads up to this many rows


def fast_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear for the fast CPU mode. A GEMM of a few rows (a decode step) is bound by
    reading the weight, and BLAS runs it on one thread. With a column-major weight (what
    set_batch_invariant(False) stores: memory [in, out]) and T threads, the input dimension
    is cut into T contiguous slabs of the weight, run as one batched GEMM (parallel over the
    slabs, each thread streaming its own contiguous part of the weight) and summed: ~1.6x
    the single-thread bandwidth on the 2-core dev VM."""
    threads = torch.get_num_threads()
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if (threads > 1 and 0 < m <= _SPLIT_MAX_ROWS and x.device.type == "cpu" and weight.stride(0) == 1
            and k % threads == 0 and weight.numel() >= (1 << 16) * threads):
        slabs = weight.t().view(threads, k // threads, weight.shape[0])  # [T, K/T, N], a view
        parts = torch.bmm(x.reshape(m, threads, k // threads).transpose(0, 1), slabs)  # [T, M, N]
        out = parts[0]
        for i in range(1, threads):
            out = out.add_(parts[i])
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def packed_linear(x: Tensor, packed, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias) through the weight's packed CPU form (cpu_weights.PackedWeight)."""
    out = packed(x)
    return out if bias is None else out.add_(bias)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, batch_invariant: bool, packed=None) -> Tensor:
    """The exact mode (`invariant_linear`) or the fast one: the packed weight where the fast
    CPU mode made one (cpu_weights.py), else `fast_linear` (the default)."""
    if batch_invariant:
        return invariant_linear(x, weight, bias)
    if packed is not None and x.device.type == "cpu":
        return packed_linear(x, packed, bias)
    return fast_linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose CPU GEMM is batch-invariant when `batch_invariant` is set (the exact
    mode, see set_batch_invariant); plain F.linear otherwise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_invariant = batch_invariant_from_env()
        self.packed = None  # cpu_weights.PackedWeight: the fast CPU mode's bf16/int4 copy (pack_cpu_weights)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.batch_invariant, self.packed)

    def fast(self, x: Tensor) -> Tensor:
        """The fast mode's GEMM: the packed weight if any, else `fast_linear`."""
        packed = self.packed
        if packed is not None:
            bias = self._parameters["bias"]  # not through nn.Module's __getattr__: ~1 us a GEMM
            return packed(x) if bias is None else packed(x).add_(bias)
        return fast_linear(x, self.weight, self.bias)


def set_batch_invariant(model: nn.Module, enabled: bool) -> nn.Module:
    """Put every GEMM of `model` (its Linear layers, and the logits GEMM of a target) in
    the exact batch-invariant mode or the fast one. Per model, so engines of both modes can
    share a process.

    The fast mode on CPU also stores each weight matrix column-major (the same [out, in]
    parameter over transposed memory): a one-row GEMM then streams the weight as a plain
    [in, out] matrix, ~1.7x the bandwidth BLAS reaches on the row-major one (the decode step
    is bound by reading the weights). The exact mode keeps the checkpoint's row-major layout,
    so its bits do not depend on which mode the model was in before."""
    enabled = bool(enabled)
    for m in model.modules():
        if isinstance(m, (Linear, CausalLM)):
            m.batch_invariant = enabled
        m.__dict__.pop("_fast_parts_cache", None)  # DecoderLayer._fast_parts: looked up afresh
    if enabled:  # the exact mode computes from the parameters only
        from .cpu_weights import unpack_cpu_weights

        unpack_cpu_weights(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (Linear, nn.Embedding)) and m.weight.device.type == "cpu":
                w = m.weight.data
                m.weight.data = w.contiguous() if enabled else w.t().contiguous().t()
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
        self.kv_packed = None  # the k, v rows of qkv_proj packed (a DFlash draft's, pack_cpu_weights)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """K (normed, rotated) and V only, from the k, v rows of qkv_proj (a view, no copy):
        the draft's context write computes no q."""
        weight = self.qkv_proj.weight[self.q_size:]
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[self.q_size:]
        k, v = linear(x, weight, bias, self.qkv_proj.batch_invariant, self.kv_packed).split(self.kv_size, dim=-1)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = dispatch.rms_norm(k, self.k_norm.weight, self.eps)
        return apply_rotary(k, cos, sin), v.view(-1, self.num_kv_heads, self.head_dim)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_layer: KVLayer
    ) -> Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = dispatch.qk_norm_rope(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, cos, sin,
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight, self.eps,
        )
        k_cache, v_cache = kv_layer
        dispatch.store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = dispatch.paged_attention(q, k_cache, v_cache, meta, self.scale)
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
        if self.fast_cpu(x):
            return self._forward_fast_cpu(x, residual, *fast_rope_tables(cos, sin), meta, kv_layer)
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:  # first layer: x is the embedding, the stream starts here
            h, residual = dispatch.rms_norm(x, norm1.weight, norm1.eps), x
        else:
            h, residual = dispatch.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn(h, cos, sin, meta, kv_layer)
        h, residual = dispatch.add_rms_norm(h, residual, norm2.weight, norm2.eps)
        return self.mlp(h), residual

    def fast_cpu(self, x: Tensor) -> bool:
        """Whether this layer runs `_forward_fast_cpu`: the fast mode, on the CPU path."""
        return x.device.type == "cpu" and not self.mlp.down_proj.batch_invariant and not dispatch.kernels_on_cpu()

    def _fast_parts(self) -> tuple:
        """The submodules and parameters `_forward_fast_cpu` reads, looked up once (nn.Module's
        attribute lookup costs ~1 us each, a dozen per layer and step)."""
        parts = self.__dict__.get("_fast_parts_cache")
        if parts is None:
            attn, mlp = self.self_attn, self.mlp
            n1, n2 = self.input_layernorm, self.post_attention_layernorm
            parts = (attn, n1.weight, n1.eps, n2.weight, n2.eps, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                     mlp.down_proj, attn.q_norm, attn.k_norm)
            self.__dict__["_fast_parts_cache"] = parts
        return parts

    def _forward_fast_cpu(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin_signed: Tensor, meta: AttentionMetadata,
        kv_layer: KVLayer,
    ) -> tuple[Tensor, Tensor]:
        """The same layer for the fast CPU mode, in as few torch calls as it takes: a decode
        step at one request is ~20 of them per layer, so the step stays bound by reading the
        weights rather than by Python. torch's fused rms_norm and SDPA; not batch-invariant
        (the exact mode runs `forward`'s reference ops and `invariant_linear`).
        cos, sin_signed: `fast_rope_tables` ([T, 1, D], the sign of rotate-half in sin)."""
        attn, w1, eps1, w2, eps2, qkv_proj, o_proj, gate_up_proj, down_proj, q_norm, k_norm = self._fast_parts()
        residual = x if residual is None else x.add_(residual)  # x: the previous layer's fresh output
        h = F.rms_norm(residual, w1.shape, w1, eps1)
        qkv = qkv_proj.fast(h)
        t, nh, nkv, d = qkv.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        v = qkv[:, attn.q_size + attn.kv_size:].view(t, nkv, d)
        qk = qkv[:, :attn.q_size + attn.kv_size].view(t, nh + nkv, d)
        if q_norm is not None:  # q_norm and k_norm at once
            qk = rms_norm_heads(qk, torch.cat((q_norm.weight.expand(nh, d), k_norm.weight.expand(nkv, d))), attn.eps)
        qk = fast_rope(qk, cos, sin_signed)  # q and k together
        q, k = qk[:, :nh], qk[:, nh:]
        k_cache, v_cache = kv_layer
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention_sdpa(q, k_cache, v_cache, meta, attn.scale)
        h = o_proj.fast(o.reshape(t, nh * d))
        residual = h.add_(residual)
        h = F.rms_norm(residual, w2.shape, w2, eps2)
        gate, up = gate_up_proj.fast(h).chunk(2, dim=-1)
        return down_proj.fast(F.silu(gate).mul_(up)), residual


def rms_norm_heads(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """F.rms_norm's math over the last dim of x [..., heads, D] with a weight per head
    ([heads, D], broadcast): several norms (q_norm and k_norm, or every layer's k_norm) in one."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps)) * weight


def fast_rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """Neox RoPE of x [..., D] with `fast_rope_tables`' cos and sin_signed (broadcast against x)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def fast_rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, D] (RotaryEmbedding's) -> (cos, sin_signed) [T, 1, D] for the fast CPU path's
    RoPE: rotate_half(x) * sin == x.roll(D/2, -1) * sin_signed, sin_signed = cat(-sin1, sin2)."""
    half = cos.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).unsqueeze(1)


def run_layers(layers, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_layers,
               final_norm: RMSNorm, tap_layers: list[int] | None = None) -> tuple[Tensor, Tensor | None]:
    """A stack of decoder layers -> (final-normed hidden, concatenated taps or None)."""
    tapped: dict[int, Tensor] = {}
    wanted = set(tap_layers or ())
    residual = None
    fast = len(layers) > 0 and layers[0].fast_cpu(x)  # decided once per pass, not per layer
    if fast:
        cos, sin = fast_rope_tables(cos, sin)
    for i, (layer, kv_layer) in enumerate(zip(layers, kv_layers)):
        if fast:  # straight to the fast path (no per-layer module-call overhead)
            x, residual = layer._forward_fast_cpu(x, residual, cos, sin, meta, kv_layer)
        else:
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
        self.batch_invariant = batch_invariant_from_env()  # the logits GEMM (set_batch_invariant)
        self.logits_packed = None  # the logits weight's packed CPU form (pack_cpu_weights)
        self.proposal_packed = None  # its rounded int4 form for a draft's proposals (pack_proposal_logits)

    def embed(self, ids: Tensor) -> Tensor:
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
        return run_layers(self.model.layers, x, cos, sin, meta, kv.target, self.model.norm, tap_layers)

    def compute_logits(self, hidden: Tensor, refine: bool = True) -> Tensor:
        """Float32 logits. With a packed logits weight (the fast CPU mode, cpu_weights.py), each
        row's top few are recomputed in float32 unless `refine` is False (the draft's proposals)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.logits_packed is not None and not self.batch_invariant and hidden.device.type == "cpu":
            from .cpu_weights import packed_logits

            return packed_logits(hidden, self.logits_packed, weight, refine)
        return linear(hidden, weight, None, self.batch_invariant).float()

    def propose(self, hidden: Tensor) -> Tensor:
        """A draft's proposed tokens from its final hidden rows: the argmax of their logits,
        unrefined. With a rounded int4 logits weight (the fast CPU mode with a draft,
        cpu_weights.pack_proposal_logits) through that: a proposal is only a guess the target
        verifies, so a cheaper, coarser GEMM changes how often drafts are accepted, never the
        output."""
        from .cpu_weights import INT4_MAX_ROWS, row_argmax

        if (self.proposal_packed is not None and not self.batch_invariant and hidden.device.type == "cpu"
                and hidden.shape[0] <= INT4_MAX_ROWS):
            return row_argmax(self.proposal_packed(hidden)[:, :self.config.vocab_size].contiguous())
        return row_argmax(self.compute_logits(hidden, refine=False))
