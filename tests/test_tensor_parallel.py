"""Tensor parallelism on the CPU (gloo, 2 ranks, float32 exact mode): TP = 2 output equals
TP = 1 output token for token, spec on and off, c = 1 and 8, with chunked prefill and
preemption, τ equal, for dense and hybrid (Qwen3.5: GDN + gated attention) targets; a killed
worker fails the engine within seconds (health 503), no hang, no orphan process. The sharding
math itself is checked without processes (simulated ranks)."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_engine import LLM, SamplingParams, _core
from dflash_engine.config import EngineConfig
from dflash_engine.distributed.executor import TensorParallelError
from dflash_engine.distributed.step_message import pack, unpack
from dflash_engine.models import load_draft, load_target
from dflash_engine.models.hybrid_state import HybridState, StateMetadata
from dflash_engine.models.loader import read_config
from dflash_engine.models.parallel import TPShard, rank_config
from dflash_engine.models.qwen3_5 import HybridStep, load_qwen3_5
from dflash_engine.models.qwen3_5_config import HybridConfig
from dflash_engine.runtime_config import check_tensor_parallel, resolve
from dflash_engine.worker import state_pool
from dflash_engine.worker.kv_cache import KVCache
from dflash_engine.worker.sampling_batch import RequestParams, SamplingBatch

TP = 2


def spec(draft) -> dict:
    return {"method": "dflash", "model": str(draft), "draft_length": "fixed"}


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def one_by_one(llm: LLM, ps, max_tokens: int) -> list[list[int]]:
    """Concurrency 1: each prompt alone on the engine (greedy: a prefix of the longer run's)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [tokens(llm.generate(p, params, use_tqdm=False))[0] for p in ps]


def spec_counts(stats) -> tuple:
    return stats.spec_num_drafts, stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos


def tp_children() -> list:
    return [p for p in mp.active_children() if p.name.startswith("dflash-tp-rank")]


@pytest.fixture(scope="module", autouse=True)
def no_orphans():
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while tp_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tp_children(), "tensor-parallel workers outlived their engines"


# ---- the sharding math, without processes ----------------------------------------------------


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """Llama with tied embeddings, attention and MLP biases and ONE kv head (replicated on both
    ranks), and a random draft for it."""
    from tiny_models import make_tiny_dflash_draft, make_tiny_llama

    root = tmp_path_factory.mktemp("tp_llama")
    target = make_tiny_llama(root / "target", tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                             num_key_value_heads=1)
    draft = make_tiny_dflash_draft(root / "draft", target, num_layers=1, block_size=4, target_layer_ids=[1, 2])
    return target, draft


def test_sharded_layers_over_simulated_ranks_equal_the_whole(llama_pair):
    """Each rank built and loaded alone (its slices only, no group): partial sums of the
    row-parallel layers add up to the whole layer, the vocabulary slices to the whole."""
    target_dir, draft_dir = llama_pair
    full = load_target(target_dir, "float32", "cpu", batch_invariant=True)
    ranks = [load_target(target_dir, "float32", "cpu", batch_invariant=True, tp=TPShard(r, TP)) for r in range(TP)]
    cfg = full.config
    x, ids = torch.randn(5, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (7,))
    torch.testing.assert_close(sum(m.embed(ids) for m in ranks), full.embed(ids), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([m.compute_logits(x) for m in ranks], -1), full.compute_logits(x))
    whole, parts = full.model.layers[1], [m.model.layers[1] for m in ranks]
    # Column-parallel qkv: rank r's rows are its q heads, then its (here: the one, replicated) kv head.
    q, hd = cfg.num_attention_heads // TP * cfg.head_dim, cfg.head_dim
    w = whole.self_attn.qkv_proj.weight
    kv0 = cfg.num_attention_heads * hd
    for r, p in enumerate(parts):
        rows = torch.cat([w[r * q:(r + 1) * q], w[kv0:kv0 + hd], w[kv0 + hd:kv0 + 2 * hd]])
        assert torch.equal(p.self_attn.qkv_proj.weight, rows)
        assert p.self_attn.num_kv_heads == 1 and p.self_attn.num_heads == cfg.num_attention_heads // TP
    # Row-parallel down_proj / o_proj: partial sums (each rank adds the whole bias after its reduce).
    bias = whole.mlp.down_proj.bias
    torch.testing.assert_close(sum(p.mlp(x) for p in parts) - (TP - 1) * bias, whole.mlp(x))
    att_in = torch.randn(5, cfg.num_attention_heads * hd)
    o_bias = whole.self_attn.o_proj.bias
    got = sum(p.self_attn.o_proj(att_in[:, r * q:(r + 1) * q]) for r, p in enumerate(parts)) - (TP - 1) * o_bias
    torch.testing.assert_close(got, whole.self_attn.o_proj(att_in))
    # The draft's fc: row-parallel over the taps' columns.
    d_full = load_draft(draft_dir, cfg, "float32", "cpu", batch_invariant=True)
    d_ranks = [load_draft(draft_dir, cfg, "float32", "cpu", batch_invariant=True, tp=TPShard(r, TP))
               for r in range(TP)]
    taps = torch.randn(5, d_full.fc.in_features)
    torch.testing.assert_close(sum(m.fc(taps) for m in d_ranks), d_full.fc(taps))


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """The tiny Qwen3.5 hybrid (4 q / 2 kv heads, GDN 2 key / 4 value heads: every count
    splits over 2 ranks) and an untrained one-layer draft (block 4) over its layers 1 and 2."""
    from tiny_hybrid import make_tiny_hybrid_draft, make_tiny_qwen3_5
    from tiny_models import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("tp_hybrid")
    target, _ = make_tiny_qwen3_5(root / "target")
    make_tiny_tokenizer(target, 300)
    return target, make_tiny_hybrid_draft(root / "draft", target, block_size=4)


def _gdn_step(q_lens: list[int], read: list[int], write: list[int]) -> HybridStep:
    from attention_meta import meta_from_lists

    qsl = np.cumsum([0] + q_lens).tolist()
    meta = meta_from_lists([0] * qsl[-1], qsl, q_lens, [[0]] * len(q_lens), True)
    sm = StateMetadata.final(qsl, read, write)
    return HybridStep(None, None, meta, sm, qsl, sm.per_token(qsl), sm.host_lists()[1])


def test_hybrid_sharded_layers_over_simulated_ranks_equal_the_whole(hybrid_pair):
    """Hybrid ranks built and loaded alone: the GDN layer split by heads (in_proj's q | k | v |
    z | b | a rows, conv channels, A_log, dt_bias per rank; out_proj row-parallel) sums to the
    whole layer over a prefill and a decode step, and each rank's state slots hold exactly its
    heads' part of the whole state; the gated attention's [query | gate] rows split per head."""
    target_dir, _ = hybrid_pair
    full = load_qwen3_5(target_dir, "float32", "cpu", batch_invariant=True)
    ranks = [load_qwen3_5(target_dir, "float32", "cpu", batch_invariant=True, tp=TPShard(r, TP)) for r in range(TP)]
    cfg, views = full.config, [m.config for m in ranks]
    assert all(v == views[0] for v in views)
    assert (views[0].linear_num_key_heads, views[0].linear_num_value_heads) == (1, 2)
    x, ids = torch.randn(5, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (7,))
    torch.testing.assert_close(sum(m.embed(ids) for m in ranks), full.embed(ids), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([m.compute_logits(x) for m in ranks], -1), full.compute_logits(x))
    g = cfg.gdn_layer_ids[0]
    whole, parts = full.model.layers[g].linear_attn, [m.model.layers[g].linear_attn for m in ranks]
    pools = [HybridState.allocate(c, 3, torch.float32) for c in [cfg, *views]]
    for q_lens, read in (([5, 3], [-1, -1]), ([1, 2], [0, 1])):  # prefill (chunked form), then on from the state
        h = torch.randn(sum(q_lens), cfg.hidden_size)
        step = _gdn_step(q_lens, read, [0, 1])
        out = [m(h, step, p.conv[0], p.recurrent[0]) for m, p in zip([whole, *parts], pools)]
        torch.testing.assert_close(sum(out[1:]), out[0])
    dk, dv, nk, nv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, 1, 2
    key_dim = cfg.gdn_key_dim
    for r, p in enumerate(pools[1:]):
        rows = [*range(r * nk * dk, (r + 1) * nk * dk), *range(key_dim + r * nk * dk, key_dim + (r + 1) * nk * dk),
                *range(2 * key_dim + r * nv * dv, 2 * key_dim + (r + 1) * nv * dv)]
        assert torch.equal(parts[r].conv1d.weight, whole.conv1d.weight[rows])
        assert torch.equal(parts[r].A_log, whole.A_log[r * nv:(r + 1) * nv])
        torch.testing.assert_close(p.conv[0][:2], pools[0].conv[0][:2, rows])
        torch.testing.assert_close(p.recurrent[0][:2], pools[0].recurrent[0][:2, r * nv:(r + 1) * nv])
    # Gated attention: rank r's q rows are its heads' [query | gate] pairs, then its kv head.
    a = cfg.attention_layer_ids[0]
    w, hd = full.model.layers[a].self_attn.qkv_proj.weight, cfg.head_dim
    q = cfg.num_attention_heads // TP * 2 * hd
    kv0 = cfg.num_attention_heads * 2 * hd
    kv = cfg.num_key_value_heads // TP * hd
    for r, m in enumerate(ranks):
        rows = torch.cat([w[r * q:(r + 1) * q], w[kv0 + r * kv:kv0 + (r + 1) * kv],
                          w[kv0 + cfg.num_key_value_heads * hd + r * kv:][:kv]])
        assert torch.equal(m.model.layers[a].self_attn.qkv_proj.weight, rows)


def test_hybrid_rank_view_sizes_state_slots_and_pages(hybrid_pair):
    """A rank's state slot and KV page hold its heads only (half the bytes at TP = 2); the page
    size in tokens comes from the rank's view, the same on every rank."""
    target, draft = hybrid_pair
    one = resolve(EngineConfig(model=str(target), device="cpu", speculative_config=spec(draft)))
    two = resolve(EngineConfig(model=str(target), device="cpu", speculative_config=spec(draft),
                               tensor_parallel_size=TP))
    view, dview = rank_config(two.model_config, TP), rank_config(two.draft_config, TP)
    lay = state_pool.layout(view, dview, two.page_size, torch.float32)
    assert lay is not None and two.page_size == state_pool.hybrid_page_size(view, dview, 16, torch.float32)
    whole = state_pool.layout(one.model_config, one.draft_config, one.page_size, torch.float32)
    assert lay.bytes_per_slot * TP == whole.bytes_per_slot
    assert HybridState.bytes_per_slot(view, torch.float32) * TP == HybridState.bytes_per_slot(
        one.model_config, torch.float32)
    assert lay.bytes_per_page == KVCache.bytes_per_page(view, dview, two.page_size, torch.float32)


def test_rank_config_sizes_the_kv_cache_per_rank(qwen3_dir):
    rc = resolve(EngineConfig(model=str(qwen3_dir), device="cpu", speculative_config=None))
    view = rank_config(rc.model_config, TP)
    assert (view.num_attention_heads, view.num_key_value_heads, view.intermediate_size, view.vocab_size) == (
        2, 1, 64, 150)
    assert view.hidden_size == rc.model_config.hidden_size and rank_config(rc.model_config, 1) is rc.model_config
    assert KVCache.bytes_per_page(view, None, 16, torch.float32) * TP == KVCache.bytes_per_page(
        rc.model_config, None, 16, torch.float32)


def test_step_message_round_trip():
    plan = _core.profile_plan(40, 4, 4, 4, 4, 64, 16, 5, False)
    r = len(plan)
    params = RequestParams({"greedy": np.arange(r) % 2 == 0, "temperature": np.linspace(0.5, 1, r),
                            "top_k": np.arange(r), "top_p": np.ones(r), "min_p": np.zeros(r),
                            "seed": np.arange(r) * 7}, plan.sample_start)
    st = SamplingBatch(params, plan)
    header, payload = pack(3, plan, st, False)
    step = unpack(header, payload)
    assert step.seq == 3 and not step.all_greedy and len(step.plan) == len(plan)
    for name in ("block_rows", "num_decode", "num_rows", "draft_rows"):
        assert getattr(step.plan, name) == getattr(plan, name)
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "page_tables",
                 "sample_rows", "sample_start", "verify_target_rows", "draft_input_ids", "draft_page_tables",
                 "state_read"):
        a, b = getattr(plan, name), getattr(step.plan, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    for k, v in st.items():  # per sample row, "position" included (the worker's from its plan copy)
        assert np.array_equal(step.st[k], v) and step.st[k].dtype == v.dtype, k
    assert step.st.params.all_greedy is False and len(step.st["seed"]) == len(plan.sample_rows)


def test_configurations_that_cannot_split_are_refused(qwen3_dir, random_draft_dir, hybrid_pair):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(model=str(qwen3_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"):
        resolve(EngineConfig(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir),
                             tensor_parallel_size=3))
    with pytest.raises(ValueError, match="single-process|one process"):
        resolve(EngineConfig(model=str(qwen3_dir), device="cpu", speculative_config=None, batch_invariant=False,
                             cpu_weights="bf16", tensor_parallel_size=TP))
    rc = resolve(EngineConfig(model=str(qwen3_dir), device="cpu", speculative_config=None, batch_invariant=False,
                              tensor_parallel_size=TP))
    assert rc.cpu_weights == "none" and rc.tensor_parallel_size == TP
    cfg = rc.model_config
    with pytest.raises(ValueError, match="needs 2 GPUs .* but 1 are visible"):
        check_tensor_parallel(TP, cfg, None, torch.device("cuda"), "none", device_count=1)
    with pytest.raises(ValueError, match="vocab_size"):
        check_tensor_parallel(TP, dataclasses.replace(cfg, vocab_size=301), None, torch.device("cpu"), "none")
    # A hybrid target splits its GDN layers by heads: key and value heads must divide too.
    hybrid = HybridConfig.from_dict(read_config(hybrid_pair[0]))
    check_tensor_parallel(TP, hybrid, None, torch.device("cpu"), "none")
    odd = dataclasses.replace(hybrid, linear_num_key_heads=3, linear_num_value_heads=3)
    with pytest.raises(ValueError, match=r"cannot run: the target: linear_num_key_heads \(3\) is not divisible by "
                                         r"tensor_parallel_size \(2\); .*linear_num_value_heads \(3\)"):
        check_tensor_parallel(TP, odd, None, torch.device("cpu"), "none")
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(6\) is not divisible by tensor_parallel_size \(4\)"):
        check_tensor_parallel(4, dataclasses.replace(hybrid, linear_num_key_heads=4, linear_num_value_heads=6,
                                                     num_attention_heads=4, vocab_size=304), None,
                              torch.device("cpu"), "none")


def test_cli_flag():
    from dflash_engine.cli import build_parser
    from dflash_engine.cli_args import engine_kwargs

    args = build_parser().parse_args(["serve", "m", "-tp", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2
    assert build_parser().parse_args(["generate", "x", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    args = build_parser().parse_args(["serve", "m", "-tp", "2", "--distributed-executor-backend", "external_launcher"])
    assert engine_kwargs(args)["distributed_executor_backend"] == "external_launcher"
    assert "distributed_executor_backend" not in engine_kwargs(build_parser().parse_args(["serve", "m"]))


# ---- two ranks over gloo -----------------------------------------------------------------------

PRESSURE = dict(max_num_seqs=8, max_num_batched_tokens=12, max_model_len=96, num_gpu_blocks_override=8)


@pytest.fixture(scope="module")
def trained_reference(trained):
    """TP = 1 under pressure: spec-off tokens, and spec-on tokens and acceptance counters."""
    from draft_training import random_prompts

    ps = [{"prompt_token_ids": p} for p in random_prompts(8, 8, seed=4321).tolist()]  # held out
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    off = tokens(LLM(model=str(trained.target), device="cpu", **PRESSURE).generate(ps, params, use_tqdm=False))
    on = LLM(model=str(trained.target), device="cpu", speculative_config=spec(trained.draft), **PRESSURE)
    assert tokens(on.generate(ps, params, use_tqdm=False)) == off
    return SimpleNamespace(ps=ps, params=params, tokens=off, spec=spec_counts(on.stats()),
                           tau=on.stats().mean_acceptance_length)


def check_tp2_equals_tp1(target, draft, ref, kw: dict, alone: int, alone_tokens: int):
    """TP = 2 under pressure against TP = 1's `ref`: the same tokens at c = 8 with preemption,
    the same acceptance counters when drafting, the first `alone` prompts one at a time (c = 1,
    `alone_tokens` tokens), every page free again. Returns the stats."""
    llm = LLM(model=str(target), device="cpu", speculative_config=None if draft is None else spec(draft),
              tensor_parallel_size=TP, **kw)
    try:
        assert tokens(llm.generate(ref.ps, ref.params, use_tqdm=False)) == ref.tokens  # c = 8
        st = llm.stats()
        assert st.num_preemptions > 0
        if draft is not None:
            assert spec_counts(st) == ref.spec
        assert one_by_one(llm, ref.ps[:alone], alone_tokens) == [t[:alone_tokens] for t in ref.tokens[:alone]]
        assert llm.engine.scheduler.num_free_pages == llm.engine.scheduler.num_usable_pages
        return st
    finally:
        llm.engine.close()


def test_tp2_spec_on_equals_tp1_with_trained_draft_under_pressure(trained, trained_reference):
    st = check_tp2_equals_tp1(trained.target, trained.draft, trained_reference, PRESSURE, 3, 24)
    assert st.mean_acceptance_length > 2.0 and st.mean_acceptance_length == trained_reference.tau


def test_tp2_spec_off_equals_tp1_under_pressure(trained, trained_reference):
    check_tp2_equals_tp1(trained.target, None, trained_reference, PRESSURE, 2, 16)


# A hybrid target under pressure: a 12-token budget chunks every prefill; a page holds KV or one
# state slot: spec on, 10 pages of 48 tokens hold one full-length request (3 KV pages + 5 slots);
# spec off (pages of 80 tokens), 6 pages, and prompts of 66 to 79 tokens that grow past a page.
HYBRID_PRESSURE = dict(batch_invariant=True, max_num_seqs=8, max_num_batched_tokens=12, max_model_len=128,
                       num_gpu_blocks_override=10)


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_pair):
    """TP = 1 under pressure, spec on: tokens (the spec-off ones too: DFlash is lossless, which
    test_hybrid_engine.py checks) and acceptance counters."""
    target, draft = hybrid_pair
    rng = np.random.default_rng(11)
    lens = [int(rng.integers(66, 80) if i % 3 == 0 else rng.integers(3, 40)) for i in range(8)]
    ps = [{"prompt_token_ids": rng.integers(3, 250, size=n).tolist()} for n in lens]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    on = LLM(model=str(target), device="cpu", speculative_config=spec(draft), **HYBRID_PRESSURE)
    out = tokens(on.generate(ps, params, use_tqdm=False))
    assert on.stats().num_preemptions > 0
    return SimpleNamespace(ps=ps, params=params, tokens=out, spec=spec_counts(on.stats()))


def test_tp2_hybrid_spec_on_equals_tp1_under_pressure(hybrid_pair, hybrid_reference):
    check_tp2_equals_tp1(*hybrid_pair, hybrid_reference, HYBRID_PRESSURE, 2, 8)


def test_tp2_hybrid_spec_off_equals_tp1_under_pressure(hybrid_pair, hybrid_reference):
    check_tp2_equals_tp1(hybrid_pair[0], None, hybrid_reference, {**HYBRID_PRESSURE, "num_gpu_blocks_override": 6},
                         2, 8)


def test_tp2_llama_replicated_kv_head_biases_and_sampling(llama_pair):
    """Llama: one kv head on two ranks, tied embeddings, biases; chunked prefill; greedy and
    seeded sampled requests in one batch equal TP = 1's; the workers stop on garbage collection."""
    target, draft = llama_pair
    rng = np.random.default_rng(5)
    ps = [{"prompt_token_ids": rng.integers(3, 250, size=int(rng.integers(3, 40))).tolist()} for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, top_k=40, seed=10 + i, max_tokens=20, ignore_eos=True)
              for i in range(8)]
    kw = dict(model=str(target), device="cpu", speculative_config=spec(draft), max_num_seqs=8,
              max_num_batched_tokens=24)
    one = LLM(**kw)
    ref = tokens(one.generate(ps, params, use_tqdm=False))
    llm = LLM(**kw, tensor_parallel_size=TP)
    assert tokens(llm.generate(ps, params, use_tqdm=False)) == ref
    assert spec_counts(llm.stats()) == spec_counts(one.stats())
    procs = llm.engine.executor.processes
    del llm
    gc.collect()
    for p in procs:
        p.join(10)
        assert p.exitcode == 0, "a garbage-collected engine stops its workers cleanly"


def spy_on_group_shutdown(monkeypatch) -> list:
    """Record each Groups.shutdown of this (the driver's) process."""
    from dflash_engine.distributed import groups as groups_module

    calls, real = [], groups_module.Groups.shutdown

    def shutdown(self):
        calls.append(self)
        real(self)

    monkeypatch.setattr(groups_module.Groups, "shutdown", shutdown)
    return calls


def test_a_clean_stop_shuts_the_groups_down_once(qwen3_dir, monkeypatch):
    """After STOP the driver stops its gloo groups' threads itself, not interpreter
    finalization (which can abort a finished process: distributed/groups.py)."""
    from dflash_engine.engine import LLMEngine

    calls = spy_on_group_shutdown(monkeypatch)
    engine = LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu", speculative_config=None,
                                   tensor_parallel_size=TP, max_num_seqs=2)
    try:
        engine.add_request("0", [5, 17, 33], SamplingParams(temperature=0, max_tokens=3))
        while engine.has_unfinished_requests():
            engine.step()
        assert calls == []
    finally:
        engine.close()
        engine.close()  # idempotent
    assert len(calls) == 1
    assert not tp_children()


def test_killed_worker_fails_the_engine_within_seconds(qwen3_dir, monkeypatch):
    from fastapi.testclient import TestClient

    from dflash_engine.engine import LLMEngine
    from dflash_engine.server import AsyncLLMEngine, build_app

    calls = spy_on_group_shutdown(monkeypatch)

    engine = LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu", speculative_config=None,
                                   tensor_parallel_size=TP, max_num_seqs=4)
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        for i in range(4):
            engine.add_request(str(i), [5 + i, 17, 33, 60], params)
        for _ in range(3):
            engine.step()
        [worker] = engine.executor.processes
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 .* exited with code -9"):
            while time.monotonic() - t0 < 30:
                engine.step()
        assert time.monotonic() - t0 < 5.0
        assert engine.fatal_error is not None
        with pytest.raises(TensorParallelError):  # and from then on, every step
            engine.step()
        # The server built on it: /health 503 naming the failure, new requests refused with 503.
        with TestClient(build_app(AsyncLLMEngine(engine), "tiny")) as client:
            health = client.get("/health")
            assert health.status_code == 503 and "rank 1" in health.text
            r = client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
            assert r.status_code == 503 and "rank 1" in r.text
    finally:
        engine.close()
    assert not tp_children()
    assert calls == [], "after a failure the groups are left alone (a thread may sit in a collective)"


def _gone(pid: int) -> bool:
    """The process no longer runs: it does not exist any more, or it is a zombie (dead, not yet
    reaped: its exit status can have been collected by another thread's wait on the same child,
    which leaves this Process object's exitcode unset)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_hung_worker_is_bounded_by_the_step_timeout(qwen3_dir, monkeypatch):
    """A worker that stops answering (SIGSTOP: alive, not dead) fails the engine once a
    collective waits DFLASH_TP_TIMEOUT_S for it; it is killed, nothing hangs."""
    from dflash_engine.engine import LLMEngine

    monkeypatch.setenv("DFLASH_TP_TIMEOUT_S", "2")
    engine = LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu", speculative_config=None,
                                   tensor_parallel_size=TP, max_num_seqs=2)
    try:
        engine.add_request("a", [5, 17, 33, 60], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        engine.step()
        [worker] = engine.executor.processes
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="DFLASH_TP_TIMEOUT_S"):
            while time.monotonic() - t0 < 60:
                engine.step()
        assert time.monotonic() - t0 < 2 + 10
        worker.join(5)
        assert worker.exitcode is not None or _gone(worker.pid), "the hung worker was not killed"
    finally:
        engine.close()


# ---- the decode-graph runner under TP (kernel path) -----------------------------------------


def test_tp2_decode_graph_runner_equals_tp1(qwen3_dir, random_draft_dir, monkeypatch):
    """The kernel path under TP = 2: every rank builds the decode-graph runners and a
    pure-decode step goes through them (on a GPU: graphs captured with the all-reduces inside;
    here the interpreter runs the same fixed-shape step eagerly), other steps run eagerly; the
    tokens equal TP = 1's on the same path."""
    from dflash_engine.worker.graph_runner import GraphRunner

    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")  # inherited by the spawned worker
    runs = []
    real_run = GraphRunner.run
    monkeypatch.setattr(GraphRunner, "run", lambda self, *a: runs.append(len(a[0])) or real_run(self, *a))
    ps = [{"prompt_token_ids": p} for p in ([5, 9, 14, 3, 7], [21, 8, 30, 30, 2, 6, 17])]
    # 4 tokens: an eager prefill, then 3 decode steps through the runners (each a few seconds
    # under the interpreter, the worker's without this session's interpreter patches)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kw = dict(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir), max_num_seqs=2,
              max_model_len=64)
    ref = LLM(**kw)
    assert ref.engine.runner.graphs
    want = tokens(ref.generate(ps, params, use_tqdm=False))
    n_ref = len(runs)
    assert n_ref >= 3
    del ref
    runs.clear()
    llm = LLM(**kw, tensor_parallel_size=TP)
    try:
        assert llm.engine.runner.graphs and llm.engine.runner.tp is not None
        assert tokens(llm.generate(ps, params, use_tqdm=False)) == want
        assert len(runs) == n_ref  # the same steps took the graph runner as at TP = 1
    finally:
        llm.engine.close()


# ---- ranks started by torchrun (--distributed-executor-backend external_launcher) -------------


def torchrun(n: int, program: list[str], drop_env: tuple[str, ...] = ()):
    """`torchrun --standalone --nproc-per-node n PROGRAM -tp n --distributed-executor-backend
    external_launcher` in a subprocess, without this process's torchrun variables (and
    `drop_env`)."""
    import subprocess
    import sys

    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *drop_env)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                           *program, "-tp", str(n), "--distributed-executor-backend", "external_launcher"],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("nproc", [2, 1])
def test_torchrun_ranks_equal_tp1(qwen3_dir, random_draft_dir, capsys, nproc):
    """`torchrun --nproc-per-node 2 -m dflash_engine.cli generate ... -tp 2
    --distributed-executor-backend external_launcher`: rank 0 runs the engine and prints, rank 1
    serves its steps and exits with it; the output equals TP = 1's (float32, exact mode). One
    torchrun rank (-tp 1) runs the same distributed path alone (groups, broadcast, collectives)."""
    import json

    from dflash_engine.cli import main

    args = ["generate", "hello world", "the quick brown fox jumps", "--model", str(qwen3_dir), "--device", "cpu",
            "--max-tokens", "12", "--batch-invariant", "--speculative-config", json.dumps(spec(random_draft_dir))]
    assert main(args) == 0
    ref = capsys.readouterr().out
    assert ref.count("\n") == 2
    run = torchrun(nproc, ["-m", "dflash_engine.cli", *args])
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout == ref


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torchrun_on_cuda_with_graphs_equals_one_process(qwen3_dir, random_draft_dir, tmp_path):
    """On CUDA: torchrun ranks (2 where the machine has two GPUs, else one) over NCCL, with the
    decode graphs captured around the all-reduces, print what one plain process prints
    (float32, spec on)."""
    import json
    import subprocess
    import sys

    n = min(2, torch.cuda.device_count())
    cli = tmp_path / "cli.py"  # the CLI with INFO logging on stderr (the capture and backend lines)
    cli.write_text("import logging, sys\nlogging.basicConfig(level=logging.INFO)\n"
                   "from dflash_engine.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    args = [str(cli), "generate", "hello world", "the quick brown fox jumps", "--model",
            str(qwen3_dir), "--device", "cuda", "--dtype", "float32", "--max-tokens", "16",
            "--speculative-config", json.dumps(spec(random_draft_dir))]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ref = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)
    assert ref.returncode == 0, ref.stderr[-4000:]
    run = torchrun(n, args, drop_env=("TRITON_INTERPRET",))
    assert run.returncode == 0, run.stderr[-4000:]
    assert "captured" in run.stderr and "nccl" in run.stderr, run.stderr[-4000:]
    assert run.stdout == ref.stdout


def test_external_launcher_needs_torchruns_environment(qwen3_dir, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    kw = dict(model=str(qwen3_dir), device="cpu", tensor_parallel_size=TP, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="torchrun.*missing: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        LLM(**kw)
    for k, v in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 but torchrun started WORLD_SIZE=3"):
        LLM(**kw)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, external_launcher"):
        EngineConfig(model=str(qwen3_dir), distributed_executor_backend="ray")


@pytest.fixture(scope="module")
def trained_hybrid_pair(tmp_path_factory):
    """The trained tiny hybrid pair of tests/test_hybrid_engine.py (same recipe: the draft
    comes from the session's cache when that module ran first)."""
    from draft_training import HYBRID_DRAFT_STEPS, make_learnable_hybrid_target, train_tiny_draft

    root = tmp_path_factory.mktemp("tp_trained_hybrid")
    target = make_learnable_hybrid_target(root / "target")
    draft = train_tiny_draft(target, root / "draft", block_size=4, steps=HYBRID_DRAFT_STEPS,
                             cache_dir=tmp_path_factory.getbasetemp() / "drafts")
    return target, draft


def test_tp2_trained_hybrid_pair_accepts_like_tp1(trained_hybrid_pair):
    """Verify blocks that accept several rows under TP = 2: every rank moves its committed GDN
    state to a later row's slot; tokens and acceptance counters equal TP = 1's."""
    from draft_training import TRAIN_PROMPT_SEED, random_prompts

    target, draft = trained_hybrid_pair
    ps = [{"prompt_token_ids": p} for p in random_prompts(8, 8, seed=TRAIN_PROMPT_SEED + 1).tolist()]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=str(target), device="cpu", batch_invariant=True, max_num_seqs=8, speculative_config=spec(draft))
    one = LLM(**kw)
    ref = tokens(one.generate(ps, params, use_tqdm=False))
    assert one.stats().mean_acceptance_length > 2.0, "a real draft: multi-row acceptance"
    llm = LLM(**kw, tensor_parallel_size=TP)
    try:
        assert tokens(llm.generate(ps, params, use_tqdm=False)) == ref
        assert spec_counts(llm.stats()) == spec_counts(one.stats())
    finally:
        llm.engine.close()
