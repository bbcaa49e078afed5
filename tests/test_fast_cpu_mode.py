"""The fast CPU mode, the one CPU users get by default (batch_invariant=False: the CPU backend of
python/dflash_engine/cpu/ installed, its fused layer loop and packed GEMM weights).

tests/conftest.py puts the suite in the exact mode; every model and engine here asks for the
fast mode explicitly. The fast mode is not batch-invariant, so a request's bits may depend on
the rows beside it and spec-on may differ from spec-off where two logits nearly tie. Measured
(torch 2.15, 2-core VM): on the trained tiny draft's target, 16 held-out prompts x 40 greedy
tokens, spec-on was token-identical to spec-off for every prompt at c = 1 and c = 8 in all three
formats ("none", "bf16", "int4"), with tau 2.84-2.88 of a possible 4. The tests below demand that
at least 7 of 8 prompts are identical and that 95% of all tokens lie in the common prefixes
(one near-tie flip allowed, a real bug -- a wrong context row, a stale K/V -- breaks most prompts).
"""
from __future__ import annotations

import pytest
import torch
from attention_meta import meta_for_batch

from dflash_engine import LLM, SamplingParams
from dflash_engine.cpu import FastDraft, FastTarget, install
from dflash_engine.cpu.weights import int4_available
from dflash_engine.models import load_draft, load_target
from dflash_engine.models.layers import set_batch_invariant
from dflash_engine.worker.kv_cache import KVCache

needs_int4 = pytest.mark.skipif(not int4_available(), reason="this torch has no CPU int4 GEMM")
N_PROMPTS, MAX_TOKENS = 8, 24
FORMATS = ["none", "bf16", pytest.param("int4", marks=needs_int4)]


def _engine(target, fmt: str, draft=None) -> LLM:
    # draft_length "fixed": every decode step verifies K = 3 drafts (the fast CPU mode's default K),
    # so tau measures the draft, not the adaptive policy's choice of K.
    spec = None if draft is None else {"method": "dflash", "model": str(draft), "draft_length": "fixed"}
    return LLM(model=str(target), device="cpu", batch_invariant=False, cpu_weights=fmt, max_num_seqs=8,
               max_model_len=128, num_gpu_blocks_override=64, speculative_config=spec)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _agreement(got: list[list[int]], ref: list[list[int]]) -> tuple[int, float]:
    """(prompts whose tokens are identical, fraction of all tokens inside the common prefixes)."""
    def prefix(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    return sum(a == b for a, b in zip(got, ref)), sum(map(prefix, got, ref)) / sum(map(len, ref))


@pytest.mark.parametrize("fmt", FORMATS)
def test_spec_on_agrees_with_spec_off_at_c1_and_c8(trained, fmt):
    from draft_training import random_prompts

    prompts = [{"prompt_token_ids": p} for p in random_prompts(N_PROMPTS, 8, seed=4321).tolist()]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    off = _engine(trained.target, fmt)
    ref = _tokens(off.generate(prompts, params, use_tqdm=False))
    on = _engine(trained.target, fmt, trained.draft)
    target, draft = on.engine.runner.models.target, on.engine.runner.models.draft
    assert isinstance(target.backend, FastTarget) and isinstance(draft.backend, FastDraft)  # the fast mode
    alone = [_tokens(on.generate(p, params, use_tqdm=False))[0] for p in prompts]  # c = 1
    tau_alone = on.stats().mean_acceptance_length
    batched = _tokens(on.generate(prompts, params, use_tqdm=False))  # c = 8
    for got in (alone, batched):
        same, tokens = _agreement(got, ref)
        assert same >= N_PROMPTS - 1 and tokens >= 0.95, (same, tokens)
    assert all(len(t) == MAX_TOKENS for t in alone + batched)
    # The trained draft is accepted in the fast mode too: tau > 2 of a possible B = 4.
    assert tau_alone > 2.0 and on.stats().mean_acceptance_length > 2.0


def _run_target(model, kv, tap_layers):
    """A prefill of 7 rows, then a verify block of 4: (final hidden, every layer's residual stream)."""
    out = []
    with torch.no_grad():
        for q_len, seq_len in ((7, 7), (4, 11)):
            meta, positions = meta_for_batch([q_len], [seq_len], [[5, 2, 7]], 4, True)
            ids = torch.arange(seq_len - q_len, seq_len) * 7 % model.config.vocab_size
            out.append(model(ids, positions, meta, kv, tap_layers))
    return out


@pytest.mark.parametrize("fmt, tol", [("none", 1e-5), ("bf16", 2e-2)])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fast_layers_match_the_exact_layers(family, fmt, tol, qwen3_dir, llama_tied_dir):
    """The backend's fused layer loop (q/k norm in one op, RoPE by roll and addcmul, SDPA, packed
    GEMMs) gives every layer's residual stream and the final hidden states of the exact path: to
    float32 rounding unpacked, to the bf16 GEMMs' rounding packed; with (qwen3) and without
    (llama, tied logits) q/k norms; the logits too."""
    path = qwen3_dir if family == "qwen3" else llama_tied_dir
    fast, exact = load_target(path, batch_invariant=False), load_target(path, batch_invariant=True)
    assert install(fast, None, fmt) and isinstance(fast.backend, FastTarget)
    assert install(exact, None, fmt) == [] and exact.backend is None  # never in the exact mode
    layers = list(range(fast.config.num_hidden_layers))
    h = fast.config.hidden_size
    results = []
    for model in (fast, exact):
        results.append(_run_target(model, KVCache.allocate(model.config, None, 8, 4, torch.float32), layers))
    for (hid_f, taps_f), (hid_e, taps_e) in zip(*results):
        for i in layers:
            assert rel_err(taps_f[:, i * h:(i + 1) * h], taps_e[:, i * h:(i + 1) * h]) < tol, (i, fmt)
        assert rel_err(hid_f, hid_e) < tol
        assert rel_err(fast.compute_logits(hid_e), exact.compute_logits(hid_e)) < tol
    # Back to the exact mode: the backend and its column-major relayout ("none") are gone, and the
    # model computes the exact path's bits.
    set_batch_invariant(fast, True)
    assert fast.backend is None and all(p.is_contiguous() for p in fast.parameters())
    again = _run_target(fast, KVCache.allocate(fast.config, None, 8, 4, torch.float32), layers)
    assert all(torch.equal(a, b) for pair_a, pair_b in zip(again, results[1]) for a, b in zip(pair_a, pair_b))


@pytest.mark.parametrize("fmt, tol", [("none", 1e-5), ("bf16", 2e-2)])
def test_fast_draft_matches_the_exact_draft(tmp_path, qwen3_dir, fmt, tol):
    """The draft through the backend: the one-GEMM context write, then the block pass
    (non-causal over context + block), against the exact draft on the same inputs."""
    from tiny_models import make_tiny_dflash_draft

    path = make_tiny_dflash_draft(tmp_path, qwen3_dir, num_layers=2, block_size=4, target_layer_ids=[1, 2])
    hiddens = []
    for exact in (False, True):
        target = load_target(qwen3_dir, batch_invariant=exact)
        draft = load_draft(path, target.config, batch_invariant=exact)
        assert bool(install(target, draft, fmt)) is not exact
        kv = KVCache.allocate(target.config, draft.config, 8, 4, torch.float32)
        gen = torch.Generator().manual_seed(0)
        taps = torch.randn(9, 2 * target.config.hidden_size, generator=gen)
        embeds = torch.randn(4, target.config.hidden_size, generator=gen)
        with torch.no_grad():
            meta, positions = meta_for_batch([9], [9], [[3, 1, 6]], 4, True)
            draft.write_context(taps, positions, meta.slot_mapping, kv)
            meta, positions = meta_for_batch([4], [13], [[3, 1, 6, 2]], 4, False)
            hiddens.append((draft(embeds, positions, meta, kv), kv.draft))
    (h_fast, kv_fast), (h_exact, kv_exact) = hiddens
    for (k_f, v_f), (k_e, v_e) in zip(kv_fast, kv_exact):
        assert rel_err(k_f, k_e) < tol and rel_err(v_f, v_e) < tol
    assert rel_err(h_fast, h_exact) < tol
