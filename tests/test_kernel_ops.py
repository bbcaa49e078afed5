"""Triton norm / rotary / activation kernels against their torch twins in dflash_engine.ops.

On a GPU host the kernels run on CUDA (float32 and bfloat16); without one, tests/conftest.py
sets TRITON_INTERPRET=1 and they run under Triton's interpreter on CPU tensors (float32;
bfloat16 too for Qwen3.5's gated attention q/k path).
"""
from __future__ import annotations

import pytest
import torch

from dflash_engine.kernels import activation as k_act
from dflash_engine.kernels import norm as k_norm
from dflash_engine.kernels import partial_rotary as k_pr
from dflash_engine.kernels import rotary as k_rot
from dflash_engine.ops import activation as r_act
from dflash_engine.ops import dispatch
from dflash_engine.ops import norm as r_norm
from dflash_engine.ops import rotary as r_rot
from dflash_engine.ops.norm import RMSNorm
from dflash_engine.ops.partial_rotary import apply_partial_rotary
from dflash_engine.ops.rotary import RotaryEmbedding, apply_rotary

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan"))


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: dict | None = None):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.isfinite(got).all()
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= (tol or TOL)[dtype] * scale, f"max abs err {err} vs max |ref| {scale} ({dtype})"


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 256)])
def test_rms_norm(dtype, rows, hidden):
    g = gen(rows * 1000 + hidden)
    x = randn(rows, hidden, g=g, dtype=dtype, scale=3.0)
    w = randn(hidden, g=g, dtype=dtype)
    ref = r_norm.rms_norm(x, w, EPS)
    assert_close(k_norm.rms_norm(x, w, EPS), ref, dtype)
    out = poison(torch.empty_like(ref))
    got = k_norm.rms_norm(x, w, EPS, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_3d_and_strided_rows(dtype):
    g = gen(1)
    # per-head norm over [T, H, D], and rows that are a column slice of a wider tensor
    x = randn(5, 3, 64, g=g, dtype=dtype)
    w = randn(64, g=g, dtype=dtype)
    assert_close(k_norm.rms_norm(x, w, EPS), r_norm.rms_norm(x, w, EPS), dtype)
    wide = randn(9, 300, g=g, dtype=dtype)
    xs = wide[:, 20:148]
    assert xs.stride(0) == 300
    w2 = randn(128, g=g, dtype=dtype)
    assert_close(k_norm.rms_norm(xs, w2, EPS), r_norm.rms_norm(xs, w2, EPS), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 256)])
def test_add_rms_norm(dtype, rows, hidden):
    g = gen(rows * 7 + hidden)
    x = randn(rows, hidden, g=g, dtype=dtype, scale=2.0)
    res = randn(rows, hidden, g=g, dtype=dtype, scale=5.0)
    w = randn(hidden, g=g, dtype=dtype)
    ref_y, ref_r = r_norm.add_rms_norm(x, res, w, EPS)
    # the twin is the unfused layer: h = x + residual; norm(h)
    assert torch.equal(ref_r, x + res)
    assert torch.equal(ref_y, r_norm.rms_norm(x + res, w, EPS))
    y, r = k_norm.add_rms_norm(x, res, w, EPS)
    assert torch.equal(r, ref_r)  # the sum is one rounding of an exact float32 sum
    assert_close(y, ref_y, dtype)
    out, res_out = poison(torch.empty_like(ref_y)), poison(torch.empty_like(ref_r))
    k_norm.add_rms_norm(x, res, w, EPS, out=out, residual_out=res_out)
    assert torch.equal(res_out, ref_r)
    assert_close(out, ref_y, dtype)
    # in place: the residual stream updated where it lies
    res_copy = res.clone()
    y2, r2 = k_norm.add_rms_norm(x, res_copy, w, EPS, residual_out=res_copy)
    assert r2.data_ptr() == res_copy.data_ptr()
    assert torch.equal(res_copy, ref_r)
    assert_close(y2, ref_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_chunked_rows(dtype, monkeypatch):
    """Rows longer than one tile take the two-pass chunked path (also in place)."""
    monkeypatch.setattr(k_norm, "_MAX_SINGLE_TILE", 64)
    monkeypatch.setattr(k_norm, "_CHUNK", 64)
    g = gen(2)
    x = randn(3, 300, g=g, dtype=dtype, scale=2.0)
    res = randn(3, 300, g=g, dtype=dtype)
    w = randn(300, g=g, dtype=dtype)
    assert_close(k_norm.rms_norm(x, w, EPS), r_norm.rms_norm(x, w, EPS), dtype)
    ref_y, ref_r = r_norm.add_rms_norm(x, res, w, EPS)
    y, r = k_norm.add_rms_norm(x, res, w, EPS, residual_out=res)
    assert r.data_ptr() == res.data_ptr()
    assert torch.equal(res, ref_r)
    assert_close(y, ref_y, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunked", [False, True])
def test_zero_centred_norm_is_qwen3_5s(dtype, chunked, monkeypatch):
    """zero_centred=True: transformers' Qwen3_5RMSNorm ((1 + w) on the float32 value, one
    rounding), plain and fused with the residual add, one-tile and chunked rows; not the
    Llama norm (which rounds before the weight)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    if chunked:
        monkeypatch.setattr(k_norm, "_MAX_SINGLE_TILE", 64)
        monkeypatch.setattr(k_norm, "_CHUNK", 64)
    g = gen(5)
    x = randn(6, 3, 160, g=g, dtype=dtype, scale=2.0)
    res = randn(6, 3, 160, g=g, dtype=dtype)
    hf = Qwen3_5RMSNorm(160, eps=EPS).to(DEV, dtype)
    with torch.no_grad():
        hf.weight.copy_(randn(160, g=g, dtype=dtype, scale=0.1))
        ref = hf(x)
        ref_fused = hf(x + res)
    w = hf.weight.detach()
    assert torch.equal(r_norm.zero_centred_rms_norm(x, w, EPS), ref)  # the twin is transformers' formula
    got = k_norm.rms_norm(x, w, EPS, zero_centred=True)
    assert_close(got, ref, dtype)
    y, r = k_norm.add_rms_norm(x, res, w, EPS, zero_centred=True)
    assert torch.equal(r, x + res)
    assert_close(y, ref_fused, dtype)
    if dtype == torch.bfloat16:  # the flag matters: the Llama order differs somewhere
        assert not torch.equal(k_norm.rms_norm(x, 1.0 + w.float(), EPS).to(dtype), got)


# ---------------------------------------------------------------- q/k norm + RoPE

ROPE_SHAPES = [  # (T, H, KV, D)
    (5, 4, 2, 64),    # GQA 2
    (7, 8, 1, 128),   # GQA 8 (one KV head)
    (3, 2, 2, 32),    # MHA
    (9, 6, 2, 80),    # head_dim whose half is not a power of two
]


def rope_inputs(t, h, kv, d, dtype, seed, qk_norm=True):
    g = gen(seed)
    qkv = randn(t, (h + 2 * kv) * d, g=g, dtype=dtype, scale=2.0)
    positions = torch.randint(0, 4096, (t,), generator=g).to(DEV)
    cos, sin = RotaryEmbedding(d, 1_000_000.0)(positions, dtype)
    qw = randn(d, g=g, dtype=dtype) if qk_norm else None
    kw = randn(d, g=g, dtype=dtype) if qk_norm else None
    return qkv, cos, sin, qw, kw


def check_qkv(got, ref, dtype):
    for a, b in zip(got, ref):
        assert a.is_contiguous()
        assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("t,h,kv,d", ROPE_SHAPES)
def test_qk_norm_rope(dtype, qk_norm, t, h, kv, d):
    qkv, cos, sin, qw, kw = rope_inputs(t, h, kv, d, dtype, seed=t * 31 + d, qk_norm=qk_norm)
    ref = r_rot.qk_norm_rope(qkv, h, kv, d, cos, sin, qw, kw, EPS)
    assert [tuple(r.shape) for r in ref] == [(t, h, d), (t, kv, d), (t, kv, d)]
    check_qkv(k_rot.qk_norm_rope(qkv, h, kv, d, cos, sin, qw, kw, EPS), ref, dtype)
    # half-width cos/sin, poisoned output buffers, qkv rows with a wider stride
    wide = torch.zeros(t, qkv.shape[1] + 48, device=DEV, dtype=dtype)
    wide[:, 16:16 + qkv.shape[1]] = qkv
    out = tuple(poison(torch.empty_like(r)) for r in ref)
    got = k_rot.qk_norm_rope(wide[:, 16:16 + qkv.shape[1]], h, kv, d, cos[:, : d // 2], sin[:, : d // 2],
                             qw, kw, EPS, out=out)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(got, out))
    check_qkv(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_equals_unmerged_attention_math(dtype):
    """The twin equals today's per-projection path: q/k/v projections, q_norm/k_norm
    modules, apply_rotary (Attention.project_q / project_kv), on a merged weight."""
    t, h, kv, d, hidden = 5, 4, 2, 64, 96
    g = gen(3)
    x = randn(t, hidden, g=g, dtype=dtype)
    wq, wk, wv = (randn(n * d, hidden, g=g, dtype=dtype, scale=0.1) for n in (h, kv, kv))
    q_norm, k_norm = RMSNorm(d, EPS).to(DEV, dtype), RMSNorm(d, EPS).to(DEV, dtype)
    with torch.no_grad():
        q_norm.weight.copy_(randn(d, g=g, dtype=dtype))
        k_norm.weight.copy_(randn(d, g=g, dtype=dtype))
    cos, sin = RotaryEmbedding(d, 10_000.0, {"rope_type": "linear", "factor": 2.0})(
        torch.arange(100, 100 + t, device=DEV), dtype)
    with torch.no_grad():
        q = apply_rotary(q_norm((x @ wq.t()).view(t, h, d)), cos, sin)
        k = apply_rotary(k_norm((x @ wk.t()).view(t, kv, d)), cos, sin)
        v = (x @ wv.t()).view(t, kv, d)
        qkv = x @ torch.cat([wq, wk, wv]).t()
        twin = r_rot.qk_norm_rope(qkv, h, kv, d, cos, sin, q_norm.weight, k_norm.weight, EPS)
        kern = k_rot.qk_norm_rope(qkv, h, kv, d, cos, sin, q_norm.weight, k_norm.weight, EPS)
    for a, b in zip(twin, (q, k, v)):
        assert_close(a, b, dtype)
    check_qkv(kern, twin, dtype)


# ---------------------------------------------------------------- Qwen3.5 gated attention q/k path

PARTIAL_SHAPES = [  # (T, H, KV, D, rotary_dim)
    (3, 4, 1, 256, 64),  # Qwen3.5-like: a group of heads over one KV head, a quarter of each rotated
    (5, 4, 2, 16, 8),    # the tiny test models' geometry
    (4, 3, 1, 48, 12),   # head_dim and rotary half not powers of two
    (2, 2, 1, 32, 32),   # the whole head rotated
]


# Triton's interpreter casts float32 -> bfloat16 by truncation (the GPU rounds to nearest):
# up to an ulp more per rounding on CPU.
PARTIAL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if DEV == "cuda" else 2e-2}


def gated_qkv_inputs(t, h, kv, d, rd, dtype, gated, seed):
    """qkv as a column slice of a wider projection (strided rows), cos/sin [T, rd], weights."""
    g = gen(seed)
    width = h * d * (2 if gated else 1) + 2 * kv * d
    wide = randn(t, width + 24, g=g, dtype=dtype, scale=2.0)
    cos, sin = RotaryEmbedding(rd, 1e7)(torch.randint(0, 4096, (t,), generator=g).to(DEV), dtype)
    qw, kw = (randn(d, g=g, dtype=dtype, scale=0.3) for _ in range(2))
    return wide[:, 8:8 + width], cos, sin, qw, kw


def partial_reference(qkv, h, kv, d, cos, sin, qw, kw, gated):
    """GatedAttention's torch ops: split, zero-centred norm per head, partial rotary."""
    t = qkv.shape[0]
    qs = h * d * (2 if gated else 1)
    q, k, v = qkv[:, :qs], qkv[:, qs:qs + kv * d], qkv[:, qs + kv * d:]
    gate = None
    if gated:
        q, gate = q.reshape(t, h, 2 * d).chunk(2, dim=-1)
    q = apply_partial_rotary(r_norm.zero_centred_rms_norm(q.reshape(t, h, d), qw, EPS), cos, sin)
    k = apply_partial_rotary(r_norm.zero_centred_rms_norm(k.reshape(t, kv, d), kw, EPS), cos, sin)
    return q, k, v.reshape(t, kv, d), gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("t,h,kv,d,rd", PARTIAL_SHAPES)
def test_qk_norm_partial_rope(dtype, gated, t, h, kv, d, rd):
    qkv, cos, sin, qw, kw = gated_qkv_inputs(t, h, kv, d, rd, dtype, gated, seed=t * 7 + d + rd)
    assert qkv.stride(0) == qkv.shape[1] + 24
    ref_q, ref_k, ref_v, ref_gate = partial_reference(qkv, h, kv, d, cos, sin, qw, kw, gated)
    q, k, v, gate = k_pr.qk_norm_partial_rope(qkv, h, kv, d, cos, sin, qw, kw, EPS, gated)
    for got, ref in ((q, ref_q), (k, ref_k)):
        assert got.is_contiguous()
        assert_close(got, ref, dtype, PARTIAL_TOL)
    assert v.is_contiguous() and torch.equal(v, ref_v)
    assert (gate is None) == (ref_gate is None)
    if gated:
        assert torch.equal(gate, ref_gate)
        out = randn(t, h * d, g=gen(t), dtype=dtype)
        ref_out = out * torch.sigmoid(ref_gate.reshape(t, h * d))
        assert_close(k_pr.sigmoid_gate(out, gate), ref_out, dtype, PARTIAL_TOL)


def test_partial_rope_dispatch(monkeypatch):
    """dispatch.qk_norm_partial_rope / sigmoid_gate: the torch branch is GatedAttention's
    ops (bit for bit), the kernel branch close to it."""
    t, h, kv, d, rd = 3, 4, 2, 16, 8
    qkv, cos, sin, qw, kw = gated_qkv_inputs(t, h, kv, d, rd, torch.float32, True, seed=9)
    out = randn(t, h * d, g=gen(10))
    results = []
    for on in (False, True):
        monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1" if on else "0")
        monkeypatch.setenv("DFLASH_REFERENCE_OPS", "0" if on else "1")
        q, k, v, gate = dispatch.qk_norm_partial_rope(qkv, h, kv, d, cos, sin, qw, kw, EPS, gated=True)
        results.append((q, k, v, dispatch.sigmoid_gate(out, gate)))
    ref = partial_reference(qkv, h, kv, d, cos, sin, qw, kw, True)
    for a, b in zip(results[0][:3], ref):
        assert a.is_contiguous() and torch.equal(a, b)
    assert torch.equal(results[0][3], out * torch.sigmoid(ref[3].reshape(t, h * d)))
    for a, b in zip(results[1], results[0]):
        assert a.is_contiguous()
        assert_close(a, b, torch.float32)


# ---------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (7, 100), (5, 1500)])
def test_silu_and_mul(dtype, rows, inter):
    g = gen(rows + inter)
    gate_up = randn(rows, 2 * inter, g=g, dtype=dtype, scale=3.0)
    ref = r_act.silu_and_mul(gate_up)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    assert torch.equal(ref, r_act.silu_and_mul(gate, up))  # the 2-argument form is unchanged
    assert ref.shape == (rows, inter)
    assert_close(k_act.silu_and_mul(gate_up), ref, dtype)
    out = poison(torch.empty_like(ref))
    assert k_act.silu_and_mul(gate_up, out=out).data_ptr() == out.data_ptr()
    assert_close(out, ref, dtype)
    # a row-strided input (a column slice of a wider buffer)
    wide = torch.zeros(rows, 2 * inter + 8, device=DEV, dtype=dtype)
    wide[:, 8:] = gate_up
    assert_close(k_act.silu_and_mul(wide[:, 8:]), ref, dtype)
