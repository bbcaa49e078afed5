"""Triton Gated DeltaNet kernels (kernels/gdn.py) against their torch twins (ops/delta_rule.py,
ops/gdn.py): outputs and slot pools, batch invariance, and ops/gdn.py's kernel dispatch.

Runs on the GPU when there is one, else on CPU tensors under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 when nvidia-smi is absent): float32 and tiny shapes
there. Tolerances: the recurrence 1e-5 of the largest |value| (float32 math, other summation
order); the conv 1e-6 (float32 taps; the twin rounds each product: in float32 that is ~1 ulp),
its windows bit-exact (they are copies); bf16 2e-2 (on the GPU; on CPU too for the raw-gate
test); fla's chunked form 2e-3.
"""
from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton")

from dflash_engine.kernels import gdn as kg  # noqa: E402
from dflash_engine.ops import delta_rule as ref_rule  # noqa: E402
from dflash_engine.ops import gdn as ref_gdn  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEV == "cuda"
DTYPES = [torch.float32] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
FLA_TOL = 2e-3  # fla's chunk kernels take float32 inputs through TF32 dots (4.7e-4 seen on an H200)
H_K, H_V = 2, 4


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def make_case(lengths, d_k, d_v, seed, dtype=torch.float32):
    """Random inputs and slots: reads include -1, writes include -1, one sequence writes the
    slot it read in a middle row and another at its last row; every slot is one sequence's."""
    gen = torch.Generator().manual_seed(seed)
    cu = cu_of(lengths)
    t, r = cu[-1], len(lengths)
    slots = torch.randperm(r + t + 2, generator=gen)
    read = torch.where(torch.rand(r, generator=gen) < 0.3, -1, slots[:r])
    write = torch.where(torch.rand(t, generator=gen) < 0.4, -1, slots[r:r + t])
    for i, n in enumerate(lengths):
        if n >= 1 and read[i] >= 0 and i % 2 == 0:
            write[cu[i] + (n - 1 if i % 4 == 0 else n // 2)] = read[i]
    case = dict(
        q=torch.randn(t, H_K, d_k, generator=gen), k=torch.randn(t, H_K, d_k, generator=gen),
        v=torch.randn(t, H_V, d_v, generator=gen), g=-torch.rand(t, H_V, generator=gen) * 2,
        beta=torch.rand(t, H_V, generator=gen),
    )
    case = {n: x.to(DEV, dtype if n in ("q", "k", "v") else torch.float32) for n, x in case.items()}
    pool = torch.randn(r + t + 2, H_V, d_k, d_v, generator=gen).to(DEV)  # stale states: never read
    return case, cu, pool, read.to(DEV), write.to(DEV)


def assert_close(got, ref, tol):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    err = (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0
    scale = max(ref.float().abs().max().item(), 1.0) if ref.numel() else 1.0
    assert err <= tol * scale, f"max abs err {err} vs max |ref| {scale}"


def kernel_path(monkeypatch, on: bool):
    """ops.gdn through the kernels (on) or the torch twins: DFLASH_KERNELS_ON_CPU on a CPU
    host, DFLASH_REFERENCE_OPS on a GPU one."""
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1" if on else "0")
    monkeypatch.setenv("DFLASH_REFERENCE_OPS", "0" if on else "1")


def run_recurrent(case, cu, pool, read, write, **kw):
    kern_pool, ref_pool = pool.clone(), pool.clone()
    got = kg.fused_recurrent_gated_delta_rule(*case.values(), torch.tensor(cu, device=DEV), kern_pool, read,
                                              write, **kw)
    ref = ref_rule.recurrent_gated_delta_rule(*case.values(), cu, ref_pool, read, write,
                                              scale=kw.get("scale"), use_qk_l2norm=kw.get("use_qk_l2norm", True))
    return got, ref, kern_pool, ref_pool


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths,d_k,d_v", [([1, 4, 1, 3, 2], 16, 16), ([17, 0, 5], 32, 16), ([3, 6], 16, 40)])
def test_recurrent_matches_twin(lengths, d_k, d_v, dtype):
    """Outputs and the whole pool (kept states, untouched slots) equal the twin's; d_v = 40
    spans two value tiles, one partial."""
    case, cu, pool, read, write = make_case(lengths, d_k, d_v, seed=sum(lengths) + d_v, dtype=dtype)
    got, ref, kern_pool, ref_pool = run_recurrent(case, cu, pool, read, write)
    assert_close(got, ref, TOL[dtype])
    assert_close(kern_pool, ref_pool, TOL[dtype])


def test_recurrent_options_and_subset():
    """No in-kernel l2norm, an explicit scale; `seq_ids` runs a subset into `out` in place."""
    case, cu, pool, read, write = make_case([2, 3, 1], 16, 16, seed=3)
    got, ref, kern_pool, ref_pool = run_recurrent(case, cu, pool, read, write, scale=0.3, use_qk_l2norm=False)
    assert_close(got, ref, 1e-5)
    assert_close(kern_pool, ref_pool, 1e-5)
    out = torch.full_like(case["v"], float("nan"))
    sub_pool = pool.clone()
    kg.fused_recurrent_gated_delta_rule(*case.values(), torch.tensor(cu, device=DEV), sub_pool, read, write,
                                        scale=0.3, use_qk_l2norm=False, out=out,
                                        seq_ids=torch.tensor([2, 0], device=DEV))
    rows = list(range(cu[0], cu[1])) + list(range(cu[2], cu[3]))
    assert torch.equal(out[rows], got[rows]), "a sequence's rows do not depend on which others run"
    assert torch.isnan(out[cu[1]:cu[2]]).all(), "rows of sequences not run are left alone"
    kept = [int(s) for s in write[rows] if s >= 0]
    assert torch.equal(sub_pool[kept], kern_pool[kept])


def raw_gates(t, seed, dtype):
    """In_proj-like a, b [T, H_V] (column slices of a wider row: strided), A_log and dt_bias
    [H_V] in `dtype`; a + dt_bias spans both softplus branches (> 20 and very negative)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, 2 * H_V + 5, generator=gen) * 4
    wide[::3, 3] = 25.0  # softplus' linear branch
    wide[1::3, 4] = -30.0  # log1p(exp(x)) of a tiny exp(x)
    wide = wide.to(DEV, dtype)
    a_log = (torch.rand(H_V, generator=gen) * 2 - 1).to(DEV, dtype)
    dt_bias = torch.randn(H_V, generator=gen).to(DEV, dtype)
    return wide[:, 3:3 + H_V], wide[:, 3 + H_V:3 + 2 * H_V], a_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_recurrent_raw_gates_match_twin(dtype):
    """The kernel given raw a, b, A_log, dt_bias (g and beta computed inside) == the twin
    given torch's g, beta (ops.gdn.gdn_gates); a padding sequence of length 0 and -1 slots."""
    lengths = [1, 4, 0, 3, 1]
    case, cu, pool, read, write = make_case(lengths, 16, 16, seed=21, dtype=dtype)
    a, b, a_log, dt_bias = raw_gates(cu[-1], seed=22, dtype=dtype)
    assert a.stride(0) == 2 * H_V + 5
    g, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    case.update(g=g, beta=beta)
    _, ref, _, ref_pool = run_recurrent(case, cu, pool, read, write)
    kern_pool = pool.clone()
    got = kg.fused_recurrent_gated_delta_rule(case["q"], case["k"], case["v"], a, b, torch.tensor(cu, device=DEV),
                                              kern_pool, read, write, a_log=a_log, dt_bias=dt_bias)
    assert_close(got, ref, TOL[dtype])
    assert_close(kern_pool, ref_pool, TOL[dtype])


@pytest.mark.parametrize("mode", ["decode_verify", "mixed"])
def test_ops_dispatch_raw_gates(monkeypatch, mode):
    """ops.gdn.gated_delta_rule(gates=...) on the kernel path (gates inside the recurrent
    kernel; torch's g, beta for the chunked rows of a mixed step) == the torch path."""
    lengths = {"decode_verify": [1, 3, 0, 1], "mixed": [1, 7, 2]}[mode]
    case, cu, pool, read, write = make_case(lengths, 16, 16, seed=31)
    if mode == "mixed":
        write[cu[1]:cu[2] - 1] = -1  # sequence 1 runs chunked
    write_host = write.tolist()
    per_token = ref_gdn.per_token_sequences(cu, write_host)
    assert per_token == {"decode_verify": [True, True, False, True], "mixed": [True, False, True]}[mode]
    gates = raw_gates(cu[-1], seed=32, dtype=torch.float32)
    qkv = [case[n] for n in ("q", "k", "v")]
    results = []
    for on in (False, True):
        kernel_path(monkeypatch, on)
        p = pool.clone()
        o = ref_gdn.gated_delta_rule(*qkv, None, None, cu, p, read, write, write_host, per_token, chunk_size=4,
                                     query_start_loc=torch.tensor(cu, device=DEV) if on else None, gates=gates)
        results.append((o, p))
    (ref, ref_pool), (got, got_pool) = results
    tol = FLA_TOL if ON_GPU and mode == "mixed" and kg._fla_chunk() is not None else 1e-5
    assert_close(got, ref, tol)
    assert_close(got_pool, ref_pool, tol)


@pytest.mark.parametrize("kw", [2, 4, 5])
def test_conv_matches_twin(kw):
    """Strided x rows (a column slice of a wider projection, as the model passes), random
    read / write slots: outputs within 1e-6, every pool slot bit-exact."""
    lengths, c = [1, 5, 2, 0, 3], 24
    _, cu, _, read, write = make_case(lengths, 16, 16, seed=kw)
    gen = torch.Generator().manual_seed(10 + kw)
    x = torch.randn(cu[-1], c + 7, generator=gen)[:, 3:3 + c].to(DEV)
    weight = torch.randn(c, kw, generator=gen).to(DEV)
    pool = torch.randn(cu[-1] + len(lengths) + 2, c, kw - 1, generator=gen).to(DEV)
    kern_pool, ref_pool = pool.clone(), pool.clone()
    got = kg.causal_conv1d(x, weight, torch.tensor(cu, device=DEV), kern_pool, read, write)
    ref = ref_gdn.causal_conv1d(x, weight, cu, ref_pool, read, write)
    assert_close(got, ref, 1e-6)
    assert torch.equal(kern_pool, ref_pool)


@pytest.mark.skipif(not ON_GPU, reason="bf16 conv on the GPU only")
def test_conv_bf16_matches_twin():
    lengths, c, kw = [1, 16, 3], 64, 4
    _, cu, _, read, write = make_case(lengths, 16, 16, seed=1)
    x = torch.randn(cu[-1], c, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(c, kw, device=DEV, dtype=torch.bfloat16)
    pool = torch.randn(cu[-1] + 5, c, kw - 1, device=DEV, dtype=torch.bfloat16)
    kern_pool, ref_pool = pool.clone(), pool.clone()
    got = kg.causal_conv1d(x, weight, torch.tensor(cu, device=DEV), kern_pool, read, write)
    ref = ref_gdn.causal_conv1d(x, weight, cu, ref_pool, read, write)
    assert_close(got, ref, 2e-2)
    assert torch.equal(kern_pool, ref_pool)


def test_batch_invariance():
    """A sequence alone and the same sequence inside a batch of 5: outputs and kept states
    equal bit for bit (recurrence and conv)."""
    lengths, d_k, d_v, c, kw = [2, 7, 1, 4, 3], 16, 32, 20, 4
    case, cu, pool, read, write = make_case(lengths, d_k, d_v, seed=42)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(cu[-1], c, generator=gen).to(DEV)
    weight = torch.randn(c, kw, generator=gen).to(DEV)
    conv_pool = torch.randn(pool.shape[0], c, kw - 1, generator=gen).to(DEV)
    batch_pool, batch_conv = pool.clone(), conv_pool.clone()
    cu_dev = torch.tensor(cu, device=DEV)
    out = kg.fused_recurrent_gated_delta_rule(*case.values(), cu_dev, batch_pool, read, write)
    y = kg.causal_conv1d(x, weight, cu_dev, batch_conv, read, write)
    r = 1
    s, e = cu[r], cu[r + 1]
    alone = {n: t[s:e].clone() for n, t in case.items()}
    alone_pool, alone_conv = pool.clone(), conv_pool.clone()
    one = torch.tensor([0, e - s], device=DEV)
    out_alone = kg.fused_recurrent_gated_delta_rule(*alone.values(), one, alone_pool, read[r:r + 1].clone(),
                                                    write[s:e].clone())
    y_alone = kg.causal_conv1d(x[s:e].clone(), weight, one, alone_conv, read[r:r + 1].clone(), write[s:e].clone())
    assert torch.equal(out_alone, out[s:e])
    assert torch.equal(y_alone, y[s:e])
    kept = [int(t) for t in write[s:e] if t >= 0]
    assert kept, "the case keeps states of this sequence"
    assert torch.equal(alone_pool[kept], batch_pool[kept])
    assert torch.equal(alone_conv[kept], batch_conv[kept])


@pytest.mark.parametrize("w_dtype", [torch.float32] + ([torch.bfloat16] if ON_GPU else []), ids=str)
def test_gated_rms_norm_matches_twin(w_dtype):
    gen = torch.Generator().manual_seed(7)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    x = (torch.randn(5, H_V, 24, generator=gen) * 3).to(DEV, dtype)
    z = torch.randn(5, H_V * 24 + 8, generator=gen)[:, 8:].reshape(5, H_V, 24).to(DEV, dtype)
    w = torch.randn(24, generator=gen).to(DEV, w_dtype)
    assert_close(kg.gated_rms_norm(x, z, w, 1e-6), ref_gdn.gated_rms_norm(x, z, w, 1e-6), TOL[dtype])


@pytest.mark.parametrize("mode", ["decode_verify", "mixed", "prefill"])
def test_ops_dispatch_matches_reference(monkeypatch, mode):
    """ops.gdn on the kernel path (DFLASH_KERNELS_ON_CPU=1 on a CPU host) == the torch path:
    one fused launch when every sequence runs per token (the padding entry of length 0
    included), in place + chunked rows for mixed steps, chunked alone for prefill."""
    lengths = {"decode_verify": [1, 4, 0, 1], "mixed": [1, 9, 4, 0, 3], "prefill": [6, 9]}[mode]
    case, cu, pool, read, write = make_case(lengths, 16, 16, seed=len(mode))
    if mode != "decode_verify":  # prefill rows keep only their last state
        keep_all = {1} if mode == "mixed" else set()
        for r, (s, e) in enumerate(zip(cu, cu[1:])):
            if r not in keep_all:
                write[s:e - 1] = -1
    write_host = write.tolist()
    per_token = ref_gdn.per_token_sequences(cu, write_host)
    assert per_token == {"decode_verify": [True, True, False, True], "mixed": [True, True, False, False, False],
                         "prefill": [False, False]}[mode]
    launches = {"recurrent": 0, "chunk": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            launches[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(kg, "fused_recurrent_gated_delta_rule", counted("recurrent", kg.fused_recurrent_gated_delta_rule))
    monkeypatch.setattr(kg, "chunk_gated_delta_rule", counted("chunk", kg.chunk_gated_delta_rule))
    results = []
    for on in (False, True):
        kernel_path(monkeypatch, on)
        p = pool.clone()
        o = ref_gdn.gated_delta_rule(*case.values(), cu, p, read, write, write_host, per_token, chunk_size=4,
                                     query_start_loc=torch.tensor(cu, device=DEV, dtype=torch.int32) if on else None)
        results.append((o, p))
    assert launches == {"decode_verify": {"recurrent": 1, "chunk": 0}, "mixed": {"recurrent": 1, "chunk": 1},
                        "prefill": {"recurrent": 0, "chunk": 1}}[mode]
    if not ON_GPU:
        assert "fla.ops" not in sys.modules, "fla is imported on CUDA only"
    (ref, ref_pool), (got, got_pool) = results
    fla = ON_GPU and mode != "decode_verify" and kg._fla_chunk() is not None
    tol = FLA_TOL if fla else 1e-5
    assert_close(got, ref, tol)
    assert_close(got_pool, ref_pool, tol)


def test_ops_conv_and_norm_dispatch(monkeypatch):
    lengths, c, kw = [3, 1, 2], 12, 4
    _, cu, _, read, write = make_case(lengths, 16, 16, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(cu[-1], c, generator=gen).to(DEV)
    weight = torch.randn(c, kw, generator=gen).to(DEV)
    pool = torch.randn(cu[-1] + 5, c, kw - 1, generator=gen).to(DEV)
    xs, zs = (torch.randn(cu[-1], 2, 6, generator=gen).to(DEV) for _ in range(2))
    results = []
    for on in (False, True):
        kernel_path(monkeypatch, on)
        p = pool.clone()
        results.append((ref_gdn.causal_conv1d(x, weight, cu, p, read, write), p,
                        ref_gdn.gated_rms_norm(xs, zs, weight[:6, 0], 1e-6)))
    (ref, ref_pool, ref_norm), (got, got_pool, got_norm) = results
    assert_close(got, ref, 1e-6)
    assert torch.equal(got_pool, ref_pool)
    assert_close(got_norm, ref_norm, 1e-5)


@pytest.mark.skipif(not ON_GPU, reason="flash-linear-attention runs on CUDA")
def test_fla_chunk_matches_twin():
    """The chunked form through fla (the `gpu` extra) == the twin, from initial states."""
    if kg._fla_chunk() is None:
        pytest.skip("fla-core is not installed (pip install dflash-engine[gpu])")
    case, cu, _, _, _ = make_case([1, 70, 33, 128], 32, 32, seed=9)
    init = torch.randn(4, H_V, 32, 32, device=DEV)
    o, final = kg.chunk_gated_delta_rule(*case.values(), cu, init)
    ref, ref_final = ref_rule.chunk_gated_delta_rule(*case.values(), cu, init, use_qk_l2norm=True)
    assert_close(o, ref, FLA_TOL)
    assert_close(final, ref_final, FLA_TOL)


@pytest.mark.parametrize("impl", ["kernel", "twin"])
def test_16_bit_state_pool_rows_chain_like_steps(impl):
    """A bf16 state pool (`mamba_ssm_cache_dtype`): a sequence's 6 rows verified in one call
    give, bit for bit, the outputs and kept states of 6 one-row steps that chain through the
    pool (read the slot the previous step wrote): the state is rounded to the pool's dtype
    after every row, so verifying B rows equals decoding them one at a time."""
    case, _, _, _, _ = make_case([6], 16, 16, seed=11)
    pool = torch.zeros(8, H_V, 16, 16, dtype=torch.bfloat16, device=DEV)
    pool[0] = torch.randn(H_V, 16, 16, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)

    def run(rows, p, read, write):
        sub = {n: x[rows] for n, x in case.items()}
        cu = [0, len(rows)]
        if impl == "kernel":
            return kg.fused_recurrent_gated_delta_rule(*sub.values(), torch.tensor(cu, device=DEV), p,
                                                       torch.tensor([read], device=DEV),
                                                       torch.tensor(write, device=DEV))
        return ref_rule.recurrent_gated_delta_rule(*sub.values(), cu, p, torch.tensor([read], device=DEV),
                                                   torch.tensor(write, device=DEV), use_qk_l2norm=True)

    block_pool = pool.clone()
    block_out = run(list(range(6)), block_pool, 0, [1, 2, 3, 4, 5, 6])
    step_pool = pool.clone()
    step_out = torch.cat([run([t], step_pool, t, [t + 1]) for t in range(6)])
    assert torch.equal(block_out, step_out)
    assert torch.equal(block_pool, step_pool)
    # float32 carried across the rows (no rounding) would differ from the chained steps
    unrounded = pool.float().clone()
    run(list(range(6)), unrounded, 0, [1, 2, 3, 4, 5, 6])
    assert not torch.equal(unrounded[6].to(torch.bfloat16), step_pool[6])
