"""Gated DeltaNet kernels (Triton); twins: `dflash_engine.ops.gdn` and `ops.delta_rule`.

- `fused_recurrent_gated_delta_rule`: the per-token delta rule over a slot pool of states
  (float32, or 16-bit rounded after every row; decode and verification: the state after
  every row can be kept); given the raw in_proj outputs a, b with A_log and dt_bias, it
  computes g and beta itself (the model's formula, float32: no torch launches for them);
- `causal_conv1d`: the short depthwise causal conv + silu, continuing each sequence from its
  slot's window of the last K-1 inputs;
- `gated_rms_norm`: RMSNorm(x) * weight * silu(gate), the GDN output norm;
- `chunk_gated_delta_rule`: the chunked form (prefill) from flash-linear-attention
  (`fla-core`, the `gpu` extra) on CUDA, the torch twin elsewhere.

Slot contract (models/hybrid_state.py): `read[r]` is the slot sequence r starts from (< 0:
zeros), `write[t]` the slot that receives the state after row t (< 0: not kept). Each
program owns one sequence (and a tile of channels or of one head's values): it loads its
initial state into registers before it writes anything, and slots of different sequences
are distinct (the core allocates them), so a sequence may write the slot it read and no
program reads what another writes.

Invariants: CUDA-graph capturable (no host syncs; grids are functions of the number of
sequences, heads and tiles, all Python ints; rows [cu[r], cu[r+1]) are read from the
`cu_seqlens` device tensor inside the kernels, so a sequence of length 0, a graph's padding
entry, does nothing); batch-invariant (a row's numbers depend on its own sequence only: the
tiles are functions of the head sizes, never of the batch).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["fused_recurrent_gated_delta_rule", "causal_conv1d", "gated_rms_norm", "chunk_gated_delta_rule"]

_L2_EPS = 1e-6  # ops.delta_rule.l2norm's eps (flash-linear-attention's)
_MAX_BV = 32  # value columns per program of the recurrence: state tile [d_k, 32] in registers
_MAX_BC = 256  # channels per program of the conv
_MAX_CONV_K = 5  # the conv window is carried in K-1 <= 4 registers vectors


@triton.jit
def _gdn_gates(a, b, a_log, dt_bias):
    """(g, beta) of one row and value head from the raw in_proj outputs, as the model's torch
    code: g = -exp(A_log) * softplus(a + dt_bias) in float32 (softplus: x above 20, else
    log1p(exp(x)), log1p through the exact-ish log(u) * e / (u - 1) form), beta = sigmoid(b)
    in float32 rounded to b's dtype (torch's sigmoid returns b's dtype)."""
    x = a.to(tl.float32) + dt_bias
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    d = u - 1.0
    log1p = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    g = -tl.exp(a_log) * tl.where(x > 20.0, x, log1p)
    beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)
    return g, beta


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, cu_ptr, seq_ptr, pool_ptr, read_ptr, write_ptr,
    o_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, so_t, so_h, sp_s, sp_h, sp_k,
    scale, eps, D_K, D_V,
    GROUP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, HAS_SEQ_IDS: tl.constexpr,
    ROUND_STATE: tl.constexpr, GATES: tl.constexpr,
):
    """One program: a sequence (program 0's index, or seq_ptr[it] with HAS_SEQ_IDS), a value
    head, BV value columns. The state tile [BK, BV] stays in registers across its rows;
    ROUND_STATE (a pool below float32): rounded to the pool's dtype after every row, as the
    twin does, so a row continues from what the previous row's step would have stored.
    GATES: g_ptr / beta_ptr hold the raw a / b, and g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b) are computed here (`_gdn_gates`); otherwise they hold g and beta."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if HAS_SEQ_IDS:
        i_n = tl.load(seq_ptr + i_n).to(tl.int32)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    i_hk = i_h // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < D_K, o_v < D_V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = pool_ptr + i_h * sp_h + o_k[:, None] * sp_k + o_v[None, :]
    slot = tl.load(read_ptr + i_n).to(tl.int64)
    # masks as tl.where(scalar, block, False): Triton's interpreter refuses block & scalar
    state = tl.load(p_s + tl.maximum(slot, 0) * sp_s, mask=tl.where(slot >= 0, m_s, False), other=0.0).to(tl.float32)
    a_log = 0.0
    dt_bias = 0.0
    if GATES:
        a_log = tl.load(alog_ptr + i_h).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + i_h).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q_ptr + t * sq_t + i_hk * sq_h + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k_ptr + t * sk_t + i_hk * sk_h + o_k, mask=m_k, other=0.0).to(tl.float32)
        if L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + eps)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + eps)
        b_q = b_q * scale
        b_v = tl.load(v_ptr + t * sv_t + i_h * sv_h + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g_ptr + t * sg_t + i_h * sg_h)
        b_beta = tl.load(beta_ptr + t * sb_t + i_h * sb_h)
        if GATES:
            b_g, b_beta = _gdn_gates(b_g, b_beta, a_log, dt_bias)
        else:
            b_g, b_beta = b_g.to(tl.float32), b_beta.to(tl.float32)
        state = state * tl.exp(b_g)
        delta = (b_v - tl.sum(state * b_k[:, None], axis=0)) * b_beta
        state = state + b_k[:, None] * delta[None, :]
        b_o = tl.sum(state * b_q[:, None], axis=0)
        tl.store(o_ptr + t * so_t + i_h * so_h + o_v, b_o.to(o_ptr.dtype.element_ty), mask=m_v)
        w = tl.load(write_ptr + t).to(tl.int64)
        tl.store(p_s + tl.maximum(w, 0) * sp_s, state.to(pool_ptr.dtype.element_ty), mask=tl.where(w >= 0, m_s, False))
        if ROUND_STATE:
            state = state.to(pool_ptr.dtype.element_ty).to(tl.float32)


def _last_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor, state_pool: Tensor,
    read: Tensor, write: Tensor, scale: float | None = None, use_qk_l2norm: bool = True,
    seq_ids: Tensor | None = None, out: Tensor | None = None, a_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
) -> Tensor:
    """The per-token delta rule over a state pool [S, H_v, d_k, d_v] (ops.delta_rule.
    recurrent_gated_delta_rule's contract and math, float32, in one launch).

    q, k [T, H_k, d_k]; v [T, H_v, d_v]; g (log decay), beta [T, H_v]; cu_seqlens [R+1],
    read [R], write [T]: device integer tensors. `seq_ids` [R'] (optional): run only these
    sequences, writing their rows of `out` (the other rows are left as they are). Returns
    o [T, H_v, d_v] in v's dtype (`out` when given).

    `a_log`, `dt_bias` [H_v] (both or neither): g and beta are then the raw in_proj outputs
    a and b ([T, H_v], any row stride), and the kernel computes g = -exp(A_log) *
    softplus(a + dt_bias) and beta = sigmoid(b) itself (ops.gdn.gdn_gates' formula)."""
    t_count, h_v, d_v = v.shape
    h_k, d_k = k.shape[1], k.shape[2]
    if h_v % h_k:
        raise ValueError(f"value heads {h_v} are not a multiple of key heads {h_k}")
    if state_pool.shape[1:] != (h_v, d_k, d_v):
        raise ValueError(f"state pool {tuple(state_pool.shape)} does not hold [H_v, d_k, d_v] = {(h_v, d_k, d_v)}")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device) if out is None else out
    n = (cu_seqlens.shape[0] - 1) if seq_ids is None else seq_ids.shape[0]
    if n == 0 or t_count == 0:
        return out
    if state_pool.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the state pool and `out` need a unit last stride")
    if (a_log is None) != (dt_bias is None):
        raise ValueError("pass both a_log and dt_bias, or neither")
    gates = a_log is not None
    if gates and (a_log.shape != (h_v,) or dt_bias.shape != (h_v,)):
        raise ValueError(f"a_log {tuple(a_log.shape)}, dt_bias {tuple(dt_bias.shape)} are not [{h_v}]")
    q, k, v = (_last_unit(x) for x in (q, k, v))
    a_log, dt_bias = (a_log.contiguous(), dt_bias.contiguous()) if gates else (g, g)  # g: never read
    scale = d_k**-0.5 if scale is None else float(scale)
    bk, bv = triton.next_power_of_2(d_k), min(triton.next_power_of_2(d_v), _MAX_BV)
    seqs = cu_seqlens if seq_ids is None else seq_ids
    _recurrent_kernel[(n, h_v, triton.cdiv(d_v, bv))](
        q, k, v, g, beta, a_log, dt_bias, cu_seqlens, seqs, state_pool, read, write, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        scale, _L2_EPS, d_k, d_v,
        GROUP=h_v // h_k, BK=bk, BV=bv, L2NORM=use_qk_l2norm, HAS_SEQ_IDS=seq_ids is not None,
        ROUND_STATE=state_pool.dtype != torch.float32, GATES=gates,
        num_warps=4 if bk * bv >= 2048 else 1,
    )
    return out


@triton.jit
def _tap(x, c, ROUND: tl.constexpr):
    """One conv tap in float32; the input first rounded to the weight's dtype when the
    window's dtype differs from it (the twin casts the window to the weight's dtype)."""
    if ROUND:
        x = x.to(c.dtype)
    return x.to(tl.float32) * c.to(tl.float32)


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, cu_ptr, pool_ptr, read_ptr, write_ptr, o_ptr,
    sx_t, sw_c, sp_s, sp_c, so_t, C,
    K: tl.constexpr, BC: tl.constexpr, ROUND: tl.constexpr,
):
    """One program: sequence, BC channels. The window (its last K-1 inputs, oldest first,
    in the pool's dtype) rides in registers w0..w3 across the rows."""
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    pool_ty = pool_ptr.dtype.element_ty
    slot = tl.load(read_ptr + i_n).to(tl.int64)
    p_r = pool_ptr + tl.maximum(slot, 0) * sp_s + o_c * sp_c
    m_r = tl.where(slot >= 0, m_c, False)
    w0 = tl.load(p_r, mask=m_r, other=0.0)
    w1 = w0
    w2 = w0
    w3 = w0
    if K > 2:
        w1 = tl.load(p_r + 1, mask=m_r, other=0.0)
    if K > 3:
        w2 = tl.load(p_r + 2, mask=m_r, other=0.0)
    if K > 4:
        w3 = tl.load(p_r + 3, mask=m_r, other=0.0)
    p_w = w_ptr + o_c * sw_c
    c0 = tl.load(p_w, mask=m_c, other=0.0)
    c1 = tl.load(p_w + 1, mask=m_c, other=0.0)
    c2 = c1
    c3 = c1
    c4 = c1
    if K > 2:
        c2 = tl.load(p_w + 2, mask=m_c, other=0.0)
    if K > 3:
        c3 = tl.load(p_w + 3, mask=m_c, other=0.0)
    if K > 4:
        c4 = tl.load(p_w + 4, mask=m_c, other=0.0)
    for t in range(bos, eos):
        xt = tl.load(x_ptr + t * sx_t + o_c, mask=m_c, other=0.0).to(pool_ty)
        acc = _tap(w0, c0, ROUND)  # taps oldest first, as the twin adds them
        if K == 2:
            acc += _tap(xt, c1, ROUND)
        else:
            acc += _tap(w1, c1, ROUND)
            if K == 3:
                acc += _tap(xt, c2, ROUND)
            else:
                acc += _tap(w2, c2, ROUND)
                if K == 4:
                    acc += _tap(xt, c3, ROUND)
                else:
                    acc += _tap(w3, c3, ROUND)
                    acc += _tap(xt, c4, ROUND)
        y = acc.to(c0.dtype).to(tl.float32)  # the conv's result in the weight's dtype
        y = (y / (1.0 + tl.exp(-y))).to(c0.dtype)  # silu, as the twin: in the weight's dtype
        tl.store(o_ptr + t * so_t + o_c, y.to(o_ptr.dtype.element_ty), mask=m_c)
        if K == 2:
            w0 = xt
        elif K == 3:
            w0 = w1
            w1 = xt
        elif K == 4:
            w0 = w1
            w1 = w2
            w2 = xt
        else:
            w0 = w1
            w1 = w2
            w2 = w3
            w3 = xt
        ws = tl.load(write_ptr + t).to(tl.int64)
        p_o = pool_ptr + tl.maximum(ws, 0) * sp_s + o_c * sp_c
        m_o = tl.where(ws >= 0, m_c, False)
        tl.store(p_o, w0, mask=m_o)
        if K > 2:
            tl.store(p_o + 1, w1, mask=m_o)
        if K > 3:
            tl.store(p_o + 2, w2, mask=m_o)
        if K > 4:
            tl.store(p_o + 3, w3, mask=m_o)


def causal_conv1d(
    x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor, read: Tensor, write: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """silu(depthwise causal conv) of each sequence, continuing from its slot's window
    (ops.gdn.causal_conv1d's contract): x [T, C] (rows may be strided); weight [C, K];
    conv_pool [S, C, K-1]; cu_seqlens [R+1], read [R], write [T] device integer tensors.
    The window after row t is stored at conv_pool[write[t]] where >= 0, bit-exact copies of
    the inputs in the pool's dtype. The taps accumulate in float32 (the twin rounds each
    product in the weight's dtype), the conv's result and silu are rounded to the weight's
    dtype as in the twin; the result comes back in x's dtype."""
    t_count, c = x.shape
    kw = weight.shape[1]
    if not 2 <= kw <= _MAX_CONV_K:
        raise ValueError(f"conv kernel width {kw} outside [2, {_MAX_CONV_K}]")
    if conv_pool.shape[1:] != (c, kw - 1) or conv_pool.stride(-1) != 1:
        raise ValueError(f"conv pool {tuple(conv_pool.shape)} is not [S, {c}, {kw - 1}] with unit last stride")
    out = torch.empty((t_count, c), dtype=x.dtype, device=x.device) if out is None else out
    n = cu_seqlens.shape[0] - 1
    if n == 0 or t_count == 0:
        return out
    if out.stride(-1) != 1:
        raise ValueError("`out` needs a unit last stride")
    x, weight = _last_unit(x), _last_unit(weight)
    bc = min(triton.next_power_of_2(c), _MAX_BC)
    _conv_kernel[(n, triton.cdiv(c, bc))](
        x, weight, cu_seqlens, conv_pool, read, write, out,
        x.stride(0), weight.stride(0), conv_pool.stride(0), conv_pool.stride(1), out.stride(0), c,
        K=kw, BC=bc, ROUND=conv_pool.dtype != weight.dtype, num_warps=4 if bc >= 256 else 1,
    )
    return out


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, o_ptr, H, N, sx_t, sx_h, sz_t, sz_h, so_t, so_h, eps,
    BN: tl.constexpr, ROUND_MID: tl.constexpr,
):
    """One program per (row, head): n = RMSNorm(x) in x's dtype, (weight * n) in their
    promoted dtype, times silu(gate) in float32, then x's dtype."""
    row = tl.program_id(0).to(tl.int64)
    t, h = row // H, row % H
    cols = tl.arange(0, BN)
    m = cols < N
    x_ty = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * sx_t + h * sx_h + cols, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = (x * rstd).to(x_ty).to(tl.float32)
    hw = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32) * normed
    if ROUND_MID:
        hw = hw.to(x_ty).to(tl.float32)
    z = tl.load(z_ptr + t * sz_t + h * sz_h + cols, mask=m, other=0.0).to(tl.float32)
    y = hw * (z / (1.0 + tl.exp(-z)))
    tl.store(o_ptr + t * so_t + h * so_h + cols, y.to(o_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * weight * silu(gate) over the last dim (ops.gdn.gated_rms_norm's casts):
    x, gate [T, H, N] (any row and head strides); returns [T, H, N] in x's dtype."""
    if x.dim() != 3 or gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"x {tuple(x.shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}")
    t_count, h, n = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t_count * h == 0:
        return out
    x, gate, weight = _last_unit(x), _last_unit(gate), weight.contiguous()
    bn = triton.next_power_of_2(n)
    _gated_rms_norm_kernel[(t_count * h,)](
        x, gate, weight, out, h, n, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1),
        out.stride(0), out.stride(1), float(eps),
        BN=bn, ROUND_MID=torch.promote_types(weight.dtype, x.dtype) != torch.float32,
        num_warps=1 if bn <= 256 else 4,
    )
    return out


@functools.cache
def _fla_chunk():
    """flash-linear-attention's chunked gated delta rule, or None where `fla` (the `gpu`
    extra) does not import. Imported on first use only: never on CPU-only paths."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:  # absent, or broken against this torch/triton: the twin serves
        return None
    return fla_chunk


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | Sequence[int],
    initial_state: Tensor, scale: float | None = None, use_qk_l2norm: bool = True, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The chunked form (prefill) of the flat batch: initial_state [R, H_v, d_k, d_v]
    float32 -> (o [T, H_v, d_v] in v's dtype, final states [R, H_v, d_k, d_v] float32).

    On CUDA with `fla` importable: fla's varlen kernel (its layout [1, T, H, D], g the log
    decay, states [N, H_v, d_k, d_v] float32, chunks of 64); otherwise ops.delta_rule's twin
    (`chunk_size` applies to it only). Sequences of length 0 must not be passed to fla."""
    fla_chunk = _fla_chunk() if v.is_cuda else None
    if fla_chunk is None:
        from ..ops.delta_rule import chunk_gated_delta_rule as twin

        return twin(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm, chunk_size)
    host = None if isinstance(cu_seqlens, Tensor) else torch.tensor(list(cu_seqlens), dtype=torch.long)
    cu = (host.to(v.device) if host is not None else cu_seqlens.to(v.device, torch.long))
    o, final = fla_chunk(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                         scale=scale, initial_state=initial_state.float().contiguous(), output_final_state=True,
                         use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu, cu_seqlens_cpu=host)
    return o[0], final
