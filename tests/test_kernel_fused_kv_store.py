"""The K/V writes folded into the launch that computes K and V (issue 22, item 2): the
target's and draft's layers (`qk_norm_rope_store`: q/k-norm + RoPE + the paged store in one
launch) and the draft's context write (`context_kv_store`: every draft layer in one GEMM and
one launch, into `KVCache.draft_stack`).

Oracles: the separate launches they replace (qk_norm_rope then store_kv: the same bits), and
the per-layer context write (DFlashDraftModel.write_context without the stacked weights).
On a GPU host on CUDA; without one under Triton's interpreter on CPU (tests/conftest.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_engine.kernels import rotary as k_rot
from dflash_engine.kernels.kv_store import store_kv
from dflash_engine.ops import dispatch
from dflash_engine.ops import rotary as r_rot
from dflash_engine.ops.rotary import RotaryEmbedding
from dflash_engine.worker.kv_cache import KVCache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEV == "cuda" else [])
EPS = 1e-6


def _inputs(t, h, kv, d, dtype, seed, qk_norm=True):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (h + 2 * kv) * d, generator=g) * 2).to(DEV, dtype)
    cos, sin = RotaryEmbedding(d, 1_000_000.0)(torch.randint(0, 4096, (t,), generator=g).to(DEV), dtype)
    qw = torch.randn(d, generator=g).to(DEV, dtype) if qk_norm else None
    kw = torch.randn(d, generator=g).to(DEV, dtype) if qk_norm else None
    return qkv, cos, sin, qw, kw


def _caches(pages, page, kv, d, dtype, flat):
    """A K and a V cache: plain tensors, or strided views into one byte pool (a hybrid target's)."""
    if not flat:
        return (torch.zeros(pages, page, kv, d, dtype=dtype, device=DEV),
                torch.zeros(pages, page, kv, d, dtype=dtype, device=DEV))
    elem = torch.empty((), dtype=dtype).element_size()
    n = page * kv * d * elem
    buf = torch.zeros(pages, 3 * n + 32, dtype=torch.uint8, device=DEV)
    return tuple(buf[:, at:at + n].view(dtype).view(pages, page, kv, d) for at in (16, 16 + n + 8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("t,h,kv,d,page", [(5, 4, 2, 64, 4), (9, 6, 2, 128, 16), (3, 2, 2, 16, 1)])
def test_qk_norm_rope_store_equals_the_two_launches(dtype, flat, qk_norm, t, h, kv, d, page):
    qkv, cos, sin, qw, kw = _inputs(t, h, kv, d, dtype, seed=t * 7 + d, qk_norm=qk_norm)
    pages = 2 + t // page + 1
    slots = torch.randperm(pages * page, generator=torch.Generator().manual_seed(d))[:t].to(DEV)
    slots[1] = -1  # a graph bucket's padding row: writes nothing
    ref_k, ref_v = _caches(pages, page, kv, d, dtype, flat)
    q_ref, k, v = k_rot.qk_norm_rope(qkv, h, kv, d, cos, sin, qw, kw, EPS)
    store_kv(ref_k, ref_v, k, v, slots)
    got_k, got_v = _caches(pages, page, kv, d, dtype, flat)
    q = k_rot.qk_norm_rope_store(qkv, h, kv, d, cos, sin, qw, kw, EPS, got_k, got_v, slots)
    assert torch.equal(q, q_ref)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    assert got_k.abs().sum() > 0 and got_v.abs().sum() > 0  # (something was written)
    # the dispatcher on the kernel path gives the same, fused or not
    for fused in (True, False):
        dk, dv = _caches(pages, page, kv, d, dtype, flat)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dispatch, "FUSED_KV_STORE", fused)
            mp.setattr(dispatch, "use_kernels", lambda x: True)
            dq = dispatch.qk_norm_rope_store(qkv, h, kv, d, cos, sin, qw, kw, EPS, dk, dv, slots)
        assert torch.equal(dq, q) and torch.equal(dk, ref_k) and torch.equal(dv, ref_v)


def test_qk_norm_rope_store_rejects_caches_it_cannot_write_in_place():
    qkv, cos, sin, qw, kw = _inputs(3, 2, 2, 16, torch.float32, seed=1)
    slots = torch.arange(3, device=DEV)
    k_cache, v_cache = _caches(4, 4, 2, 16, torch.float32, False)
    with pytest.raises(ValueError, match="do not take"):
        k_rot.qk_norm_rope_store(qkv, 2, 2, 16, cos, sin, qw, kw, EPS, k_cache.double(), v_cache, slots)
    with pytest.raises(ValueError, match="do not take"):  # heads not contiguous within a slot
        wide = torch.zeros(4, 4, 2, 32, device=DEV)[..., :16]
        k_rot.qk_norm_rope_store(qkv, 2, 2, 16, cos, sin, qw, kw, EPS, wide, v_cache, slots)
    with pytest.raises(ValueError, match="slots for 3 rows"):
        k_rot.qk_norm_rope_store(qkv, 2, 2, 16, cos, sin, qw, kw, EPS, k_cache, v_cache, slots[:2])
    # the dispatcher's kernel path falls back to the two launches for a cache of another dtype
    k64, v64 = k_cache.double(), v_cache.double()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "use_kernels", lambda x: True)
        q = dispatch.qk_norm_rope_store(qkv, 2, 2, 16, cos, sin, qw, kw, EPS, k64, v64, slots)
    q_ref, k, v = k_rot.qk_norm_rope(qkv, 2, 2, 16, cos, sin, qw, kw, EPS)
    assert torch.equal(q, q_ref) and torch.equal(k64[0, :3], k.double()) and torch.equal(v64[0, :3], v.double())


def _stack(layers, pages, page, kv, d, dtype, flat):
    """KVCache.allocate's draft stack (plain or flat pool) for `layers` draft layers."""
    draft = SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=kv, head_dim=d)
    return KVCache.allocate(_TARGET, draft, pages, page, dtype, device=DEV, flat=flat)


_TARGET = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=8)  # (shapes only)


@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
def test_kv_cache_draft_stack_is_the_draft_layers_tensors(flat):
    cache = _stack(3, 5, 4, 2, 16, torch.float32, flat)
    stack = cache.draft_stack
    assert tuple(stack.shape) == (3, 2, 5, 4, 2, 16)
    for layer, (k, v) in enumerate(cache.draft):
        stack[layer, 0].fill_(layer + 1.0)
        stack[layer, 1].fill_(-(layer + 1.0))
        assert (k == layer + 1).all() and (v == -(layer + 1)).all()
    for k, v in cache.target:  # nothing of the target's tensors is inside the stack
        assert (k == 0).all() and (v == 0).all()
    assert KVCache.allocate(_TARGET, None, 4, 4, torch.float32, device=DEV).draft_stack is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_context_kv_store_matches_its_twin(dtype, flat, qk_norm):
    layers, kv, d, page, t = 3, 2, 32, 4, 7
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(t, layers * 2 * kv * d, generator=g).to(DEV, dtype)
    cos, sin = RotaryEmbedding(d, 10_000.0)(torch.randint(0, 900, (t,), generator=g).to(DEV), dtype)
    kw = torch.randn(layers, d, generator=g).to(DEV, dtype) if qk_norm else None
    slots = torch.randperm(6 * page, generator=g)[:t].to(DEV)
    slots[3] = -1
    ref = _stack(layers, 6, page, kv, d, dtype, flat)
    keep = slots >= 0  # (the twin has no padding rows)
    r_rot.context_kv_store(rows[keep], cos[keep], sin[keep], kw, ref.draft_stack, slots[keep], EPS)
    got = _stack(layers, 6, page, kv, d, dtype, flat)
    k_rot.context_kv_store(rows, cos, sin, kw, got.draft_stack, slots, EPS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # (the twin rounds after each RoPE product)
    torch.testing.assert_close(got.draft_stack, ref.draft_stack, atol=tol, rtol=tol)
    written = got.draft_stack.abs().flatten(2, 3).sum(dim=(-1, -2))  # [L, 2, slots]
    assert (written[:, :, slots[slots >= 0]] > 0).all()
    assert int((written > 0).sum()) == layers * 2 * int((slots >= 0).sum())  # nothing else


def test_context_kv_store_rejects_bad_shapes():
    cache = _stack(2, 4, 4, 2, 16, torch.float32, False)
    cos = sin = torch.zeros(3, 16, device=DEV)
    slots = torch.arange(3, device=DEV)
    with pytest.raises(ValueError, match="must be \\[T, 2 \\* 2 \\* 2 \\* 16\\]"):
        k_rot.context_kv_store(torch.zeros(3, 100, device=DEV), cos, sin, None, cache.draft_stack, slots, EPS)
    with pytest.raises(ValueError, match="dtype"):
        k_rot.context_kv_store(torch.zeros(3, 128, device=DEV, dtype=torch.float64), cos, sin, None,
                               cache.draft_stack, slots, EPS)
    with pytest.raises(ValueError, match="k_norm_weights"):
        k_rot.context_kv_store(torch.zeros(3, 128, device=DEV), cos, sin, torch.ones(3, 16, device=DEV),
                               cache.draft_stack, slots, EPS)


@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
def test_draft_context_write_in_one_gemm_equals_the_per_layer_write(tmp_path, qwen3_dir, monkeypatch, flat):
    """DFlashDraftModel.write_context with stacked weights (the GPU kernel path: one GEMM, one
    launch) writes the K/V the per-layer loop writes, into the same slots and no others; the
    exact mode (batch-invariant GEMMs) keeps the per-layer loop."""
    from attention_meta import meta_for_batch
    from tiny_models import make_tiny_dflash_draft

    from dflash_engine.models import load_draft, load_target
    from dflash_engine.models.layers import set_batch_invariant

    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")  # (on a GPU host the models run on CUDA)
    target = load_target(qwen3_dir, batch_invariant=False, device=DEV)
    path = make_tiny_dflash_draft(tmp_path / "draft", qwen3_dir, num_layers=3, block_size=4, target_layer_ids=[1, 2])
    ref, fused = (load_draft(path, target.config, batch_invariant=False, device=DEV) for _ in range(2))
    fused.stack_context_weights()
    h = target.config.hidden_size
    taps = torch.randn(6, 2 * h, generator=torch.Generator().manual_seed(1)).to(DEV)
    meta, positions = meta_for_batch([6], [9], [[3, 1, 2]], 4, True)  # context rows at positions 3..8
    positions, slots = positions.to(DEV), meta.slot_mapping.to(DEV)
    dt = fused.fc.weight.dtype  # (the caches take the model's dtype: bf16 on CUDA)
    slots[2] = -1  # a padding row (the graph step's): written by neither
    caches, launches = [], []
    real = dispatch.context_kv_store
    monkeypatch.setattr(dispatch, "context_kv_store", lambda *a: launches.append(a[0].shape) or real(*a))
    for draft in (ref, fused):
        kv = KVCache.allocate(target.config, draft.config, 4, 4, dt, device=DEV, flat=flat)
        with torch.no_grad():
            if draft is ref:  # (the per-layer loop's torch store has no padding rows)
                keep = slots >= 0
                draft.write_context(taps[keep], positions[keep], slots[keep], kv)
            else:
                draft.write_context(taps, positions, slots, kv)
        caches.append(kv.draft_stack)
    assert launches == [(6, 3 * 2 * fused.config.num_key_value_heads * fused.config.head_dim)]  # fused only
    tol = 1e-5 if dt == torch.float32 else 3e-2
    torch.testing.assert_close(caches[1].float(), caches[0].float(), atol=tol, rtol=tol)
    assert caches[1].count_nonzero() == caches[0].count_nonzero() > 0
    set_batch_invariant(fused, True)  # the exact mode: the per-layer loop, whatever is stacked
    calls = []
    monkeypatch.setattr(dispatch, "context_kv_store", lambda *a: calls.append(a))
    kv = KVCache.allocate(target.config, fused.config, 4, 4, dt, device=DEV, flat=flat)
    with torch.no_grad():
        fused.write_context(taps[:2], positions[:2], slots[:2], kv)
    assert calls == [] and kv.draft_stack.count_nonzero() > 0
