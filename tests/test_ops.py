"""Torch reference ops against dense / transformers references (CPU, float32)."""
from __future__ import annotations

import math

import pytest
import torch
from attention_meta import meta_for_batch, meta_from_lists

from dflash_engine.models.config import ModelConfig
from dflash_engine.ops import (
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    paged_attention,
    write_kv,
)
from dflash_engine.ops.activation import silu_and_mul

BLOCK = 4
N_HEADS, N_KV, HD = 8, 2, 16


def dense_attention(q, k, v, causal):
    """q [Q, H, D], k/v [S, Hkv, D]; query i sits at position S - Q + i. float64 reference."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s, ql = k.shape[0], q.shape[0]
        mask = torch.arange(s)[None, :] > torch.arange(s - ql, s)[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def make_batch(query_lens, seq_lens, causal, seed=0):
    """Random K/V for each request written through write_kv into randomly placed pages."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-s // BLOCK) for s in seq_lens]
    num_pages = 1 + sum(pages_needed) + 3
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables, start = [], 0
    for n in pages_needed:
        tables.append(perm[start:start + n])
        start += n
    k_cache = torch.zeros(num_pages, BLOCK, N_KV, HD)
    v_cache = torch.zeros_like(k_cache)
    ks = [torch.randn(s, N_KV, HD, generator=gen) for s in seq_lens]
    vs = [torch.randn(s, N_KV, HD, generator=gen) for s in seq_lens]
    full, _ = meta_for_batch(seq_lens, seq_lens, tables, BLOCK, causal)
    write_kv(k_cache, v_cache, torch.cat(ks), torch.cat(vs), full.slot_mapping)
    meta, positions = meta_for_batch(query_lens, seq_lens, tables, BLOCK, causal)
    q = torch.randn(sum(query_lens), N_HEADS, HD, generator=gen)
    return q, k_cache, v_cache, meta, positions, ks, vs, tables


@pytest.mark.parametrize("causal", [True, False])
def test_paged_attention_matches_dense(causal):
    query_lens, seq_lens = [5, 1, 9, 3], [5, 13, 17, 7]
    q, k_cache, v_cache, meta, positions, ks, vs, _ = make_batch(query_lens, seq_lens, causal)
    out = paged_attention(q, k_cache, v_cache, meta, HD**-0.5)
    qsl = meta.query_start_loc_cpu
    for r in range(len(seq_lens)):
        ref = dense_attention(q[qsl[r]:qsl[r + 1]], ks[r], vs[r], causal)
        torch.testing.assert_close(out[qsl[r]:qsl[r + 1]], ref, atol=1e-5, rtol=1e-5)
    expected_pos = [p for ql, sl in zip(query_lens, seq_lens) for p in range(sl - ql, sl)]
    assert positions.tolist() == expected_pos


def test_paged_attention_is_batch_independent():
    query_lens, seq_lens = [3, 1, 6], [11, 6, 6]
    q, k_cache, v_cache, meta, _, _, _, tables = make_batch(query_lens, seq_lens, True, seed=3)
    batched = paged_attention(q, k_cache, v_cache, meta, HD**-0.5)
    alone_meta, _ = meta_for_batch(query_lens[1:2], seq_lens[1:2], tables[1:2], BLOCK, True)
    rows = slice(meta.query_start_loc_cpu[1], meta.query_start_loc_cpu[2])
    alone = paged_attention(q[rows], k_cache, v_cache, alone_meta, HD**-0.5)
    assert torch.equal(alone, batched[rows])


def test_write_kv_slots():
    k_cache = torch.zeros(3, BLOCK, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    k = torch.arange(6.0).view(3, 1, 2)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([4 * 2 + 1, 4 * 1 + 3, 0]))
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(k_cache[1, 3], k[1])
    assert torch.equal(v_cache[0, 0], -k[2])
    assert k_cache.count_nonzero() == 5  # nothing else written (k[0] = [0, 1] holds one zero)


def test_meta_from_lists_pads_page_tables():  # the test helper behind make_batch
    meta = meta_from_lists([5, 6], [0, 1, 2], [3, 1], [[1, 2], [3]], causal=True)
    assert meta.page_tables.tolist() == [[1, 2], [3, 0]]
    assert meta.page_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc_cpu == [0, 1, 2] and meta.seq_lens_cpu == [3, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x = torch.randn(7, 32).to(dtype)
    ours, ref = RMSNorm(32, 1e-6).to(dtype), Qwen3RMSNorm(32, 1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    assert torch.equal(ours(x), ref(x))


def test_silu_and_mul():
    g, u = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(silu_and_mul(g, u), g * torch.sigmoid(g) * u)


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn_no_truncate": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64,
                         "truncate": False, "attention_factor": 1.3},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_matches_transformers(case):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    scaling = ROPE_CASES[case]
    extra = {} if scaling is None else {"rope_scaling": dict(scaling)}
    hf_cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, head_dim=64, rope_theta=500000.0,
                         max_position_embeddings=512, **extra)
    ours_cfg = ModelConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = RotaryEmbedding(ours_cfg.head_dim, ours_cfg.rope_theta, ours_cfg.rope_scaling,
                           ours_cfg.max_position_embeddings)
    ref = LlamaRotaryEmbedding(hf_cfg)
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 511, 3000], dtype=torch.int64)
    x = torch.randn(len(positions), 3, 64)
    cos, sin = ours(positions, x.dtype)
    ref_cos, ref_sin = ref(x, positions[None])
    torch.testing.assert_close(cos, ref_cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, ref_sin[0], atol=1e-6, rtol=0)
    ref_x, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(apply_rotary(x, cos, sin), ref_x[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_rope_v4_style_config_fields():
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "rope_theta": 123.0, "max_position_embeddings": 100,
         "rope_scaling": {"type": "yarn", "factor": 2.0}}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 123.0
    assert cfg.rope_scaling == {"type": "yarn", "factor": 2.0, "rope_type": "yarn",
                                "original_max_position_embeddings": 100}


def test_rope_unsupported_type():
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
         "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
         "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match="dynamic"):
        ModelConfig.from_dict(d)
