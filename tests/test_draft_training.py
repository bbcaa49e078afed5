"""A tiny trained DFlash draft (tests/draft_training.py): published format, acceptance measured
with the real inference path (paged target + KVCache + draft, no engine), negative controls.

Run with -s to see the measured numbers.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from attention_meta import meta_for_batch
from draft_training import (
    FIRST_RESERVED_ID,
    TRAIN_PROMPT_SEED,
    TrainReport,
    dense_block_forward,
    generate_training_data,
    measure_acceptance,
    random_prompts,
    train_tiny_draft,
)
from safetensors import safe_open
from tiny_models import draft_tensor_shapes, make_tiny_dflash_draft

from dflash_engine.models import load_draft, load_target
from dflash_engine.models.config import ModelConfig
from dflash_engine.worker.kv_cache import KVCache

BLOCK = 4
HELD_OUT_SEED = 1234
assert HELD_OUT_SEED != TRAIN_PROMPT_SEED


@pytest.fixture(scope="module")
def held_out() -> list[list[int]]:
    return random_prompts(16, 8, seed=HELD_OUT_SEED).tolist()


@pytest.fixture(scope="module")
def trained_stats(trained, held_out):
    return measure_acceptance(trained.target, trained.draft, held_out)


def _variant(trained, name: str, **config_changes):
    """A copy of the trained draft (same weights) with changed config.json fields."""
    path = trained.root / name
    shutil.copytree(trained.draft, path, dirs_exist_ok=True)
    (path / "config.json").write_text(json.dumps({**trained.config, **config_changes}, indent=2))
    return path


def test_training_reduces_the_loss(trained):
    # Training time (~20 s here) is printed by the fixture, not asserted: timings are not tests.
    rep = trained.report
    assert not rep.from_cache
    assert rep.final_loss < rep.first_loss - 3.0, (rep.first_loss, rep.final_loss)


def test_published_format(trained):
    cfg, rep = trained.config, trained.report
    target_cfg = json.loads((trained.target / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == BLOCK and cfg["num_hidden_layers"] == 1
    assert cfg["num_target_layers"] == target_cfg["num_hidden_layers"]
    assert cfg["rope_theta"] == ModelConfig.from_dict(target_cfg).rope_theta == 10000.0
    dflash = cfg["dflash_config"]
    assert dflash["target_layer_ids"] == rep.target_layer_ids == [1, 3]  # explicit, not defaulted
    # the mask is a reserved token id, never produced by the tokenizer nor by the target here
    assert FIRST_RESERVED_ID <= dflash["mask_token_id"] < target_cfg["vocab_size"]
    assert dflash["mask_token_id"] == rep.mask_token_id and rep.mask_token_count == 0
    with safe_open(str(trained.draft / "model.safetensors"), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert shapes == draft_tensor_shapes(cfg, n_taps=2)  # fc, hidden_norm, norm, layers.{i}.* only
    target = load_target(trained.target, dtype="float32")
    draft = load_draft(trained.draft, target.config, dtype="float32")
    assert draft.config.mask_token_id == rep.mask_token_id and draft.config.block_size == BLOCK


def test_training_forward_matches_inference_forward(trained):
    """The dense training forward and the module's paged forward compute the same blocks."""
    target = load_target(trained.target, dtype="float32")
    draft = load_draft(trained.draft, target.config, dtype="float32")
    cfg = draft.config
    tokens, taps, embed, _ = generate_training_data(
        trained.target, random_prompts(2, 8, seed=7), 24, cfg.target_layer_ids)
    anchors = torch.tensor([8, 13, 20])
    block_ids = tokens[:, anchors[:, None] + torch.arange(BLOCK)]
    block_ids[:, :, 1:] = cfg.mask_token_id
    with torch.no_grad():
        dense = dense_block_forward(draft, taps, F.embedding(block_ids, embed), anchors)
    page = 4
    for r in range(2):
        kv = KVCache.allocate(target.config, cfg, 12, page, torch.float32)
        table = [list(range(11, 0, -1))]
        for i, a in enumerate(anchors.tolist()):
            meta, pos = meta_for_batch([a], [a], table, page, True)
            draft.write_context(taps[r, :a], pos, meta.slot_mapping, kv)
            meta, pos = meta_for_batch([BLOCK], [a + BLOCK], table, page, False)
            paged = draft(target.embed(block_ids[r, i]), pos, meta, kv)
            torch.testing.assert_close(paged, dense[r, i], rtol=1e-4, atol=1e-4)


def test_trained_draft_is_accepted_often(trained, held_out, trained_stats):
    untrained_dir = make_tiny_dflash_draft(
        trained.root / "untrained", trained.target, num_layers=1, block_size=BLOCK,
        mask_token_id=trained.report.mask_token_id, target_layer_ids=trained.report.target_layer_ids)
    untrained = measure_acceptance(trained.target, untrained_dir, held_out)
    hist = trained_stats.histogram()
    print(f"\nacceptance (accepted drafts per step, max {BLOCK - 1}): trained {trained_stats.mean:.3f} "
          f"(tau {trained_stats.tau:.2f}, histogram {hist}), untrained {untrained.mean:.3f} "
          f"(histogram {untrained.histogram()})")
    assert trained_stats.mean >= untrained.mean + 1.0
    assert hist[0] > 0, "no fully rejected block"
    assert sum(hist[1:BLOCK - 1]) > 0, "no partially accepted block"
    assert hist[BLOCK - 1] > 0, "no fully accepted block"


@pytest.mark.parametrize("rope_theta, max_fraction", [(100.0, 0.5), (1e6, 0.85)])
def test_rope_mismatch_collapses_acceptance(trained, held_out, trained_stats, rope_theta, max_fraction):
    """DFLASH.md: a RoPE mismatch fails silently; this draft must make it visible."""
    wrong = _variant(trained, f"rope_{rope_theta:g}", rope_theta=rope_theta)
    stats = measure_acceptance(trained.target, wrong, held_out)
    print(f"\nrope_theta {rope_theta:g} instead of {trained.config['rope_theta']:g}: {stats.mean:.3f} "
          f"(histogram {stats.histogram()}) vs trained {trained_stats.mean:.3f}")
    assert stats.mean <= max_fraction * trained_stats.mean


def test_context_at_wrong_positions_collapses_acceptance(trained, held_out, trained_stats):
    """The draft reads its context: context K/V written one position off ruins it."""
    stats = measure_acceptance(trained.target, trained.draft, held_out, context_position_offset=1)
    print(f"\ncontext written at position+1: {stats.mean:.3f} (histogram {stats.histogram()})")
    assert stats.mean <= 0.25 * trained_stats.mean


def test_cache_reuses_a_finished_draft(trained):
    report = TrainReport()
    copy = train_tiny_draft(trained.target, trained.root / "draft_again", block_size=BLOCK,
                            cache_dir=trained.root / "cache", report=report)
    assert report.from_cache
    for name in ("config.json", "model.safetensors"):
        assert (copy / name).read_bytes() == (trained.draft / name).read_bytes()


def test_training_is_deterministic(trained, tmp_path):
    kw = {"steps": 15, "num_prompts": 16, "new_tokens": 16, "seed": 3}
    a = train_tiny_draft(trained.target, tmp_path / "a", **kw)
    b = train_tiny_draft(trained.target, tmp_path / "b", **kw)
    c = train_tiny_draft(trained.target, tmp_path / "c", **{**kw, "seed": 4})
    weights = [(d / "model.safetensors").read_bytes() for d in (a, b, c)]
    assert weights[0] == weights[1] and weights[0] != weights[2]
