"""Sliding-window DFlash drafts: the draft config's layer_types / sliding_window, paged
attention that honours a window (transformers' reading: a query at p sees keys in
[p - W + 1, p + W - 1]), the draft forward against a dense HF-style oracle, and the count of
dead leading draft positions (CPU, float32)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from attention_meta import meta_for_batch
from tiny_models import make_tiny_dflash_draft, make_tiny_qwen3

from dflash_engine.models.config import DraftConfig, draft_config_dict
from dflash_engine.models.dflash import DFlashDraftModel
from dflash_engine.models.loader import load_draft, load_target
from dflash_engine.ops import dispatch
from dflash_engine.ops.attention import dead_positions, paged_attention, paged_attention_sdpa, window_start

FULL, SLIDE = "full_attention", "sliding_attention"


def draft_dict(**kw):
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_target_layers": 8, "block_size": 4,
         "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "rope_theta": 10000.0, "rope_scaling": None,
         "rms_norm_eps": 1e-6, "vocab_size": 100, "dflash_config": {"mask_token_id": 99, "target_layer_ids": [1, 5]}}
    d.update(kw)
    return d


# ----------------------------------------------------------------------------- config

def test_config_parses_layer_types_and_window():
    cfg = DraftConfig.from_dict(draft_dict(layer_types=[SLIDE, SLIDE, FULL], sliding_window=5,
                                           use_sliding_window=True))
    assert cfg.layer_types == [SLIDE, SLIDE, FULL] and cfg.sliding_window == 5
    assert cfg.layer_windows == [5, 5, None]
    # no layer_types: every layer full attention, whatever sliding_window says
    plain = DraftConfig.from_dict(draft_dict(sliding_window=4096))
    assert plain.layer_types == [FULL] * 3 and plain.layer_windows == [None] * 3 and plain.sliding_window is None
    # an absent use_sliding_window keeps the window; an explicit false drops it, as transformers' Qwen3Config
    assert DraftConfig.from_dict(draft_dict(layer_types=[SLIDE, FULL, FULL], sliding_window=3)).layer_windows \
        == [3, None, None]
    off = DraftConfig.from_dict(draft_dict(layer_types=[SLIDE, FULL, FULL], sliding_window=3,
                                           use_sliding_window=False))
    assert off.layer_windows == [None] * 3


@pytest.mark.parametrize("bad, match", [
    (dict(layer_types=[SLIDE, "linear_attention", FULL], sliding_window=4), "unknown types.*linear_attention"),
    (dict(layer_types=[SLIDE, FULL], sliding_window=4), "must name 3 layers"),
    (dict(layer_types=[SLIDE, FULL, FULL]), "sliding_window is None"),
    (dict(layer_types=[SLIDE, FULL, FULL], sliding_window=0), "sliding_window is 0"),
    (dict(layer_types=[SLIDE, FULL, FULL], sliding_window=2.5), "integer >= 1"),
    (dict(layer_types=[SLIDE, FULL, FULL], sliding_window=True), "integer >= 1"),
])
def test_config_validation_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        DraftConfig.from_dict(draft_dict(**bad))


def test_writer_round_trips_sliding_layers(tmp_path):
    target = make_tiny_qwen3(tmp_path / "t")
    tcfg = load_target(target).config
    types = [SLIDE, SLIDE, SLIDE, FULL]
    cfg = draft_config_dict(tcfg, num_layers=4, block_size=8, mask_token_id=tcfg.vocab_size - 1,
                            target_layer_ids=[0, 1, 2, 3], layer_types=types, sliding_window=16,
                            attention={"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32})
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 16 and cfg["layer_types"] == types
    parsed = DraftConfig.from_dict(cfg)
    assert parsed.layer_windows == [16, 16, 16, None]
    assert (parsed.num_attention_heads, parsed.num_key_value_heads, parsed.head_dim) == (2, 1, 32)
    full = draft_config_dict(tcfg, num_layers=2, block_size=8, mask_token_id=0, target_layer_ids=[0, 1])
    assert full["use_sliding_window"] is False and full["sliding_window"] is None
    # and the loader builds the windowed draft from a directory
    d = make_tiny_dflash_draft(tmp_path / "d", target, num_layers=2, target_layer_ids=[1, 2], extra_config={
        "layer_types": [SLIDE, FULL], "sliding_window": 4, "use_sliding_window": True})
    draft = load_draft(d, tcfg)
    assert [layer.self_attn.window for layer in draft.layers] == [4, None]


# ----------------------------------------------------------------------------- attention

def dense_oracle(q, k, v, q_pos, k_pos, causal, window, scale):
    """Masked softmax attention over dense K/V [S, KV, D]: the definition, nothing shared."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    allowed = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    for i, p in enumerate(q_pos):
        for j, kp in enumerate(k_pos):
            if causal and kp > p:
                allowed[i, j] = False
            if window is not None and not (p - window < kp < p + window):
                allowed[i, j] = False
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, v.double()).float()


def paged_batch(q_lens, seq_lens, page_size=4, n_kv=2, n_heads=4, d=8, seed=0):
    """Random K/V of several requests on scattered pages, their queries and metadata."""
    gen = torch.Generator().manual_seed(seed)
    pages_per = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = 1 + sum(pages_per)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables, at = [], 0
    for n in pages_per:
        tables.append(perm[at:at + n])
        at += n
    k_cache = torch.randn(num_pages, page_size, n_kv, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, n_kv, d, generator=gen)
    q = torch.randn(sum(q_lens), n_heads, d, generator=gen)
    return q, k_cache, v_cache, tables


def dense_kv(cache, table, seq_len, page_size):
    return torch.stack([cache[table[p // page_size], p % page_size] for p in range(seq_len)])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 3, 6, 100])
def test_reference_attention_with_window_equals_dense_oracle(causal, window):
    q_lens, seq_lens, page_size = [4, 1, 5], [21, 9, 5], 4
    q, k_cache, v_cache, tables = paged_batch(q_lens, seq_lens, page_size)
    meta, _ = meta_for_batch(q_lens, seq_lens, tables, page_size, causal)
    scale = 8 ** -0.5
    # positions no query of this step reads hold NaN: they must not be touched
    for r, (q_len, s) in enumerate(zip(q_lens, seq_lens)):
        for p in range(window_start(s - q_len, window)):
            k_cache[tables[r][p // page_size], p % page_size] = float("nan")
            v_cache[tables[r][p // page_size], p % page_size] = float("nan")
    got = paged_attention(q, k_cache, v_cache, meta, scale, window)
    fast = paged_attention_sdpa(q, k_cache, v_cache, meta, scale, window)
    row = 0
    for r, (q_len, s) in enumerate(zip(q_lens, seq_lens)):
        first = window_start(s - q_len, window)
        k = dense_kv(k_cache, tables[r], s, page_size)[first:]
        v = dense_kv(v_cache, tables[r], s, page_size)[first:]
        ref = dense_oracle(q[row:row + q_len], k, v, list(range(s - q_len, s)), list(range(first, s)), causal,
                           window, scale)
        torch.testing.assert_close(got[row:row + q_len], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast[row:row + q_len], ref, rtol=1e-5, atol=1e-5)
        row += q_len
    assert torch.isfinite(got).all()


def test_window_covering_everything_is_full_attention():
    q_lens, seq_lens = [3, 2], [11, 6]
    q, k_cache, v_cache, tables = paged_batch(q_lens, seq_lens, seed=1)
    meta, _ = meta_for_batch(q_lens, seq_lens, tables, 4, False)
    full = paged_attention(q, k_cache, v_cache, meta, 0.3)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.3, window=11), full)
    # one key short of the oldest position: the first row no longer sees position 0
    assert not torch.equal(paged_attention(q, k_cache, v_cache, meta, 0.3, window=8)[:1], full[:1])


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_path_agrees_with_the_reference_under_a_window(monkeypatch, causal):
    """dispatch.paged_attention on the Triton kernel (on a CPU host: under the interpreter)
    honours the window as the reference does, in the default and the exact mode."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q_lens, seq_lens = [4, 1, 5], [21, 9, 5]
    q, k_cache, v_cache, tables = (x.to(device) if isinstance(x, torch.Tensor) else x
                                   for x in paged_batch(q_lens, seq_lens, d=16))
    meta, _ = meta_for_batch(q_lens, seq_lens, tables, 4, causal, device)
    monkeypatch.setattr(dispatch, "use_kernels", lambda x: True)
    for window in (1, 3, 6):
        ref = paged_attention(q, k_cache, v_cache, meta, 0.3, window)
        for exact in (False, True):
            got = dispatch.paged_attention(q, k_cache, v_cache, meta, 0.3, exact, window=window)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- dead positions

def test_window_start_and_dead_positions():
    assert [window_start(p, 4) for p in (0, 3, 4, 10)] == [0, 0, 1, 7]
    assert window_start(10, None) == 0 and window_start(10, 1) == 10
    assert dead_positions(100, [2048, 2048]) == 0
    assert dead_positions(5000, [2048, 4096]) == 5000 - 4096 + 1
    assert dead_positions(5000, [2048, None]) == 0  # a full-attention layer reads everything
    assert dead_positions(5000, []) == 0
    cfg = DraftConfig.from_dict(draft_dict(layer_types=[SLIDE, SLIDE, FULL], sliding_window=5))
    assert cfg.dead_context_positions(50) == 0
    sliding_only = dataclasses.replace(cfg, layer_types=[SLIDE] * 3)
    assert [sliding_only.dead_context_positions(c) for c in (0, 4, 5, 50)] == [0, 0, 1, 46]


# ----------------------------------------------------------------------------- the draft

def random_draft(cfg: DraftConfig, seed: int) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.2 * torch.randn(p.shape, generator=gen))
    return model


class Kv:
    def __init__(self, cfg: DraftConfig, num_pages: int, page_size: int):
        shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.draft = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_hidden_layers)]


def run_draft(model: DFlashDraftModel, taps, block_embeds, page_size=4, seed=0):
    """Context taps [C, n*H] at positions [0, C), then the block [B, H] at [C, C+B) on
    scattered pages; returns the draft's final hidden rows."""
    cfg = model.config
    c, b = taps.shape[0], block_embeds.shape[0]
    n_pages = math.ceil((c + b) / page_size)
    table = (torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    kv = Kv(cfg, n_pages + 1, page_size)
    ctx_meta, ctx_pos = meta_for_batch([c], [c], [table], page_size, False)
    with torch.no_grad():
        model.write_context(taps, ctx_pos, ctx_meta.slot_mapping, kv)
        meta, pos = meta_for_batch([b], [c + b], [table], page_size, False)
        return model(block_embeds, pos, meta, kv)


def draft_cfg(windows_on: bool, window: int, **kw) -> DraftConfig:
    types = [SLIDE, SLIDE, FULL] if windows_on else [FULL] * 3
    return DraftConfig.from_dict(draft_dict(layer_types=types, sliding_window=window, **kw))


def test_draft_with_window_covering_the_context_equals_full_draft():
    c, b = 13, 4
    gen = torch.Generator().manual_seed(3)
    taps, block = torch.randn(c, 64, generator=gen), torch.randn(b, 32, generator=gen)
    full = random_draft(draft_cfg(False, 4096), seed=1)
    for window in (c + b, 4096):
        windowed = random_draft(draft_cfg(True, window), seed=1)
        windowed.load_state_dict(full.state_dict())
        assert torch.equal(run_draft(windowed, taps, block), run_draft(full, taps, block))
    small = random_draft(draft_cfg(True, 5), seed=1)
    small.load_state_dict(full.state_dict())
    assert not torch.allclose(run_draft(small, taps, block), run_draft(full, taps, block))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def hf_style_draft(model: DFlashDraftModel, taps, block):
    """The draft as the DFlash reference computes it with transformers' masks, densely, in
    float64: ctx = hidden_norm(fc(taps)); per layer, keys/values [ctx K/V | block K/V] at
    positions [0, C+B), queries at [C, C+B), non-causal, a sliding layer's query at p keeping
    keys with p - W < k < p + W (flash-attention window_size (W-1, W-1))."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    c, b = taps.shape[0], block.shape[0]
    nh, nkv, d, eps, theta = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, \
        cfg.rope_theta
    qs, kvs = nh * d, nkv * d
    ctx = rms(taps.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    ctx_pos, q_pos = torch.arange(c), torch.arange(c, c + b)
    k_pos = torch.arange(c + b)
    x = block.double()
    for i, window in enumerate(cfg.layer_windows):
        p = f"layers.{i}."
        w_qkv = sd[p + "self_attn.qkv_proj.weight"]
        wq, wk, wv = w_qkv[:qs], w_qkv[qs:qs + kvs], w_qkv[qs + kvs:]
        qn, kn = sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"]
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        q = rope(rms((h @ wq.T).view(b, nh, d), qn, eps), q_pos, theta)
        k = torch.cat([rope(rms((ctx @ wk.T).view(c, nkv, d), kn, eps), ctx_pos, theta),
                       rope(rms((h @ wk.T).view(b, nkv, d), kn, eps), q_pos, theta)])
        v = torch.cat([(ctx @ wv.T).view(c, nkv, d), (h @ wv.T).view(b, nkv, d)])
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        if window is not None:
            dist = k_pos[None, :] - q_pos[:, None]
            scores = scores.masked_fill(~((dist > -window) & (dist < window)), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v).reshape(b, qs)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = (h @ sd[p + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"], eps).float()


def test_windowed_draft_on_the_kernel_path_equals_the_reference_path(monkeypatch):
    """The draft's whole forward (sliding layers non-causal over context + block) through the
    Triton kernels under the interpreter == through the torch references."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter mode is for machines without a GPU")
    c, b = 14, 4
    gen = torch.Generator().manual_seed(6)
    taps, block = torch.randn(c, 64, generator=gen), torch.randn(b, 32, generator=gen)
    model = random_draft(draft_cfg(True, 5, head_dim=16), seed=3)
    ref = run_draft(model, taps, block)
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    torch.testing.assert_close(run_draft(model, taps, block), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [1, 2, 5, 9])
def test_draft_with_small_window_equals_hf_style_oracle(window):
    c, b = 14, 4
    gen = torch.Generator().manual_seed(4)
    taps, block = torch.randn(c, 64, generator=gen), torch.randn(b, 32, generator=gen)
    model = random_draft(draft_cfg(True, window), seed=2)
    got = run_draft(model, taps, block)
    torch.testing.assert_close(got, hf_style_draft(model, taps, block), rtol=1e-4, atol=1e-4)
