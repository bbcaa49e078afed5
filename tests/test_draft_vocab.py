"""A reduced draft vocabulary (models/draft_vocab.py, speculative_config draft_vocab_size):
the ranking file, its checks, and an engine whose draft proposes among N tokens only, still
giving exactly the spec-off output."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dflash_engine import LLM, SamplingParams
from dflash_engine.config import SpeculativeConfig
from dflash_engine.models import draft_vocab
from dflash_engine.models.layers import CausalLM


def test_ranking_is_by_count_then_token_id():
    counts = np.array([0, 5, 2, 5, 0, 1])
    assert draft_vocab.ranking_from_counts(counts).tolist() == [1, 3, 2, 5, 0, 4]
    assert draft_vocab.count_tokens([[1, 1, 3], [], [5, 1]], 6).tolist() == [0, 3, 0, 1, 0, 1]


def test_load_keeps_the_n_most_frequent_ascending_and_names_bad_input(tmp_path):
    draft_vocab.write(tmp_path, np.array([0, 5, 2, 5, 0, 1]), "test")
    assert draft_vocab.load(tmp_path, 3, 6).tolist() == [1, 2, 3]
    assert draft_vocab.load(tmp_path, 6, 6).tolist() == list(range(6))
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        draft_vocab.load(tmp_path, 7, 6)
    with pytest.raises(ValueError, match="positive integer"):
        draft_vocab.load(tmp_path, 0, 6)
    with pytest.raises(ValueError, match="rank every id"):
        draft_vocab.load(tmp_path, 3, 8)  # a ranking of another vocabulary
    data = json.loads((tmp_path / draft_vocab.FILE).read_text())
    (tmp_path / draft_vocab.FILE).write_text(json.dumps({**data, "token_ids": [1, 1, 2, 3, 4, 5]}))
    with pytest.raises(ValueError, match="rank every id"):
        draft_vocab.load(tmp_path, 3, 6)
    (tmp_path / draft_vocab.FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not a draft vocabulary ranking"):
        draft_vocab.load(tmp_path, 3, 6)
    with pytest.raises(ValueError, match="dflash-engine draft-vocab"):
        draft_vocab.load(tmp_path / "missing", 3, 6)


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_draft_vocab_size_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        SpeculativeConfig.parse({"model": "/x", "draft_vocab_size": bad})


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def pair(trained, tmp_path_factory):
    """The trained tiny draft in a directory of its own with a ranking of the target's answers
    to its training-like prompts, and the spec-off reference on held-out prompts."""
    from draft_training import random_prompts

    draft = tmp_path_factory.mktemp("draft_vocab") / "draft"
    shutil.copytree(trained.draft, draft)
    vocab = trained.config["vocab_size"]
    off = LLM(model=str(trained.target), device="cpu", speculative_config=None)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    train = [{"prompt_token_ids": p} for p in random_prompts(16, 8, seed=99).tolist()]
    counts = draft_vocab.count_tokens(tokens(off.generate(train, params, use_tqdm=False)), vocab)
    draft_vocab.write(draft, counts, "test")
    ps = [{"prompt_token_ids": p} for p in random_prompts(8, 8, seed=4321).tolist()]  # (test_engine's held-out)
    return draft, vocab, ps, params, tokens(off.generate(ps, params, use_tqdm=False))


def run(target, draft, ps, params, size=None):
    spec = {"method": "dflash", "model": str(draft), "draft_length": "fixed"}
    if size is not None:
        spec["draft_vocab_size"] = size
    llm = LLM(model=str(target), device="cpu", max_num_seqs=8, speculative_config=spec)
    return tokens(llm.generate(ps, params, use_tqdm=False)), llm.stats(), llm


def test_the_whole_vocabulary_as_draft_vocabulary_changes_nothing(trained, pair):
    draft, vocab, ps, params, ref = pair
    got, full, _ = run(trained.target, draft, ps, params)
    got_n, same, _ = run(trained.target, draft, ps, params, size=vocab)
    assert got == ref and got_n == ref
    assert (same.spec_num_drafts, same.spec_num_accepted_tokens, same.spec_accepted_per_pos) == (
        full.spec_num_drafts, full.spec_num_accepted_tokens, full.spec_accepted_per_pos)


def test_a_reduced_draft_vocabulary_is_lossless_and_proposes_only_its_tokens(trained, pair, monkeypatch):
    """With a handful of tokens the draft can propose only those: the output is still the
    spec-off one, every proposal is one of them, and acceptance falls (the target's tokens
    outside them are never proposed)."""
    draft, vocab, ps, params, ref = pair
    proposed = []
    real = CausalLM.propose

    def spy(self, hidden):
        out = real(self, hidden)
        proposed.append(out.clone())
        return out
    monkeypatch.setattr(CausalLM, "propose", spy)
    keep = 6
    allowed = set(draft_vocab.load(draft, keep, vocab).tolist())
    got, small, llm = run(trained.target, draft, ps, params, size=keep)
    assert got == ref
    seen = set(np.concatenate([p.numpy() for p in proposed]).tolist())
    assert seen and seen <= allowed
    assert llm.engine.runner.models.target.draft_head.shape[0] == keep
    _, full, _ = run(trained.target, draft, ps, params)
    assert small.spec_num_accepted_tokens < full.spec_num_accepted_tokens


def test_draft_vocab_needs_its_ranking_and_refuses_tensor_parallel(trained, tmp_path):
    spec = {"method": "dflash", "model": str(trained.draft), "draft_vocab_size": 8}
    with pytest.raises(ValueError, match="draft_vocab.json"):
        LLM(model=str(trained.target), device="cpu", speculative_config=spec)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=str(trained.target), device="cpu", speculative_config=spec, tensor_parallel_size=2)


def test_draft_vocab_command_ranks_the_stdlib_text_through_the_targets_tokenizer(qwen3_dir, tmp_path, monkeypatch,
                                                                                 capsys):
    """`dflash-engine draft-vocab --source stdlib-text`: a ranking the engine loads, counting
    what the tokenizer makes of the sources (here three of them)."""
    import textwrap

    from dflash_engine.cli import main
    from dflash_engine.models.loader import read_config
    from dflash_engine.tokenizer import Tokenizer
    from dflash_engine.train import code_prompts

    files = []
    for i, body in enumerate(["def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n", "# a comment\n"]):
        files.append((tmp_path / f"m{i}.py", f"m{i}"))
        files[-1][0].write_text(textwrap.dedent(body))
    monkeypatch.setattr(code_prompts, "_source_files", lambda root, packages: files)
    out = tmp_path / "draft"
    out.mkdir()
    assert main(["draft-vocab", str(qwen3_dir), "--source", "stdlib-text", "--out", str(out)]) == 0
    assert "tokens counted" in capsys.readouterr().out
    vocab = read_config(qwen3_dir)["vocab_size"]
    tok = Tokenizer.from_dir(qwen3_dir)
    want = draft_vocab.count_tokens([tok.encode(f.read_text(), add_special_tokens=False) for f, _ in files], vocab)
    data = json.loads((out / draft_vocab.FILE).read_text())
    assert data["tokens_counted"] == want.sum() * len(code_prompts.code_roots("stdlib"))  # (one root: the stdlib)
    seen = np.flatnonzero(want)
    assert draft_vocab.load(out, len(seen), vocab).tolist() == seen.tolist()  # the seen ids rank first


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_draft_vocabulary_through_the_graphs_equals_eager_and_spec_off(qwen3_dir, random_draft_dir, tmp_path):
    """On the GPU the draft head is a static tensor of the captured graphs: graph replay gives
    eager's tokens, and spec on gives spec off's (float32)."""
    draft = tmp_path / "draft"
    shutil.copytree(random_draft_dir, draft)
    vocab = json.loads((qwen3_dir / "config.json").read_text())["vocab_size"]
    draft_vocab.write(draft, np.random.default_rng(0).integers(0, 100, vocab), "test")
    spec = {"method": "dflash", "model": str(draft), "draft_length": "fixed", "draft_vocab_size": vocab // 3}
    ps = [{"prompt_token_ids": list(range(5 + i, 12 + 2 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=str(qwen3_dir), device="cuda", dtype="float32", max_num_seqs=4, num_gpu_blocks_override=128)
    graphs = LLM(**kw, speculative_config=spec)
    assert graphs.engine.runner.models.target.draft_head.shape[0] == vocab // 3
    on = tokens(graphs.generate(ps, params, use_tqdm=False))
    del graphs
    eager = tokens(LLM(**kw, speculative_config=spec, enforce_eager=True).generate(ps, params, use_tqdm=False))
    off = tokens(LLM(**kw, speculative_config=None).generate(ps, params, use_tqdm=False))
    assert on == eager == off


@pytest.mark.parametrize("gpu", [False, True])
def test_draft_vocab_command_picks_its_source_by_the_device(qwen3_dir, tmp_path, monkeypatch, capsys, gpu):
    """No --source: the target's answers where a GPU generates them, the stdlib text without
    one (answers on a CPU take hours); the choice is printed."""
    import torch

    from dflash_engine.cli import main
    from dflash_engine.train import code_prompts
    from dflash_engine.train import draft_vocab as command

    (tmp_path / "m.py").write_text("x = 1\n")
    monkeypatch.setattr(code_prompts, "_source_files", lambda root, packages: [(tmp_path / "m.py", "m")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    answered = []

    def fake_build_dataset(target, data_dir, cfg, block_size, device):  # the GPU job, not run here
        answered.append(device)
        return [], {}

    monkeypatch.setattr(command, "build_dataset", fake_build_dataset)
    out = tmp_path / "draft"
    out.mkdir()
    assert main(["draft-vocab", str(qwen3_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    source = json.loads((out / draft_vocab.FILE).read_text())["source"]
    if gpu:
        assert answered == ["auto"] and "--source auto: answers" in printed and "greedy answers" in source
    else:
        assert answered == [] and "--source auto: stdlib-text (no GPU" in printed and "standard-library" in source
