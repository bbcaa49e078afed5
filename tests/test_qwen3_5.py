"""Qwen3.5 hybrid target (GDN + gated attention) against transformers, and its recurrent
state contract: decode == prefill, rollback to any verified row (CPU, float32)."""
from __future__ import annotations

import json

import pytest
import torch
from tiny_hybrid import FULL, LIN, HybridRequests, make_tiny_qwen3_5, make_tiny_qwen3_5_vl

from dflash_engine.models.hybrid_state import HybridState
from dflash_engine.models.qwen3_5 import Qwen3_5ForCausalLM, load_qwen3_5
from dflash_engine.models.qwen3_5_config import HybridConfig, is_hybrid_config

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, transformers model, our model) of the untied tiny target."""
    path, hf = make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), seed=0)
    return path, hf, load_qwen3_5(path, dtype="float32")


def prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def hf_forward(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states


@pytest.mark.parametrize("tied", [False, True])
def test_packed_prefill_matches_transformers(tiny, tied, tmp_path):
    """Several requests in one packed batch, one of them past a 64-token GDN chunk and one a
    single row: logits and tapped residual streams equal transformers' per sequence."""
    if tied:
        path, hf = make_tiny_qwen3_5(tmp_path, seed=3, tie_word_embeddings=True, layer_types=[FULL, LIN, LIN, FULL])
        model = load_qwen3_5(path, dtype="float32")
        assert model.lm_head is None
    else:
        _, hf, model = tiny
    batch = prompts([5, 70, 1, 17])
    taps = [0, 2, 1]  # not the last layer: transformers' last hidden_states entry is the normed output
    reqs = HybridRequests(model.config, len(batch), max_len=80)
    logits, tapped = reqs.run(model, batch, tap_layers=taps)
    start = 0
    for ids in batch:
        ref, hidden = hf_forward(hf, ids)
        rows = slice(start, start + len(ids))
        torch.testing.assert_close(logits[rows], ref, **TOL)
        torch.testing.assert_close(tapped[rows], torch.cat([hidden[i + 1][0] for i in taps], -1), **TOL)
        start += len(ids)


def test_decode_after_prefill_equals_one_prefill(tiny):
    """A prefill (chunked form) then one token per step (per-token form, state read and
    written in place) gives the logits of one prefill over the whole sequence, in a batch
    whose requests are at different stages."""
    _, _, model = tiny
    full = prompts([20, 12], seed=1)
    split = [6, 9]
    reqs = HybridRequests(model.config, 2, max_len=32)
    whole = HybridRequests(model.config, 2, max_len=32, seed=1)
    ref, _ = whole.run(model, full)
    starts = [0, len(full[0])]
    got = [[], []]
    logits, _ = reqs.run(model, [full[0][:split[0]], full[1][:split[1]]])
    got[0].append(logits[:split[0]])
    got[1].append(logits[split[0]:])
    for t in range(max(len(full[r]) - split[r] for r in range(2))):
        pos = [split[r] + t for r in range(2)]
        chunks = [[full[r][pos[r]]] if pos[r] < len(full[r]) else [] for r in range(2)]
        logits, _ = reqs.run(model, chunks)
        row = 0
        for r in range(2):
            if chunks[r]:
                got[r].append(logits[row:row + 1])
                row += 1
    for r in range(2):
        torch.testing.assert_close(torch.cat(got[r]), ref[starts[r]:starts[r] + len(full[r])], **TOL)


def test_rollback_resumes_from_any_verified_row(tiny):
    """Verification keeps the state after every row (one slot per row, the first of them
    also the slot read). Committing `a` rows is pointing c[r] at row a-1's slot; the next
    step then continues exactly as a run over the accepted tokens. Reading the last row's
    slot instead (a fixed slot after a short acceptance) gives other logits."""
    _, _, model = tiny
    block = 4
    prefix = prompts([9, 14], seed=2)
    drafts = prompts([block, block], seed=3)
    after = prompts([3, 1], seed=4)
    accepted = [2, 4]  # rows kept per request: a partial and a full acceptance
    reqs = HybridRequests(model.config, 2, max_len=32, slots_per_request=block)
    reqs.run(model, prefix)
    verify, _ = reqs.run(model, drafts, per_token=True)
    for r, a in enumerate(accepted):
        reqs.commit(r, a)
    cont, _ = reqs.run(model, after)

    seqs = [prefix[r] + drafts[r][:accepted[r]] + after[r] for r in range(2)]
    ref_reqs = HybridRequests(model.config, 2, max_len=32)
    ref, _ = ref_reqs.run(model, seqs)
    ref_start, row, cont_row = 0, 0, 0
    for r in range(2):
        p, a, n = len(prefix[r]), accepted[r], len(after[r])
        torch.testing.assert_close(verify[row:row + a], ref[ref_start + p:ref_start + p + a], **TOL)
        torch.testing.assert_close(cont[cont_row:cont_row + n], ref[ref_start + p + a:ref_start + p + a + n], **TOL)
        ref_start, row, cont_row = ref_start + len(seqs[r]), row + block, cont_row + n

    stale = HybridRequests(model.config, 1, max_len=32, slots_per_request=block)
    stale.run(model, [prefix[0]])
    stale.run(model, [drafts[0]], per_token=True)
    stale.commit(0, accepted[0])
    stale.current[0] = stale.slots[0][block - 1]  # the bug: the state after every drafted row
    wrong, _ = stale.run(model, [after[0]])
    assert not torch.allclose(wrong, cont[:len(after[0])], **TOL)


def test_conditional_generation_checkpoint_loads_the_same(tiny, tmp_path):
    """The published layout (text_config, model.language_model.*, a vision tower) loads to
    the same model as the text-only one; the vision tensors are ignored."""
    path, hf, model = tiny
    vl = make_tiny_qwen3_5_vl(tmp_path, hf)
    d = json.loads((vl / "config.json").read_text())
    assert d["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "text_config" in d
    assert is_hybrid_config(d)
    loaded = load_qwen3_5(vl, dtype="float32")
    assert loaded.config.weight_prefix == "model.language_model."
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    batch = prompts([7, 3], seed=5)
    a, _ = HybridRequests(model.config, 2, max_len=8).run(model, batch)
    b, _ = HybridRequests(loaded.config, 2, max_len=8).run(loaded, batch)
    assert torch.equal(a, b)


def test_config_parsing_and_state_sizes():
    """Layer pattern, partial rotary, GDN dims; state bytes per sequence of Qwen3.5-0.8B and
    -27B (float32 recurrent state, bf16 conv window): 18.6 MiB and 146.8 MiB."""
    base = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=1000, intermediate_size=64,
                num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    small = HybridConfig.from_dict({**base, "hidden_size": 1024, "num_hidden_layers": 24,
                                    "linear_num_value_heads": 16})
    assert small.layer_types[:4] == [LIN, LIN, LIN, FULL] and len(small.gdn_layer_ids) == 18
    assert small.rotary_dim == 64 and small.conv_dim == 6144 and small.state_dtype == torch.float32
    assert small.rope_scaling is None and small.weight_prefix == "model."
    mib = 1 << 20
    assert round(HybridState.bytes_per_slot(small, torch.bfloat16) / mib, 1) == 18.6
    large = HybridConfig.from_dict({**base, "hidden_size": 5120, "num_hidden_layers": 64,
                                    "linear_num_value_heads": 48})
    assert round(HybridState.bytes_per_slot(large, torch.bfloat16) / mib, 1) == 146.8
    with pytest.raises(ValueError, match="layer_types"):
        HybridConfig.from_dict({**base, "hidden_size": 64, "num_hidden_layers": 2,
                                "linear_num_value_heads": 16, "layer_types": [LIN, "sliding_attention"]})
    state = HybridState.allocate(small, 3, torch.bfloat16)
    assert len(state.conv) == 18 and state.conv[0].shape == (3, 6144, 3)
    assert state.recurrent[0].shape == (3, 16, 128, 128) and state.recurrent[0].dtype == torch.float32


def test_in_proj_packs_transformers_projections_in_order(tiny):
    """The GDN's one input GEMM holds transformers' in_proj_qkv | z | b | a rows, in that order."""
    _, hf, model = tiny
    ours = model.model.layers[0].linear_attn.in_proj.weight
    theirs = hf.model.layers[0].linear_attn
    ref = torch.cat([theirs.in_proj_qkv.weight, theirs.in_proj_z.weight, theirs.in_proj_b.weight,
                     theirs.in_proj_a.weight])
    assert torch.equal(ours, ref)
    assert isinstance(model, Qwen3_5ForCausalLM) and model.config.attention_layer_ids == [1]
