"""Gated DeltaNet ops (ops/delta_rule.py, ops/gdn.py) against transformers' torch references
and against each other: chunked == per-token, slot reads and writes, conv windows (CPU, float32)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_engine.ops.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule, recurrent_states
from dflash_engine.ops.gdn import causal_conv1d, gated_delta_rule, per_token_sequences

H_K, H_V, D_K, D_V = 2, 4, 8, 6


def random_inputs(total: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, H_K, D_K, generator=gen)
    k = torch.randn(total, H_K, D_K, generator=gen)
    v = torch.randn(total, H_V, D_V, generator=gen)
    g = -torch.rand(total, H_V, generator=gen) * 2  # log decay in (-2, 0]
    beta = torch.rand(total, H_V, generator=gen)
    return q, k, v, g, beta


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def hf_rule():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    return hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_matches_transformers_per_sequence(chunk_size):
    hf_chunk, hf_recurrent = hf_rule()
    lengths = [1, 9, 20]
    cu = cu_of(lengths)
    q, k, v, g, beta = random_inputs(cu[-1])
    init = torch.randn(len(lengths), H_V, D_K, D_V, generator=torch.Generator().manual_seed(5))
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, init, use_qk_l2norm=True, chunk_size=chunk_size)
    rec_out, states = recurrent_states(q, k, v, g, beta, cu, init, use_qk_l2norm=True)
    for r, (s, e) in enumerate(zip(cu, cu[1:])):
        args = (q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e])
        for fn in (hf_chunk, hf_recurrent):
            ref, ref_state = fn(*args, initial_state=init[r:r + 1], output_final_state=True,
                                use_qk_l2norm_in_kernel=True)
            for o, state in ((out, final[r]), (rec_out, states[e - 1])):
                torch.testing.assert_close(o[s:e], ref[0], rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(state, ref_state[0], rtol=1e-4, atol=1e-5)


def test_per_token_states_equal_chunked_prefixes():
    """The state stored after row t is the final state of the chunked form over rows [0, t]:
    what a verification that accepts t + 1 rows must be able to resume from."""
    lengths = [7, 11]
    cu = cu_of(lengths)
    q, k, v, g, beta = random_inputs(cu[-1], seed=1)
    pool = torch.randn(1 + cu[-1], H_V, D_K, D_V)  # slot 0 holds request 0's initial state
    init0 = pool[0].clone()
    read = torch.tensor([0, -1])  # request 1 has no state yet: zeros, whatever its slot holds
    write = torch.arange(1, cu[-1] + 1)  # every row keeps its state, row t at slot t + 1
    out = recurrent_gated_delta_rule(q, k, v, g, beta, cu, pool, read, write, use_qk_l2norm=True)
    inits = torch.stack([init0, torch.zeros_like(init0)])
    full, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu, inits, use_qk_l2norm=True, chunk_size=4)
    torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-5)
    for r, (s, e) in enumerate(zip(cu, cu[1:])):
        for t in range(s, e):
            _, prefix_state = chunk_gated_delta_rule(q[s:t + 1], k[s:t + 1], v[s:t + 1], g[s:t + 1], beta[s:t + 1],
                                                     [0, t + 1 - s], inits[r:r + 1], use_qk_l2norm=True,
                                                     chunk_size=4)
            torch.testing.assert_close(pool[t + 1], prefix_state[0], rtol=1e-4, atol=1e-5)


def test_recurrent_reads_every_slot_before_writing():
    """Request 0 writes the slot request 1 reads, and request 1 the one request 0 reads: each
    still starts from the state its slot held before the step (a swap)."""
    cu = [0, 3, 6]
    q, k, v, g, beta = random_inputs(6, seed=2)
    pool = torch.randn(2, H_V, D_K, D_V)
    before = pool.clone()
    write = torch.tensor([-1, -1, 1, -1, -1, 0])
    out = recurrent_gated_delta_rule(q, k, v, g, beta, cu, pool, torch.tensor([0, 1]), write, use_qk_l2norm=True)
    ref, finals = chunk_gated_delta_rule(q, k, v, g, beta, cu, before, use_qk_l2norm=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[1], finals[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[0], finals[1], rtol=1e-4, atol=1e-5)


def test_gated_delta_rule_mixes_forms_per_request():
    """A batch of a prefill (chunked), a decode row and a verify block (per-token): each
    request's rows and kept states equal the same request run alone."""
    lengths = [13, 1, 4]
    cu = cu_of(lengths)
    q, k, v, g, beta = random_inputs(cu[-1], seed=3)
    pool = torch.randn(10, H_V, D_K, D_V)
    read = torch.tensor([-1, 1, 2])
    write = [-1] * 12 + [0] + [1] + [5, 6, 7, 8]  # prefill keeps its last state; decode in place; verify per row
    per_token = per_token_sequences(cu, write)
    assert per_token == [False, True, True]
    alone = pool.clone()
    out = gated_delta_rule(q, k, v, g, beta, cu, pool, read, torch.tensor(write), write, per_token)
    for r, (s, e) in enumerate(zip(cu, cu[1:])):
        solo = alone.clone()
        ref = gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], [0, e - s], solo, read[r:r + 1],
                               torch.tensor(write[s:e]), write[s:e], [per_token[r]])
        torch.testing.assert_close(out[s:e], ref)
        for slot in (w for w in write[s:e] if w >= 0):
            torch.testing.assert_close(pool[slot], solo[slot])
    untouched = [s for s in range(10) if s not in (0, 1, 5, 6, 7, 8)]
    torch.testing.assert_close(pool[untouched], alone[untouched])


def test_causal_conv1d_continues_from_its_window():
    channels, kernel = 5, 4
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(10, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    ref = F.silu(F.conv1d(x.t()[None], weight[:, None], padding=kernel - 1, groups=channels)[0, :, :10]).t()
    pool = torch.full((12, channels, kernel - 1), float("nan"))  # recycled slots: never read unless asked
    # rows [0, 6) from no state, each row's window kept at slot t; then rows [6, 10) from slot 5
    first = causal_conv1d(x[:6], weight, [0, 6], pool, torch.tensor([-1]), torch.arange(6))
    rest = causal_conv1d(x[6:], weight, [0, 4], pool, torch.tensor([5]), torch.tensor([-1, -1, -1, 11]))
    torch.testing.assert_close(torch.cat([first, rest]), ref)
    padded = torch.cat([torch.zeros(kernel - 1, channels), x])
    for t in range(6):
        torch.testing.assert_close(pool[t], padded[t + 1:t + kernel].t())
    torch.testing.assert_close(pool[11], padded[9 + 1:9 + kernel].t())  # after the last row, t = 9
    assert torch.isnan(pool[6:11]).all()
