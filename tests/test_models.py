"""Models against transformers / dense references, plus configs, loader and KV cache (CPU, float32)."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from attention_meta import meta_for_batch
from safetensors.torch import load_file, save_file
from tiny_models import IM_END_ID, make_tiny_dflash_draft, make_tiny_llama, make_tiny_qwen3

from dflash_engine.models import load_draft, load_target
from dflash_engine.models.config import (
    DraftConfig,
    ModelConfig,
    default_target_layer_ids,
    validate_draft_against_target,
)
from dflash_engine.models.packed import to_checkpoint_state_dict
from dflash_engine.worker.kv_cache import KVCache

BLOCK = 4
N_NEW = 8
TAPS = [0, 2]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
TARGETS = {
    "qwen3": lambda p: make_tiny_qwen3(p, seed=0),
    "qwen3_tied": lambda p: make_tiny_qwen3(p, tie_word_embeddings=True, seed=1),
    "llama_bias_yarn": lambda p: make_tiny_llama(p, attention_bias=True, rope_scaling=YARN, seed=2),
    "llama_tied_llama3": lambda p: make_tiny_llama(p, tie_word_embeddings=True, rope_scaling=LLAMA3, seed=3),
}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), seed=0)


class PagedRequests:
    """Requests in a paged KV cache with randomly scattered pages (a miniature model runner)."""

    def __init__(self, target_cfg, num_requests, max_len, draft_cfg=None, seed=0):
        pages_per = -(-max_len // BLOCK)
        num_pages = 1 + num_requests * pages_per + 2
        self.kv = KVCache.allocate(target_cfg, draft_cfg, num_pages, BLOCK, torch.float32)
        perm = (torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
        self.tables = [perm[r * pages_per:(r + 1) * pages_per] for r in range(num_requests)]
        self.lens = [0] * num_requests

    def meta(self, q_lens, causal=True, advance=True):
        seq_lens = [n + q for n, q in zip(self.lens, q_lens)]
        meta, positions = meta_for_batch(q_lens, seq_lens, self.tables, BLOCK, causal)
        if advance:
            self.lens = seq_lens
        return meta, positions

    def target_step(self, model, chunks, tap_layers=None):
        meta, positions = self.meta([len(c) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
        hidden, taps = model(ids, positions, meta, self.kv, tap_layers)
        return model.compute_logits(hidden), taps, meta


def random_prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("name", list(TARGETS))
def test_target_matches_transformers(name, tmp_path):
    from transformers import AutoModelForCausalLM

    path = TARGETS[name](tmp_path)
    ours = load_target(path, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = random_prompts([7, 13, 3, 10])
    reqs = PagedRequests(ours.config, len(prompts), max(map(len, prompts)) + N_NEW)
    with torch.no_grad():
        logits, taps, meta = reqs.target_step(ours, prompts, tap_layers=TAPS)
        qsl, h = meta.query_start_loc_cpu, ours.config.hidden_size
        for r, prompt in enumerate(prompts):
            rows = slice(qsl[r], qsl[r + 1])
            out = hf(torch.tensor([prompt]), output_hidden_states=True)
            torch.testing.assert_close(logits[rows], out.logits[0].float(), atol=1e-4, rtol=1e-4)
            for j, layer in enumerate(TAPS):
                torch.testing.assert_close(taps[rows, j * h:(j + 1) * h], out.hidden_states[layer + 1][0],
                                           atol=1e-4, rtol=1e-4)

        # Greedy decode, one token per request per step, all requests batched.
        next_tokens = [int(logits[qsl[r + 1] - 1].argmax()) for r in range(len(prompts))]
        generated = [[] for _ in prompts]
        for _ in range(N_NEW):
            for r, t in enumerate(next_tokens):
                generated[r].append(t)
            logits, _, _ = reqs.target_step(ours, [[t] for t in next_tokens])
            next_tokens = logits.argmax(-1).tolist()

        for r, prompt in enumerate(prompts):
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW)
            ref = out[0, len(prompt):].tolist()
            assert generated[r][:len(ref)] == ref  # HF stops at EOS; we kept decoding
            assert len(ref) == N_NEW or ref[-1] == IM_END_ID
    assert len({t for g in generated for t in g}) > 2, "degenerate tiny model: decoding is trivial"


def test_target_is_batch_invariant(qwen3_dir):
    """A request's logits are bit-identical alone and beside others (prefill and decode)."""
    model = load_target(qwen3_dir)
    prompts = random_prompts([7, 13, 3, 10], seed=1)
    batched, alone = PagedRequests(model.config, 4, 32), PagedRequests(model.config, 1, 32, seed=9)
    with torch.no_grad():
        logits_b, _, meta = batched.target_step(model, prompts)
        logits_a, _, _ = alone.target_step(model, prompts[1:2])
        qsl = meta.query_start_loc_cpu
        assert torch.equal(logits_a, logits_b[qsl[1]:qsl[2]])
        for step in range(3):
            tokens = [[(17 * step + r) % 256] for r in range(4)]
            logits_b, _, _ = batched.target_step(model, tokens)
            logits_a, _, _ = alone.target_step(model, tokens[1:2])
            assert torch.equal(logits_a[0], logits_b[1])


def test_target_dtype_and_tied_head(qwen3_dir, tmp_path):
    assert load_target(qwen3_dir).model.embed_tokens.weight.dtype == torch.float32  # auto = checkpoint dtype
    bf16 = load_target(qwen3_dir, dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    tied = load_target(make_tiny_qwen3(tmp_path, tie_word_embeddings=True))
    assert tied.lm_head is None
    hidden = torch.randn(3, tied.config.hidden_size)
    torch.testing.assert_close(tied.compute_logits(hidden), hidden @ tied.model.embed_tokens.weight.T)
    assert tied.compute_logits(hidden.bfloat16().to(torch.float32)).dtype == torch.float32


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """Independent neox RoPE: pair (i, i + d/2) rotates by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def dense_draft(sd, cfg, ctx_taps, block_embeds, theta):
    """DFlash draft written out densely: ctx K/V from fc+hidden_norm, block attends to ctx + block."""
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_ctx, n_blk = ctx_taps.shape[0], block_embeds.shape[0]
    pos_ctx, pos_blk = torch.arange(n_ctx), torch.arange(n_ctx, n_ctx + n_blk)
    ctx = rms(ctx_taps @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    x = block_embeds
    for i in range(cfg["num_hidden_layers"]):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        h = rms(x, w["input_layernorm.weight"])

        def keys(src, pos):
            k = (src @ w["self_attn.k_proj.weight"].T).view(len(pos), nkv, hd)
            k = rms(k, w["self_attn.k_norm.weight"])
            return rope(k, pos, theta), (src @ w["self_attn.v_proj.weight"].T).view(len(pos), nkv, hd)

        q = rope(rms((h @ w["self_attn.q_proj.weight"].T).view(n_blk, nh, hd), w["self_attn.q_norm.weight"]),
                 pos_blk, theta)
        (kc, vc), (kb, vb) = keys(ctx, pos_ctx), keys(h, pos_blk)
        k = torch.cat([kc, kb]).repeat_interleave(nh // nkv, 1)
        v = torch.cat([vc, vb]).repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k).div(math.sqrt(hd)).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(n_blk, -1) @ w["self_attn.o_proj.weight"].T
        h = rms(x, w["post_attention_layernorm.weight"])
        mlp = F.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T)
        x = x + mlp @ w["mlp.down_proj.weight"].T
    return rms(x, sd["norm.weight"])


def test_dflash_draft_matches_dense_reference(qwen3_dir, tmp_path):
    theta, block = 7777.0, 8
    draft_dir = make_tiny_dflash_draft(tmp_path, qwen3_dir, num_layers=2, block_size=block,
                                       target_layer_ids=[0, 2, 3], rope_theta=theta, seed=5)
    target_cfg = ModelConfig.from_dict(json.loads((qwen3_dir / "config.json").read_text()))
    draft = load_draft(draft_dir, target_cfg, dtype="float32")
    sd, cfg = load_file(draft_dir / "model.safetensors"), json.loads((draft_dir / "config.json").read_text())
    assert draft.config.block_size == block and draft.config.target_layer_ids == [0, 2, 3]

    h = target_cfg.hidden_size
    gen = torch.Generator().manual_seed(0)
    ctx_lens = [5, 11]
    taps = [torch.randn(n + block, 3 * h, generator=gen) for n in ctx_lens]  # room to grow the context
    reqs = PagedRequests(target_cfg, 2, max(ctx_lens) + 2 * block, draft.config)

    def write(chunks):  # chunks[r] = (start, end) context rows of request r to append
        meta, positions = reqs.meta([e - s for s, e in chunks])
        rows = torch.cat([taps[r][s:e] for r, (s, e) in enumerate(chunks)])
        draft.write_context(rows, positions, meta.slot_mapping, reqs.kv)

    def check_block():
        embeds = [torch.randn(block, h, generator=gen) for _ in ctx_lens]
        meta, positions = reqs.meta([block] * 2, causal=False, advance=False)
        out = draft(torch.cat(embeds), positions, meta, reqs.kv)
        for r, n in enumerate(reqs.lens):
            ref = dense_draft(sd, cfg, taps[r][:n], embeds[r], theta)
            torch.testing.assert_close(out[r * block:(r + 1) * block], ref, atol=1e-4, rtol=1e-4)

    with torch.no_grad():
        write([(0, 3), (0, 11)])
        write([(3, 5), (11, 11)])  # chunked context for request 0
        check_block()
        # The block K/V above were scratch: committing rows overwrites them and the next
        # draft pass sees exactly the extended context.
        write([(5, 8), (11, 12)])
        check_block()


def test_dflash_draft_is_batch_invariant(qwen3_dir, tmp_path):
    target_cfg = load_target(qwen3_dir).config
    draft = load_draft(make_tiny_dflash_draft(tmp_path, qwen3_dir, target_layer_ids=[1, 2]), target_cfg)
    gen = torch.Generator().manual_seed(0)
    h, block, ctx_lens = target_cfg.hidden_size, draft.config.block_size, [6, 9, 4]
    taps = [torch.randn(n, 2 * h, generator=gen) for n in ctx_lens]
    embeds = [torch.randn(block, h, generator=gen) for _ in ctx_lens]

    def run(reqs, idx):
        meta, positions = reqs.meta([ctx_lens[i] for i in idx])
        draft.write_context(torch.cat([taps[i] for i in idx]), positions, meta.slot_mapping, reqs.kv)
        meta, positions = reqs.meta([block] * len(idx), causal=False)
        return draft(torch.cat([embeds[i] for i in idx]), positions, meta, reqs.kv)

    with torch.no_grad():
        batched = run(PagedRequests(target_cfg, 3, 32, draft.config), [0, 1, 2])
        alone = run(PagedRequests(target_cfg, 1, 32, draft.config, seed=4), [1])
    assert torch.equal(alone, batched[block:2 * block])


def test_draft_context_write_projects_kv_only(qwen3_dir, tmp_path):
    """write_context projects K/V from the k, v rows of each layer's qkv_proj: the checkpoint's
    k_proj/v_proj results, and the full qkv GEMM (which would compute q too) never runs."""
    target_cfg = load_target(qwen3_dir).config
    draft_dir = make_tiny_dflash_draft(tmp_path, qwen3_dir, target_layer_ids=[1, 2], rope_theta=5000.0)
    draft = load_draft(draft_dir, target_cfg)
    sd, cfg = load_file(draft_dir / "model.safetensors"), draft.config
    n, nkv, hd = 5, cfg.num_key_value_heads, cfg.head_dim
    positions = torch.arange(3, 3 + n)
    x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            w = lambda name: sd[f"layers.{i}.self_attn.{name}.weight"]  # noqa: E731
            k, v = layer.self_attn.project_kv(x, *draft.rotary(positions, x.dtype))
            k_ref = rope(rms((x @ w("k_proj").T).view(n, nkv, hd), w("k_norm")), positions, 5000.0)
            torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, (x @ w("v_proj").T).view(n, nkv, hd), atol=1e-5, rtol=1e-5)

        calls = []
        hooks = [layer.self_attn.qkv_proj.register_forward_hook(lambda *_: calls.append(1))
                 for layer in draft.layers]
        reqs = PagedRequests(target_cfg, 1, 16, cfg)
        meta, positions = reqs.meta([n])
        draft.write_context(torch.randn(n, 2 * cfg.hidden_size), positions, meta.slot_mapping, reqs.kv)
        assert not calls and reqs.kv.draft[0][0].count_nonzero() > 0
        meta, positions = reqs.meta([cfg.block_size], causal=False)
        draft(torch.randn(cfg.block_size, cfg.hidden_size), positions, meta, reqs.kv)
        assert len(calls) == len(draft.layers)  # the block rows do use the merged GEMM
        for h in hooks:
            h.remove()


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 1) == [14]
    assert default_target_layer_ids(32, 4) == [1, 10, 20, 29]  # 1 + i * 28 / 3, rounded


def draft_dict(**kw):
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_target_layers": 36,
         "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 1e6, "rope_scaling": None,
         "rms_norm_eps": 1e-6, "vocab_size": 300, "dflash_config": {"mask_token_id": 299}}
    d.update(kw)
    return d


def test_draft_config_formats():
    old = DraftConfig.from_dict(draft_dict(block_size=16))
    assert (old.block_size, old.mask_token_id, old.target_layer_ids) == (16, 299, [1, 9, 17, 25, 33])
    new = DraftConfig.from_dict(draft_dict(dflash_config={"mask_token_id": 7, "block_size": 10,
                                                          "target_layer_ids": [2, 4]}))
    assert (new.block_size, new.mask_token_id, new.target_layer_ids) == (10, 7, [2, 4])
    top = DraftConfig.from_dict(draft_dict(block_size=8, target_layer_ids=[3]))
    assert top.target_layer_ids == [3] and top.rope_theta == 1e6 and top.qk_norm
    with pytest.raises(ValueError, match="block_size"):
        DraftConfig.from_dict(draft_dict())


def test_draft_sliding_window_layers(qwen3_dir, tmp_path):
    """Sliding layers need a window (tests/test_sliding_window_draft.py covers the rest)."""
    with pytest.raises(ValueError, match="sliding_attention"):
        layer_types = ["full_attention"] * 4 + ["sliding_attention"]
        DraftConfig.from_dict(draft_dict(block_size=16, layer_types=layer_types))
    draft_dir = make_tiny_dflash_draft(tmp_path, qwen3_dir, extra_config={
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
        "use_sliding_window": True})
    draft = load_draft(draft_dir, load_target(qwen3_dir).config)
    assert [layer.self_attn.window for layer in draft.layers] == [4, None]


def test_validate_draft_against_target(qwen3_dir):
    target = load_target(qwen3_dir).config
    good = DraftConfig.from_dict(draft_dict(block_size=8, num_target_layers=4, target_layer_ids=[1, 3]))
    validate_draft_against_target(good, target)
    cases = {
        "hidden_size": dataclasses.replace(good, hidden_size=32),
        "36 layers, but the target has 4": dataclasses.replace(good, num_target_layers=36),
        "out of range": dataclasses.replace(good, target_layer_ids=[1, 4]),
        "mask_token_id 300": dataclasses.replace(good, mask_token_id=300),
    }
    for message, cfg in cases.items():
        with pytest.raises(ValueError, match=message):
            validate_draft_against_target(cfg, target)


def test_load_draft_rejects_mismatched_target(qwen3_dir, tmp_path):
    draft_dir = make_tiny_dflash_draft(tmp_path, qwen3_dir, mask_token_id=1000, target_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="mask_token_id 1000"):
        load_draft(draft_dir, load_target(qwen3_dir).config)


def copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        tensors = load_file(dst / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, dst / "model.safetensors")
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_loader_errors_name_the_problem(qwen3_dir, tmp_path):
    missing = copy_checkpoint(qwen3_dir, tmp_path / "missing",
                              edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_target(missing)

    extra = copy_checkpoint(qwen3_dir, tmp_path / "extra",
                            edit_tensors=lambda t: t.update({"model.layers.0.foo.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.foo\.weight'"):
        load_target(extra)

    shape = copy_checkpoint(qwen3_dir, tmp_path / "shape",
                            edit_config=lambda c: c.update(intermediate_size=96))
    pattern = r"shape mismatch .*mlp\.\w+_proj\.weight.*expected \(\d+, \d+\), got"
    with pytest.raises(ValueError, match=pattern):
        load_target(shape)

    # A packed parameter's shard: the error names the checkpoint tensor, and where it goes.
    missing_k = copy_checkpoint(qwen3_dir, tmp_path / "missing_k",
                                edit_tensors=lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.self_attn\.k_proj\.weight$"):
        load_target(missing_k)
    short_v = copy_checkpoint(qwen3_dir, tmp_path / "short_v", edit_tensors=lambda t: t.update(
        {"model.layers.0.self_attn.v_proj.weight": torch.zeros(16, 64)}))
    pattern = (r"shape mismatch for tensor 'model\.layers\.0\.self_attn\.v_proj\.weight' .*"
               r"expected \(32, 64\), got \(16, 64\) \(rows \[96, 128\) of model\.layers\.0\.self_attn\.qkv_proj")
    with pytest.raises(ValueError, match=pattern):
        load_target(short_v)

    arch = copy_checkpoint(qwen3_dir, tmp_path / "arch",
                           edit_config=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen3ForCausalLM"):
        load_target(arch)

    inv_freq = copy_checkpoint(qwen3_dir, tmp_path / "inv_freq", edit_tensors=lambda t: t.update(
        {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    load_target(inv_freq)


def test_loader_sharded_checkpoint(qwen3_dir, tmp_path):
    shutil.copytree(qwen3_dir, tmp_path / "sharded")
    path = tmp_path / "sharded"
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A tensor stored in two shard files is an error, not a silent overwrite.
    dup = shutil.copytree(path, tmp_path / "duplicated")
    first = "model-00001-of-00002.safetensors"
    save_file({k: tensors[k] for k in shards[first] + [names[1]]}, dup / first)
    with pytest.raises(ValueError, match=f"{re.escape(repr(names[1]))} appears twice"):
        load_target(dup)

    model = load_target(path)
    # q/k/v (and gate/up) of a layer sit in different shard files; each lands in its rows.
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        qkv = [tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(qkv))
        gate_up = [tensors[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(gate_up))
    # The inverse mapping (for saving) gives back exactly the checkpoint.
    saved = to_checkpoint_state_dict(dict(model.named_parameters()), model.config)
    assert saved.keys() == tensors.keys()
    for name, t in saved.items():
        assert torch.equal(t, tensors[name])


def test_kv_cache_sizing(qwen3_dir):
    target = load_target(qwen3_dir).config
    draft = DraftConfig.from_dict(draft_dict(block_size=8, num_hidden_layers=2, num_key_value_heads=4,
                                             num_attention_heads=4, head_dim=8))
    per_page = KVCache.bytes_per_page(target, draft, 16, torch.bfloat16)
    assert per_page == 2 * 16 * 2 * (4 * 2 * 16 + 2 * 4 * 8)
    assert KVCache.bytes_per_page(target, None, 16, "float32") == 2 * 16 * 4 * (4 * 2 * 16)
    kv = KVCache.allocate(target, draft, 10, 16, torch.bfloat16)
    assert len(kv.target) == 4 and len(kv.draft) == 2 and (kv.num_pages, kv.page_size) == (10, 16)
    assert kv.target[0][0].shape == (10, 16, 2, 16) and kv.draft[1][1].shape == (10, 16, 4, 8)
    total = sum(t.numel() * t.element_size() for pair in kv.target + kv.draft for t in pair)
    assert total == 10 * per_page


def test_auto_dtype_runs_a_float32_checkpoint_in_bfloat16_on_the_gpu_only():
    import torch

    from dflash_engine.models.config import resolve_dtype

    assert resolve_dtype("auto", "float32", "cpu") == torch.float32
    assert resolve_dtype("auto", "float32", "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "float16", "cuda") == torch.float16
    assert resolve_dtype("auto", "bfloat16", None) == torch.bfloat16
    assert resolve_dtype("float32", "float32", "cuda") == torch.float32  # an explicit dtype wins
