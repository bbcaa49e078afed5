"""One name per hot op: the torch reference twin on CPU, the Triton kernel on CUDA.

The CPU path is the oracle (float32, batch-invariant, exact spec-on == spec-off); the GPU
path is the fast one. `DFLASH_REFERENCE_OPS=1` runs the references on the GPU too (for
comparing the two on the device). Models call only these functions, so one model code
serves both devices and the CUDA-graph step.

`DFLASH_KERNELS_ON_CPU=1` (with `TRITON_INTERPRET=1`) runs the kernel path on CPU tensors
under Triton's interpreter: slow, but it lets CI drive the whole GPU step (kernels, the
padded decode step) on a machine without a GPU.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import envs
from . import activation as _act
from . import attention as _attn
from . import linear as _lin
from . import norm as _norm
from . import partial_rotary as _pr
from . import rotary as _rot
from . import sampling as _sampling


def kernels_on_cpu() -> bool:
    return envs.kernels_on_cpu()


def use_kernels(x: Tensor) -> bool:
    if x.is_cuda:
        return not envs.reference_ops_on_gpu()
    return envs.kernels_on_cpu()


# Few-row GEMMs follow the device-measured picks of ops/gemm_tuning.py (the skinny Triton GEMM
# where it beat cuBLAS). A module switch, read at each call: bench/bench_step.py --ab measures it.
SKINNY_GEMM = True


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, batch_invariant: bool) -> Tensor:
    """x @ weight.T (+ bias). `batch_invariant`: the model's exact-mode flag. The exact mode
    on the kernel path is the fixed-tile Triton GEMM (kernels/gemm.py: cuBLAS tiles by M).
    Otherwise, on the kernel path, a few-row shape that gemm_tuning timed faster with the
    skinny GEMM (kernels/skinny_gemm.py) runs it; everything else ops/linear.py (cuBLAS /
    BLAS; the CPU exact mode's 16-row blocks)."""
    if use_kernels(x):
        if batch_invariant:
            from ..kernels import gemm

            return gemm.matmul(x, weight, bias)
        if SKINNY_GEMM:
            from . import gemm_tuning

            cfg = gemm_tuning.pick(x, weight)
            if cfg is not None:
                from ..kernels.skinny_gemm import skinny_matmul

                return skinny_matmul(x, weight, bias, cfg)
    return _lin.linear(x, weight, bias, batch_invariant)


# The default mode's logits stay in the GEMM's dtype (True; `logits`); False widens them to
# float32 as before. Read at each call: bench/bench_step.py --ab measures the copy it saves.
HALF_LOGITS = True


def logits(hidden: Tensor, weight: Tensor, batch_invariant: bool) -> Tensor:
    """Logits hidden @ weight.T for `sample` and argmax. The exact mode on the kernel path
    accumulates and returns float32 straight from the GEMM (one rounding, the same for every
    row). The default mode on the kernel path returns `linear`'s output in the hidden's dtype
    (bf16): widening is exact and keeps order, so argmax gives the same index on either, and
    the sampling kernel widens the rows it samples at random itself; the float32 copy of a
    [rows, vocabulary] matrix (0.46 ms of a Qwen3-8B c = 32 step, run 8's profile) is not
    made. Otherwise (the torch reference path) float32."""
    if use_kernels(hidden):
        if batch_invariant:
            from ..kernels import gemm

            return gemm.matmul(hidden, weight, None, out_dtype=torch.float32)
        out = _lin.linear(hidden, weight, None, False)
        return out if HALF_LOGITS else out.float()
    return _lin.linear(hidden, weight, None, batch_invariant).float()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if use_kernels(x):
        from ..kernels import norm

        return norm.rms_norm(x, weight, eps)
    return _norm.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if use_kernels(x):
        from ..kernels import norm

        return norm.add_rms_norm(x, residual, weight, eps)
    return _norm.add_rms_norm(x, residual, weight, eps)


def zero_centred_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's norm: (1 + weight) * normalise(x), in float32, rounded once."""
    if use_kernels(x):
        from ..kernels import norm

        return norm.rms_norm(x, weight, eps, zero_centred=True)
    return _norm.zero_centred_rms_norm(x, weight, eps)


def add_zero_centred_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(zero_centred_rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
    if use_kernels(x):
        from ..kernels import norm

        return norm.add_rms_norm(x, residual, weight, eps, zero_centred=True)
    new_residual = x + residual
    return _norm.zero_centred_rms_norm(new_residual, weight, eps), new_residual


def qk_norm_rope(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: Tensor, sin: Tensor,
                 q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Merged qkv [T, (H+2KV)*D] -> q, k (per-head RMSNorm when weights are given, then RoPE), v."""
    fn = _rot.qk_norm_rope
    if use_kernels(qkv):
        from ..kernels import rotary

        fn = rotary.qk_norm_rope
    return fn(qkv, num_heads, num_kv_heads, head_dim, cos, sin, q_norm_weight, k_norm_weight, eps)


# The K/V writes folded into the launch that computes K and V (the target's and the draft's
# layers: qk_norm_rope_store; the draft's context write: context_kv_store). A module switch so
# that bench_step --ab can time the separate launches against it; read per call.
FUSED_KV_STORE = True


def qk_norm_rope_store(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: Tensor, sin: Tensor,
                       q_norm_weight: Tensor | None, k_norm_weight: Tensor | None, eps: float,
                       k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """`qk_norm_rope`, then its K and V rows into the paged caches (`store_kv`) -> q. On the
    kernel path one launch (the same bits) where the caches take the rows in place."""
    if FUSED_KV_STORE and use_kernels(qkv):
        from ..kernels import rotary

        _, kdt, vdt = rotary.result_dtypes(qkv, cos, q_norm_weight, k_norm_weight)
        if rotary.cache_fits(k_cache, v_cache, kdt, vdt, num_kv_heads, head_dim):
            return rotary.qk_norm_rope_store(qkv, num_heads, num_kv_heads, head_dim, cos, sin, q_norm_weight,
                                             k_norm_weight, eps, k_cache, v_cache, slot_mapping)
    q, k, v = qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, cos, sin, q_norm_weight, k_norm_weight, eps)
    store_kv(k_cache, v_cache, k, v, slot_mapping)
    return q


def context_kv_store(kv_rows: Tensor, cos: Tensor, sin: Tensor, k_norm_weights: Tensor | None, caches: Tensor,
                     slot_mapping: Tensor, eps: float) -> None:
    """Every draft layer's context K/V from its stacked k/v projection rows (DFlashDraftModel
    .write_context): normed, rotated, written into `caches` ([L, 2, pages, page_size, KV, D])."""
    if use_kernels(kv_rows):
        from ..kernels import rotary

        rotary.context_kv_store(kv_rows, cos, sin, k_norm_weights, caches, slot_mapping, eps)
    else:
        _rot.context_kv_store(kv_rows, cos, sin, k_norm_weights, caches, slot_mapping, eps)


def qk_norm_partial_rope(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: Tensor, sin: Tensor,
                         q_norm_weight: Tensor, k_norm_weight: Tensor, eps: float, gated: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Qwen3.5's gated attention inputs: qkv [T, H*D*(2 if gated) + 2*KV*D] (gated: per q head
    [query | gate]) -> contiguous q [T, H, D], k [T, KV, D] (zero-centred RMSNorm, then partial
    rotary with cos/sin [T, rotary_dim]), v [T, KV, D], and the gate ([T, H, D] view, or None)."""
    if use_kernels(qkv):
        from ..kernels import partial_rotary

        return partial_rotary.qk_norm_partial_rope(qkv, num_heads, num_kv_heads, head_dim, cos, sin,
                                                   q_norm_weight, k_norm_weight, eps, gated)
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim * (2 if gated else 1), num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    gate = None
    if gated:  # per head: [query (head_dim) | gate (head_dim)]
        q, gate = q.view(t, num_heads, 2 * head_dim).chunk(2, dim=-1)
    q = _pr.apply_partial_rotary(_norm.zero_centred_rms_norm(q.reshape(t, num_heads, head_dim), q_norm_weight, eps),
                                 cos, sin)
    k = _pr.apply_partial_rotary(
        _norm.zero_centred_rms_norm(k.reshape(t, num_kv_heads, head_dim), k_norm_weight, eps), cos, sin)
    v = v.reshape(t, num_kv_heads, head_dim)
    return q.contiguous(), k.contiguous(), v.contiguous(), gate


def sigmoid_gate(out: Tensor, gate: Tensor) -> Tensor:
    """out [T, H*D] * sigmoid(gate [T, H, D]): the gated attention's output gate."""
    if use_kernels(out):
        from ..kernels import partial_rotary

        return partial_rotary.sigmoid_gate(out, gate)
    return out * torch.sigmoid(gate.reshape(out.shape))


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """Merged gate_up [T, 2I] -> silu(gate) * up [T, I]."""
    if use_kernels(gate_up):
        from ..kernels import activation

        return activation.silu_and_mul(gate_up)
    return _act.silu_and_mul(gate_up)


def store_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Rows k, v [T, n_kv, D] into the paged caches at `slot_mapping` (kernel: slot < 0 skipped)."""
    if use_kernels(k):
        from ..kernels import attention

        attention.store_kv(k_cache, v_cache, k, v, slot_mapping)
    else:
        _attn.write_kv(k_cache, v_cache, k, v, slot_mapping)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: _attn.AttentionMetadata, scale: float,
                    batch_invariant: bool = False, window: int | None = None) -> Tensor:
    """`batch_invariant`: the model's exact-mode flag: the kernel's fixed-size context splits
    and single geometry (kernels/attention.py). The reference loop is per request already.
    `window`: a sliding-window layer's window (ops/attention.py window_start); None: full."""
    if use_kernels(q):
        from ..kernels import attention

        return attention.paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.page_tables, scale,
            meta.causal, meta.max_query_len, exact=batch_invariant, window=window,
        )
    return _attn.paged_attention(q, k_cache, v_cache, meta, scale, window)


def sample(logits: Tensor, st: _sampling.SamplingTensors, all_greedy: bool) -> Tensor:
    """logits [N, V] (float32, or bf16/fp16 from `logits` on the kernel path) -> tokens [N]
    int64 (greedy rows: the argmax)."""
    if use_kernels(logits):
        from ..kernels import sampling

        return sampling.sample(logits, st.greedy, st.temperature, st.top_k, st.top_p, st.min_p, st.seed,
                               st.position, all_greedy=all_greedy)
    if all_greedy:
        return _sampling.greedy(logits)
    return _sampling.sample(logits, st)


def accept(draft_tokens: Tensor, target_tokens: Tensor) -> Tensor:
    """draft [n, B-1], target [n, B] -> accepted drafts per request [n] int64."""
    if use_kernels(target_tokens):
        from ..kernels import sampling

        return sampling.accept(draft_tokens, target_tokens)
    return _sampling.accept(draft_tokens, target_tokens)


def synthetic_accept(drafts: Tensor, sampled: Tensor, seed: Tensor, position: Tensor, rates: Tensor
                     ) -> tuple[Tensor, Tensor]:
    """Benchmark-only acceptance (integer ops only: one implementation, capturable)."""
    return _sampling.synthetic_accept(drafts, sampled, seed, position, rates)
