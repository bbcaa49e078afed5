"""`dflash-engine train-draft` end to end on a tiny target (CPU, seconds): data written by the
target itself + stdlib code prompts, cached; the exported draft loads and drafts in the
engine (spec-on greedy == spec-off, exact mode); --resume continues a checkpoint exactly.

The training recipe itself (loss falls, acceptance, RoPE/context negative controls) is
checked on the `trained` fixture in test_draft_training.py, which runs the same trainer."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from tiny_models import IM_END_ID, draft_tensor_shapes, one_thread

from dflash_engine import LLM, SamplingParams
from dflash_engine.cli import main as cli_main
from dflash_engine.tokenizer import Tokenizer
from dflash_engine.train.code_prompts import stdlib_code_prompts, stdlib_functions
from dflash_engine.train.data import mask_token_candidates
from dflash_engine.train.self_prompts import user_turn_prefix
from dflash_engine.train.trainer import loss_gamma

BLOCK = 4


def _args(target: Path, out: Path, *extra: str) -> list[str]:
    return ["train-draft", "--target", str(target), "--out", str(out), "--layers", "1",
            "--block-size", str(BLOCK), "--samples", "24", "--max-len", "160", "--response-tokens", "40",
            "--batch-size", "8", "--anchors", "8", "--lr", "1e-2", "--eval-every", "10", "--save-every", "10",
            "--save-dtype", "float32", "--device", "cpu", "--gen-batch", "16", "--no-progress", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory, qwen3_dir):
    root = tmp_path_factory.mktemp("train_draft")
    out = root / "draft"
    with one_thread():
        assert cli_main(_args(qwen3_dir, out, "--steps", "30")) == 0
    report = json.loads((out / "train_report.json").read_text())
    return SimpleNamespace(root=root, out=out, report=report, target=qwen3_dir,
                           config=json.loads((out / "config.json").read_text()))


def test_stdlib_code_prompts_are_deterministic_and_from_the_stdlib():
    a, b = stdlib_code_prompts(12, seed=3), stdlib_code_prompts(12, seed=3)
    assert a == b and len(set(a)) == 12
    assert stdlib_code_prompts(12, seed=4) != a
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in stdlib_functions(limit=20, seed=0)[:20]:
        path = stdlib / (f["module"].replace(".", "/") + ".py")
        if not path.is_file():
            path = stdlib / f["module"].replace(".", "/") / "__init__.py"
        assert f"def {f['name']}(" in path.read_text(encoding="utf-8")
        assert f["signature"].startswith(f"def {f['name']}(") and len(f["doc"]) >= 20
    assert not any("HumanEval" in p for p in a)


def test_stdlib_code_prompts_reuse_functions_under_other_templates_and_their_code_parses():
    """More requests than public functions: every function appears under several templates;
    the HumanEval-like ones keep the docstring's lines; a code block with the function's first
    statements is valid Python (the head is dedented correctly)."""
    import ast
    import re

    from dflash_engine.train.code_prompts import _CODE_TEMPLATES

    n_funcs = 60
    prompts = stdlib_code_prompts(3 * n_funcs, seed=1)
    assert len(prompts) == len(set(prompts)) == 3 * n_funcs
    kinds = {t.split("\n")[0].split("{")[0] for t, _ in _CODE_TEMPLATES}
    assert sum(any(p.startswith(k) for p in prompts) for k in kinds) >= 6  # the templates are mixed
    with_head = [p for p in prompts if p.startswith(("Finish this function", "Explain what this"))]
    assert with_head
    for p in with_head:
        code = re.search(r"```python\n(.*)\n```", p, re.S).group(1)
        tree = ast.parse(code)  # raises on a mis-indented head
        fn = tree.body[0]
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(fn.body) >= 2
    humaneval_like = [p for p in prompts if p.startswith("Complete the following Python function.")]
    assert humaneval_like and all('"""' in p for p in humaneval_like)


def test_build_dataset_stops_at_its_deadline(tmp_path, qwen3_dir):
    """A deadline already past: the prompts of the first step (gen_batch of them) are
    answered, the queued ones dropped, and the cache holds those samples."""
    import time

    from dflash_engine.train.data import DataConfig, build_dataset

    cfg = DataConfig(samples=24, max_len=96, response_tokens=12, gen_batch=2, code_fraction=1.0)
    samples, info = build_dataset(qwen3_dir, tmp_path, cfg, block_size=BLOCK, device="cpu",
                                  deadline=time.monotonic(), log=lambda *_: None)
    assert 0 < len(samples) <= 2 and info["cached"] is False
    again, info2 = build_dataset(qwen3_dir, tmp_path, cfg, block_size=BLOCK, device="cpu", log=lambda *_: None)
    assert info2["cached"] is True and again == samples


def test_extra_data_files_join_the_training_data(run):
    """--extra-data adds an earlier run's samples (plain or gzipped JSONL); the held-out slice
    draws from all of them, and the data key changes (a checkpoint never resumes on other data)."""
    import gzip

    src = Path(run.report["data"]["path"])
    gz = run.root / "extra.jsonl.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    out = run.root / "with_extra"
    with one_thread():
        assert cli_main(_args(run.target, out, "--steps", "2", "--data-dir", str(src.parent),
                              "--extra-data", str(gz))) == 0
    rep = json.loads((out / "train_report.json").read_text())
    n = len(src.read_text().splitlines())
    assert rep["data"]["extra"]["samples"] == n
    assert rep["result"]["num_train"] + rep["result"]["num_held_out"] == 2 * n
    assert rep["data"]["key"] != run.report["data"]["key"]


def test_mask_token_candidates_are_unused_specials(qwen3_dir):
    tok = Tokenizer.from_dir(qwen3_dir)
    cands = mask_token_candidates(tok)
    assert IM_END_ID not in cands and 256 not in cands and 257 not in cands  # eos/pad and template tokens
    assert cands == list(range(259, 300))  # the tiny tokenizer's reserved tokens
    prefix, stops = user_turn_prefix(tok)
    assert prefix == "<|im_start|>user\n" and stops == [IM_END_ID]


def test_loss_gamma():
    assert (loss_gamma(16), loss_gamma(10), loss_gamma(8), loss_gamma(4)) == (7.0, 5.0, 4.0, 2.0)


def test_train_draft_writes_the_published_format(run):
    cfg, res = run.config, run.report["result"]
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == BLOCK
    assert cfg["num_hidden_layers"] == 1 and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [2]  # DFLASH.md's default for one draft layer
    mask = cfg["dflash_config"]["mask_token_id"]
    assert mask == res["mask_token_id"] == 299 and res["mask_token_count"] == 0  # the highest unused special
    with safe_open(str(run.out / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert shapes == draft_tensor_shapes(cfg, n_taps=1)  # HF names, q/k/v + gate/up split, no `model.`
    assert (run.out / "README.md").is_file() and (run.out / "checkpoint.pt").is_file()


def test_train_draft_data_is_self_written_and_stdlib_and_cached(run):
    """The default mix: user turns and code requests the target writes, stdlib code prompts."""
    data = run.report["data"]
    assert data["cached"] is False
    assert (data["code_fraction"], data["self_code_fraction"]) == (0.4, 0.3)
    lines = Path(data["path"]).read_text().splitlines()
    samples = [json.loads(x) for x in lines]
    assert {s["source"] for s in samples} == {"self", "self-code", "stdlib"}
    assert all(len(s["response_ids"]) > BLOCK for s in samples)
    res = run.report["result"]
    assert res["num_train"] + res["num_held_out"] == len(samples) and res["num_held_out"] >= 4


def test_train_draft_loss_goes_down(run):
    res = run.report["result"]
    assert res["steps"] == 30 and res["final_loss"] < res["first_loss"] - 0.5, res
    assert len(res["held_out_history"]) >= 2  # the held-out τ estimate ran during training


def test_trained_draft_loads_and_drafts_losslessly(run):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(11 * i + 5 * j) % 256 for j in range(4 + 3 * i)]} for i in range(4)]
    spec = {"method": "dflash", "model": str(run.out), "draft_length": "fixed"}
    on = LLM(model=str(run.target), device="cpu", speculative_config=spec, batch_invariant=True)
    off = LLM(model=str(run.target), device="cpu", batch_invariant=True)
    a = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert a == b
    st = on.stats()
    assert st.spec_num_drafts > 0 and st.spec_num_draft_tokens == st.spec_num_drafts * (BLOCK - 1)


def test_resume_continues_exactly(run):
    """stop at step 20 of 40, --resume to 40 == 40 steps in one go (same data, from the cache)."""
    data_dir = str(run.out / "data")
    a, b = run.root / "resumed", run.root / "straight"
    with one_thread():
        assert cli_main(_args(run.target, a, "--steps", "40", "--stop-at", "20", "--data-dir", data_dir)) == 0
        first = json.loads((a / "train_report.json").read_text())
        assert first["result"]["steps"] == 20 and first["data"]["cached"] is True
        assert cli_main(_args(run.target, a, "--steps", "40", "--resume", "--data-dir", data_dir)) == 0
        assert cli_main(_args(run.target, b, "--steps", "40", "--data-dir", data_dir)) == 0
    resumed = json.loads((a / "train_report.json").read_text())["result"]
    assert resumed["resumed_from"] == 20 and resumed["steps"] == 40
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_resume_refuses_another_configuration(run):
    with pytest.raises(ValueError, match="another draft configuration"):
        cli_main(_args(run.target, run.out, "--steps", "31", "--resume", "--layers", "2"))


@pytest.mark.parametrize("model", ["qwen3_dir", "llama_tied_dir"])
def test_dense_target_taps_match_the_engines_paged_forward(request, model):
    """The trainer's taps (a dense causal forward) are the residual stream the engine's
    target hands the draft at inference (paged forward), last layer included."""
    from attention_meta import meta_for_batch

    from dflash_engine.models import load_target
    from dflash_engine.train.dense import dense_target_taps
    from dflash_engine.worker.kv_cache import KVCache

    target = load_target(request.getfixturevalue(model), dtype="float32")
    taps_at = [0, 2, target.config.num_hidden_layers - 1]
    gen = torch.Generator().manual_seed(5)
    lens = [11, 7]
    ids = torch.zeros(2, 11, dtype=torch.int64)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(0, 256, (n,), generator=gen)
    dense = dense_target_taps(target, ids, taps_at)
    kv = KVCache.allocate(target.config, None, 8, 4, torch.float32)
    meta, pos = meta_for_batch(lens, lens, [[3, 1, 5], [7, 2]], 4, True)
    with torch.no_grad():
        _, paged = target(torch.cat([ids[0, :11], ids[1, :7]]), pos, meta, kv, taps_at)
    torch.testing.assert_close(paged[:11], dense[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(paged[11:], dense[1, :7], rtol=1e-4, atol=1e-4)  # padding changes nothing before it


def test_data_only_stops_after_the_cached_data(run, capsys):
    out = run.root / "data_only"
    assert cli_main(_args(run.target, out, "--steps", "30", "--data-only", "--data-dir", str(run.out / "data"))) == 0
    assert "data ready" in capsys.readouterr().out
    assert not (out / "model.safetensors").exists() and not (out / "train_report.json").exists()


def test_time_budget_fits_the_steps_and_the_schedule_to_the_clock(run):
    """A budget far below what --steps needs: the run calibrates, fits its total steps (the
    cosine then ends at the fitted step) and exports."""
    import time

    from dflash_engine.train import Sample, TrainConfig, train

    lines = Path(run.report["data"]["path"]).read_text().splitlines()
    samples = [Sample(**json.loads(x)) for x in lines]
    cfg = TrainConfig(num_layers=1, block_size=BLOCK, steps=1_000_000, batch_size=4, anchors_per_seq=4,
                      eval_every=0, save_every=0, save_dtype="float32", time_budget_s=4.0)
    out = run.root / "budget"
    t0 = time.perf_counter()
    res = train(run.target, out, samples, cfg, device="cpu", progress=False, save_checkpoints=False,
                log=lambda *_: None)
    assert time.perf_counter() - t0 < 4.0 + 20.0  # loading and export on top of the budget
    # far fewer steps than asked; the bound on seconds is loose (a busy 2-core machine is slow)
    assert 1 < res.steps < 1_000_000 and res.seconds <= 4.0 * 2, (res.steps, res.seconds)
    assert (out / "model.safetensors").is_file()


def test_init_from_starts_from_another_drafts_weights(run):
    """--init-from with 0 steps exports the source draft's weights unchanged; a run that does
    train starts from them (its first held-out τ is the source's, not a random draft's); a draft
    of another configuration is refused by name."""
    data_dir = str(run.out / "data")
    same, longer = run.root / "init0", run.root / "init5"
    with one_thread():
        assert cli_main(_args(run.target, same, "--steps", "0", "--data-dir", data_dir,
                              "--init-from", str(run.out))) == 0
        assert cli_main(_args(run.target, longer, "--steps", "5", "--eval-every", "1", "--data-dir", data_dir,
                              "--lr", "1e-5", "--init-from", str(run.out))) == 0  # (a small step: still near)
    with safe_open(str(run.out / "model.safetensors"), framework="pt") as a, \
            safe_open(str(same / "model.safetensors"), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())  # noqa: SIM118
        for k in a.keys():  # noqa: SIM118
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k
    first_tau = json.loads((longer / "train_report.json").read_text())["result"]["held_out_history"][0][1]
    assert abs(first_tau - run.report["result"]["held_out_tau"]) < 0.5
    with pytest.raises(ValueError, match="num_hidden_layers"):
        cli_main(_args(run.target, run.root / "bad", "--steps", "1", "--data-dir", data_dir,
                       "--layers", "2", "--init-from", str(run.out)))


def test_held_out_split_is_by_content_and_stable_under_more_data():
    """The held-out slice is chosen by each sample's content: the same samples whatever their
    order, and a run with more data (--extra-data, more samples) holds out a superset, so a warm
    start never scores a sample it trained on; tiny datasets still get a few held out."""
    import random

    from dflash_engine.train.data import Sample, split_held_out

    rng = random.Random(0)

    def fake(n):
        return [Sample([1, 2, rng.randrange(1000)], [rng.randrange(1000) for _ in range(8)], "self") for _ in range(n)]

    base, more = fake(2000), fake(2000)
    train_a, held_a = split_held_out(base, 0.05)
    assert len(train_a) + len(held_a) == 2000 and 50 < len(held_a) < 150  # ~5%
    shuffled = base[:]
    rng.shuffle(shuffled)
    assert sorted(map(str, split_held_out(shuffled, 0.05)[1])) == sorted(map(str, held_a))
    _, held_ab = split_held_out(more + base, 0.05)
    assert {str(x) for x in held_a} <= {str(x) for x in held_ab}
    assert not {str(x) for x in held_a} & {str(x) for x in train_a}
    tiny_train, tiny_held = split_held_out(base[:24], 0.05)
    assert len(tiny_held) == 4 and len(tiny_train) == 20


def test_code_source_all_adds_the_installed_packages():
    """--code-source all: functions from site-packages too (read as source, never imported);
    stdlib-only stays the default."""
    from dflash_engine.train.code_prompts import code_roots

    purelib = Path(sysconfig.get_paths()["purelib"])
    assert code_roots("stdlib") == [Path(sysconfig.get_paths()["stdlib"])]
    assert purelib in code_roots("all")
    with pytest.raises(ValueError, match="code source"):
        code_roots("pypi")
    funcs = stdlib_functions(limit=300, seed=0, source="all")
    packages = [f for f in funcs if f["origin"] == "package"]
    assert len(packages) > len(funcs) // 4  # site-packages holds most of the functions
    f = packages[0]
    path = purelib / (f["module"].replace(".", "/") + ".py")
    if not path.is_file():
        path = purelib / f["module"].replace(".", "/") / "__init__.py"
    assert f"def {f['name']}(" in path.read_text(encoding="utf-8")
    assert not any(".tests." in f["module"] or f["module"].startswith("test") for f in funcs)


def test_self_written_code_requests_start_with_their_leads(qwen3_dir):
    """Code requests the target writes itself: each begins with one of the leads, open code
    blocks are closed, and they are distinct."""
    from dflash_engine.train.self_prompts import CODE_LEADS, self_written_prompts

    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=16)
    leads = CODE_LEADS[:2] + ["Complete the following Python function.\n\n```python\ndef"]
    out = self_written_prompts(llm, 9, seed=5, max_tokens=12, leads=leads)
    assert len(out) == len(set(out)) > 0
    assert all(any(p.startswith(lead.strip()) for lead in leads) for p in out)
    assert all(p.count("```") % 2 == 0 for p in out)
    assert {next(lead for lead in leads if p.startswith(lead.strip())) for p in out} == set(leads)


def test_data_shards_split_the_prompts_and_gen_workers_join_them(tmp_path, qwen3_dir):
    """--data-shard i/N answers every N-th prompt of the seed's list (the shards partition
    it); --gen-workers N runs the N shards in processes of their own and trains on all of them."""
    from dflash_engine.train.data import DataConfig, build_dataset

    def data(shard: int, n: int):
        cfg = DataConfig(samples=12, max_len=400, response_tokens=8, gen_batch=8, code_fraction=1.0,
                         shard=shard, num_shards=n)
        return build_dataset(qwen3_dir, tmp_path / "d", cfg, block_size=BLOCK, device="cpu", log=lambda *_: None)[0]

    whole = {tuple(x.prompt_ids) for x in data(0, 1)}
    a, b = ({tuple(x.prompt_ids) for x in data(i, 2)} for i in (0, 1))
    assert a and b and not a & b and a | b == whole
    with pytest.raises(ValueError, match="shard"):
        data(2, 2)
    out = tmp_path / "workers"
    assert cli_main(_args(qwen3_dir, out, "--steps", "2", "--code-fraction", "0.5", "--self-code-fraction", "0.25",
                          "--gen-workers", "2")) == 0
    report = json.loads((out / "train_report.json").read_text())
    files = sorted((out / "data").glob("samples-*.jsonl"))
    assert len(files) == 2
    per_file = [sum(1 for line in f.read_text().splitlines() if line) for f in files]
    res = report["result"]
    assert res["num_train"] + res["num_held_out"] == sum(per_file) and min(per_file) > 0
    sources = {json.loads(line)["source"] for f in files for line in f.read_text().splitlines() if line}
    assert sources == {"self", "self-code", "stdlib"}
    assert cli_main(_args(qwen3_dir, out, "--data-shard", "2/2", "--data-only")) == 2
