"""`dflash-engine make-random-checkpoint`: random weights in the real Hugging Face Qwen3 /
DFlash format, loadable and servable by this engine (and by transformers)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_engine import LLM, SamplingParams
from dflash_engine.cli import main as cli_main
from dflash_engine.models.config import DraftConfig, ModelConfig, validate_draft_against_target
from dflash_engine.models.loader import load_draft, load_target
from dflash_engine.random_checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    DRAFT_LAYERS,
    draft_config,
    draft_tensor_shapes,
    plan_shards,
    target_config,
    target_tensor_shapes,
    write_sharded_weights,
)
from dflash_engine.tokenizer import Tokenizer

SHARD_LIMIT = 10 * 10**6  # tiny's 151936 x 64 bf16 embedding (19.4 MB) is over it: its own shard


def _numel(shape) -> int:
    return int(torch.Size(shape).numel())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("random_ckpt")
    target, draft = root / "target", root / "draft"
    rc = cli_main(["make-random-checkpoint", "--shape", "tiny", str(target), "--draft", str(draft),
                   "--device", "cpu", "--seed", "7", "--max-shard-size", str(SHARD_LIMIT)])
    assert rc == 0
    return target, draft


def _tensors_by_file(path: Path) -> dict[str, list[str]]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out[file.name] = list(f.keys())
    return out


def test_tiny_directory_is_a_qwen3_checkpoint(tiny):
    target, draft = tiny
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] == 151936 and cfg["torch_dtype"] == "bfloat16"
    gen = json.loads((target / "generation_config.json").read_text())
    assert 151645 in gen["eos_token_id"]
    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["architectures"] == ["DFlashDraftModel"] and dcfg["model_type"] == "qwen3"
    assert dcfg["block_size"] == 16 and dcfg["num_target_layers"] == cfg["num_hidden_layers"]
    assert dcfg["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 3]}
    # The draft's names carry no `model.` prefix; a single file, no index.
    assert [p.name for p in draft.glob("*.safetensors")] == ["model.safetensors"]
    names = _tensors_by_file(draft)["model.safetensors"]
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.mlp.down_proj.weight"} <= set(names)
    assert not any(n.startswith("model.") for n in names)

    t = load_target(target)  # bf16, as the config says
    d = load_draft(draft, ModelConfig.from_dict(cfg))
    emb = t.model.embed_tokens.weight
    assert emb.dtype == torch.bfloat16 and abs(emb.float().std().item() - 0.02) < 1e-3
    assert torch.all(t.model.norm.weight == 1)
    assert d.fc.weight.shape == (64, 2 * 64) and abs(d.fc.weight.float().std().item() - 0.02) < 2e-3


def test_shard_index_covers_every_tensor_exactly_once(tiny):
    target, _ = tiny
    index = json.loads((target / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    by_file = _tensors_by_file(target)
    assert len(by_file) == 3  # embedding | layers + norm | lm_head
    assert set(by_file) == set(weight_map.values())
    stored = [name for names in by_file.values() for name in names]
    assert len(stored) == len(set(stored))  # no tensor in two files
    expected = target_tensor_shapes(target_config("tiny"))
    assert set(stored) == set(weight_map) == set(expected)
    for file, names in by_file.items():
        assert all(weight_map[n] == file for n in names)
    assert index["metadata"]["total_size"] == 2 * sum(_numel(s) for s in expected.values())
    for _file, names in by_file.items():  # only a single oversized tensor may exceed the limit
        data = 2 * sum(_numel(expected[n]) for n in names)
        assert data <= SHARD_LIMIT or len(names) == 1


def test_plan_shards_respects_the_limit_and_keeps_order():
    shapes = target_tensor_shapes(target_config("qwen3-8b"))
    shards = plan_shards(shapes, 2, DEFAULT_MAX_SHARD_BYTES)
    assert [n for s in shards for n in s] == list(shapes)
    assert all(2 * sum(_numel(shapes[n]) for n in s) <= DEFAULT_MAX_SHARD_BYTES for s in shards)
    assert len(shards) == 4  # 16.4 GB in files of at most 5 GB
    small = plan_shards({"a": (10,), "b": (10,), "c": (30,), "d": (5,)}, 1, 20)
    assert small == [["a", "b"], ["c"], ["d"]]


def test_tiny_serves_with_its_draft_and_matches_spec_off(tiny):
    target, draft = tiny
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    spec = LLM(model=str(target), speculative_config={"method": "dflash", "model": str(draft),
               "num_speculative_tokens": 3}, max_model_len=128, device="cpu", dtype="float32")
    outs = spec.generate(prompts, params, use_tqdm=False)
    st = spec.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens == 3 * st.spec_num_drafts
    ref = LLM(model=str(target), max_model_len=128, device="cpu", dtype="float32")
    ref_outs = ref.generate(prompts, params, use_tqdm=False)
    for o, r in zip(outs, ref_outs):
        assert len(o.outputs[0].token_ids) == 8
        assert o.outputs[0].token_ids == r.outputs[0].token_ids  # lossless on CPU float32
    chat = spec.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) >= 1


def test_tokenizer_is_qwen3_and_round_trips(tiny):
    target, _ = tiny
    tok = Tokenizer.from_dir(target)
    assert tok.encode("Hello world") == [9707, 1879]  # Qwen2/Qwen3 BPE ids
    assert tok.eos_token_id == 151645 and tok.token_to_id("<|endoftext|>") == 151643
    for text in ["The capital of France is Paris.", "naïve café, 北京欢迎你 🚀\n\tdef f(x): return x**2"]:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids[0] == 151644 and ids.count(151645) == 2  # specials are single tokens


def test_transformers_loads_the_target_with_no_missing_or_unexpected_keys(tiny):
    transformers = pytest.importorskip("transformers")
    target, _ = tiny
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(target), output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stored = {}
    for file in target.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            stored.update({name: f.get_tensor(name) for name in f.keys()})
    hf = model.state_dict()
    assert set(hf) == set(stored)
    for name, p in hf.items():
        assert torch.equal(p, stored[name]), name


def test_values_depend_on_seed_and_name_not_on_sharding(tiny, tmp_path):
    target, _ = tiny
    again = tmp_path / "again"
    assert cli_main(["make-random-checkpoint", "--shape", "tiny", str(again), "--device", "cpu", "--seed", "7"]) == 0
    assert [p.name for p in again.glob("*.safetensors")] == ["model.safetensors"]  # default 5 GB limit
    name = "model.layers.2.mlp.up_proj.weight"
    file = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(target / file), "pt") as f, safe_open(str(again / "model.safetensors"), "pt") as g:
        assert torch.equal(f.get_tensor(name), g.get_tensor(name))
        assert not torch.equal(g.get_tensor(name), g.get_tensor("model.layers.2.mlp.gate_proj.weight"))
    # Existing weights are not overwritten silently.
    assert cli_main(["make-random-checkpoint", "--shape", "tiny", str(again), "--device", "cpu", "--seed", "8"]) == 2
    assert cli_main(["make-random-checkpoint", "--shape", "tiny", str(again), "--device", "cpu", "--seed", "8",
                     "--overwrite"]) == 0
    with safe_open(str(again / "model.safetensors"), "pt") as g, safe_open(str(target / file), "pt") as f:
        assert not torch.equal(f.get_tensor(name), g.get_tensor(name))


def test_tied_target_stores_lm_head_as_a_copy_of_the_embedding(tmp_path):
    cfg = {**target_config("tiny"), "tie_word_embeddings": True}
    shapes = target_tensor_shapes(cfg)
    from dflash_engine.random_checkpoint import seed_name

    write_sharded_weights(tmp_path, shapes, "bfloat16", torch.device("cpu"), 3,
                          seed_names=lambda n: seed_name(n, cfg))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))


def test_qwen3_8b_config_has_the_published_shape(tmp_path):
    out, draft = tmp_path / "q8", tmp_path / "q8d"
    assert cli_main(["make-random-checkpoint", "--shape", "qwen3-8b", str(out), "--draft", str(draft),
                     "--config-only"]) == 0
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == target_config("qwen3-8b")
    expected = dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                    rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960, model_type="qwen3",
                    architectures=["Qwen3ForCausalLM"], eos_token_id=151645)
    assert {k: cfg[k] for k in expected} == expected
    dcfg = json.loads((draft / "config.json").read_text())
    assert dcfg["num_hidden_layers"] == 5 and dcfg["num_target_layers"] == 36 and dcfg["block_size"] == 16
    assert dcfg["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    t, d = ModelConfig.from_dict(cfg), DraftConfig.from_dict(dcfg)
    validate_draft_against_target(d, t)
    assert (t.num_hidden_layers, t.hidden_size, t.head_dim, t.rope_theta) == (36, 4096, 128, 1e6)
    # Qwen3-8B's published parameter count, and the draft's.
    assert sum(_numel(s) for s in target_tensor_shapes(cfg).values()) == 8_190_735_360
    shapes = draft_tensor_shapes(dcfg)
    assert shapes["fc.weight"] == (4096, 5 * 4096) and shapes["layers.4.mlp.gate_proj.weight"] == (12288, 4096)


def test_qwen3_1_7b_config():
    cfg = target_config("qwen3-1.7b")
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["tie_word_embeddings"]) == (28, 2048, 16, 8, 128, 6144, True)
    dcfg = draft_config(cfg, DRAFT_LAYERS["qwen3-1.7b"])
    assert dcfg["dflash_config"]["target_layer_ids"] == [1, 7, 13, 19, 25]  # DFLASH.md's default taps
    validate_draft_against_target(DraftConfig.from_dict(dcfg), ModelConfig.from_dict(cfg))
    # 1.72 B parameters + the stored copy of the tied embedding = the published files' 2.03 B.
    assert sum(_numel(s) for s in target_tensor_shapes(cfg).values()) == 2_031_739_904
