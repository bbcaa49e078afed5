"""The step-floor arithmetic of bench/ceilings.py, on a shape small enough to count by hand."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_ceilings",
                                               Path(__file__).resolve().parent.parent / "bench" / "ceilings.py")
ceilings = importlib.util.module_from_spec(_spec)
sys.modules["bench_ceilings"] = ceilings  # dataclasses look their module up
_spec.loader.exec_module(ceilings)

# 1 layer, hidden 4, 2 query heads / 1 KV head of width 2, MLP 8, vocab 10.
TARGET = dict(num_hidden_layers=1, hidden_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
              intermediate_size=8, vocab_size=10, tie_word_embeddings=False)
DRAFT = {**TARGET, "dflash_config": {"target_layer_ids": [0, 0]}}  # 2 taps: fc is 4 x 8
# Rates of 1000 bytes/s and 1000 FLOP/s: 1 byte or 1 FLOP is 1 ms.
RATES = dict(copy_gbs=1e-6, gemm_tflops=1e-9)


def test_decode_floor_by_hand():
    # weights: q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate/up/down 3 x 4x8 = 144 matmul params, norms
    # 2x4 + 2x2 = 12, final norm 4, lm_head 10x4 = 40  -> 200 params = 400 bytes (bf16)
    # KV: 1 layer x (K + V) x 2 = 4 elements a token, 2 requests x (10 read + 1 written) x 2 bytes = 176
    f = ceilings.step_floor(TARGET, batch_size=2, context_len=10, rows_per_request=1, **RATES)
    assert f.bytes == 400 + 176
    # matmuls 2 x (144 + 40) x 2 rows = 736; attention 4 x 2 heads x 2 dims x 11 keys x 1 layer x 2 = 352
    assert f.flops == 736 + 352
    assert f.bytes_ms == pytest.approx(576) and f.flops_ms == pytest.approx(1088)
    assert f.bound == "flops"
    assert ceilings.step_floor_ms(TARGET, batch_size=2, context_len=10, **RATES) == pytest.approx(1088)


def test_draft_verify_floor_by_hand():
    f = ceilings.step_floor(TARGET, DRAFT, batch_size=1, context_len=5, rows_per_request=3, draft_pass=True, **RATES)
    # target: 400 weight bytes + KV 4 x (5 + 3) x 2 = 64
    # draft: fc 32 + hidden_norm 4 + layer 156 + norm 4 = 196 params, + lm_head re-read 40 -> 472 bytes;
    #        draft KV 4 x (5 + 2 x 3) x 2 = 88
    assert f.bytes == 400 + 64 + 472 + 88
    # target: matmuls 2 x 184 x 3 rows = 1104; causal attention over 3x5 + (1+2+3) = 21 pairs: 4x2x2x21 = 336
    # draft: layers 2 x 144 x 3 = 864; attention 4x2x2 x 3 rows x 8 keys = 384; lm_head on 2 rows 2x40x2 = 160;
    #        context update 2 x (fc 32 + k/v 2x4x2) x 3 = 288
    assert f.flops == 1104 + 336 + 864 + 384 + 160 + 288
    assert f.floor_ms == pytest.approx(3136)
    with pytest.raises(ValueError):
        ceilings.step_floor(TARGET, batch_size=1, context_len=5, draft_pass=True, **RATES)


def test_qwen3_8b_floors_match_the_design_numbers():
    # shared/design/GPU.md: at 4.28 TB/s and 787 TFLOP/s, 1024-token context, decode floor
    # 3.6 ms at c=1 and 3.8 at c=8; draft+verify (block 16) 4.3 ms at c=1 and ~12 ms at c=32.
    from dflash_engine.random_checkpoint import draft_config, target_config

    t = target_config("qwen3-8b")
    d = draft_config(t, 5)
    rates = dict(copy_gbs=4280.0, gemm_tflops=787.0)
    assert ceilings.step_floor_ms(t, batch_size=1, context_len=1024, **rates) == pytest.approx(3.6, abs=0.05)
    assert ceilings.step_floor_ms(t, batch_size=8, context_len=1024, **rates) == pytest.approx(3.8, abs=0.05)
    on1 = ceilings.step_floor(t, d, batch_size=1, context_len=1024, rows_per_request=16, draft_pass=True, **rates)
    assert on1.floor_ms == pytest.approx(4.3, abs=0.1) and on1.bound == "bytes"
    on32 = ceilings.step_floor(t, d, batch_size=32, context_len=1024, rows_per_request=16, draft_pass=True, **rates)
    assert on32.floor_ms == pytest.approx(12.0, abs=0.6) and on32.bound == "flops"


def test_measurements_run_on_cpu_with_tiny_sizes():
    copy = ceilings.copy_bandwidth_gbs("cpu", nbytes=1 << 20, repeats=3, warmup=1)
    gemm = ceilings.gemm_tflops("cpu", shapes=[(64, 64, 64)], repeats=3, warmup=1)
    assert copy > 0 and gemm > 0


def test_a_draft_vocabulary_reads_and_multiplies_only_its_rows_of_the_lm_head():
    full = ceilings.step_floor(TARGET, DRAFT, batch_size=1, context_len=5, rows_per_request=3, draft_pass=True, **RATES)
    small = ceilings.step_floor(TARGET, DRAFT, batch_size=1, context_len=5, rows_per_request=3, draft_pass=True,
                                draft_vocab=4, **RATES)
    # the draft's lm_head: 4 of 10 rows x hidden 4 -> 24 params (48 bytes) fewer; logits on 2 rows: 2 x 24 x 2 FLOPs
    assert full.bytes - small.bytes == 48 and full.flops - small.flops == 96
