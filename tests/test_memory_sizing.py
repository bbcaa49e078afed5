"""KV pool sizing (issue 10, item 1): vLLM's budget rule as a pure function, the profile step
(run on CPU here: reference ops and the kernel path under Triton's interpreter), the startup
refusal of a pool that cannot hold one full-length request, and the MemoryReport's numbers
agreeing with the scheduler's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_engine import _core
from dflash_engine.engine import LLMEngine
from dflash_engine.worker.memory import (
    GRAPH_BYTES_EACH,
    GRAPH_SLACK_BYTES,
    MemoryReport,
    cpu_pool_pages,
    kv_budget,
    size_kv_pool,
    size_pool,
)

GiB = 1 << 30
MiB = 1 << 20


def spec(draft_dir) -> dict:
    return {"method": "dflash", "model": str(draft_dir), "draft_length": "fixed"}


def engine(qwen3_dir, **kw) -> LLMEngine:
    return LLMEngine.from_kwargs(model=str(qwen3_dir), device="cpu", dtype="float32", **kw)


# ---- the arithmetic ----------------------------------------------------------------------

def test_size_pool_is_vllms_budget_in_whole_pages():
    # 80 GiB x 0.9 = 72 GiB; minus 20 in use, 4 peak, 1 graphs = 47 GiB of 2 MiB pages.
    assert size_pool(80 * GiB, 20 * GiB, 4 * GiB, 0.9, 2 * MiB, graph_reserve=1 * GiB) == 47 * 512
    assert kv_budget(80 * GiB, 20 * GiB, 4 * GiB, 0.9, 1 * GiB) == 47 * GiB
    # Partial pages are dropped; an exact fit is kept.
    assert size_pool(100, 0, 0, 1.0, 30) == 3
    assert size_pool(90, 0, 0, 1.0, 30) == 3
    assert size_pool(89, 0, 0, 1.0, 30) == 2
    # Nothing (or less than nothing) left: 0 pages, never negative.
    assert size_pool(10 * GiB, 9 * GiB, 1 * GiB, 1.0, MiB) == 0
    assert size_pool(10 * GiB, 9 * GiB, 2 * GiB, 0.5, MiB) == 0
    assert kv_budget(10 * GiB, 9 * GiB, 2 * GiB, 0.5) < 0
    # Each term costs exactly its bytes.
    base = size_pool(64 * GiB, 8 * GiB, 0, 0.9, MiB)
    assert size_pool(64 * GiB, 8 * GiB, 3 * MiB, 0.9, MiB) == base - 3
    assert size_pool(64 * GiB, 8 * GiB, 0, 0.9, MiB, graph_reserve=5 * MiB) == base - 5


def test_cpu_pool_is_the_byte_budget_capped_by_max_num_seqs_full_requests():
    assert cpu_pool_pages(1000, 10, max_num_seqs=4, pages_per_seq=17) == 4 * 17 + 1
    assert cpu_pool_pages(300, 10, max_num_seqs=4, pages_per_seq=17) == 30
    assert cpu_pool_pages(5, 10, max_num_seqs=4, pages_per_seq=17) == 0


def _gpu_report(**kw) -> MemoryReport:
    r = MemoryReport(device="cuda", num_pages=0, page_size=16, bytes_per_page=2 * MiB, max_model_len=4096,
                     reserve_rows=16, max_num_seqs=64, source="--gpu-memory-utilization 0.9",
                     total_bytes=140 * GiB, utilization=0.9, weights_bytes=17 * GiB, in_use_bytes=18 * GiB,
                     peak_activation_bytes=3 * GiB, graph_reserve_bytes=GiB, profile_tokens=2048,
                     profile_sample_rows=1009)
    for k, v in kw.items():
        setattr(r, k, v)
    r.num_pages = r.num_pages or size_pool(r.total_bytes, r.in_use_bytes, r.peak_activation_bytes, r.utilization,
                                           r.bytes_per_page, r.graph_reserve_bytes)
    return r


def test_report_numbers_agree_with_each_other():
    r = _gpu_report()
    per_seq = _core.pages_per_seq(4096, 16, 16)
    assert r.pages_per_seq == per_seq == 257
    assert r.num_pages == r.budget_bytes // r.bytes_per_page
    assert r.usable_pages == r.num_pages - 1 and r.num_tokens == r.usable_pages * 16
    assert r.kv_bytes == r.num_pages * 2 * MiB <= r.budget_bytes
    assert r.max_concurrency == pytest.approx(r.usable_pages / per_seq)
    pool, memory, concurrency = r.lines()
    assert f"KV pool: {r.usable_pages} pages x 16 tokens = {r.num_tokens} tokens" in pool
    assert "--gpu-memory-utilization 0.9" in pool
    assert "peak activation 3.00 GiB" in memory and "weights 17.00 GiB" in memory and "2048 tokens" in memory
    assert f"KV budget {r.budget_bytes / GiB:.2f} GiB" in memory and "took" not in memory
    r.graph_bytes = 700 * MiB
    assert "CUDA graphs took 700.0 MiB" in r.lines()[1]
    assert f"{r.max_concurrency:.2f} requests (257 pages each; --max-num-seqs 64)" in concurrency


def test_gpu_pool_too_small_names_the_numbers_and_the_flags():
    r = _gpu_report(in_use_bytes=125 * GiB)  # 126 - 125 - 3 - 1 < 0: no page at all
    assert r.num_pages == 0
    with pytest.raises(ValueError) as e:
        r.check_holds_one_request()
    msg = str(e.value)
    for needle in ("holds 0 pages", "--max-model-len 4096 needs 257 pages of 16 tokens",
                   "--gpu-memory-utilization (now 0.9)", "--num-gpu-blocks-override to at least 257",
                   "lower --max-model-len", "peak activation 3.00 GiB"):
        assert needle in msg, (needle, msg)
    _gpu_report(num_pages=258).check_holds_one_request()  # 257 usable: exactly one request fits


# ---- the engine on CPU -------------------------------------------------------------------

def test_override_too_small_is_a_clear_startup_error(qwen3_dir, random_draft_dir):
    # max_model_len 256 with B = 4 verify rows: ceil(260 / 16) = 17 pages per request.
    expected = (r"holds 16 pages \(256 tokens; --num-gpu-blocks-override 16\).*"
                r"--max-model-len 256 needs 17 pages.*--num-gpu-blocks-override to at least 17")
    with pytest.raises(ValueError, match=expected):
        engine(qwen3_dir, num_gpu_blocks_override=16, speculative_config=spec(random_draft_dir))
    e = engine(qwen3_dir, num_gpu_blocks_override=17, speculative_config=spec(random_draft_dir))
    assert e.num_usable_pages == 17 and e.max_concurrency == 1.0
    # A shorter max_model_len makes the same pool acceptable.
    assert engine(qwen3_dir, num_gpu_blocks_override=8, max_model_len=100).max_concurrency == pytest.approx(8 / 7)


def test_cpu_byte_budget_too_small_names_its_variable(qwen3_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_CPU_KV_CACHE_GB", "0.00001")  # ~10 KiB: a few pages of the tiny model
    with pytest.raises(ValueError, match="raise DFLASH_CPU_KV_CACHE_GB, lower --max-model-len, or set "
                                         "--num-gpu-blocks-override to at least 17"):
        engine(qwen3_dir)


def test_engine_report_matches_the_scheduler(qwen3_dir, random_draft_dir):
    e = engine(qwen3_dir, max_num_seqs=3, speculative_config=spec(random_draft_dir))
    m = e.runner.memory
    assert m.device == "cpu" and m.peak_activation_bytes is None and m.budget_line() == ""
    assert m.num_pages == e.runner.num_pages == e.runner.kv.num_pages
    assert m.usable_pages == e.num_usable_pages == e.scheduler.num_usable_pages
    assert m.pages_per_seq == _core.pages_per_seq(e.max_model_len, e.runtime_config.reserve_rows, 16)
    assert m.num_tokens == e.num_usable_pages * 16
    assert m.kv_bytes == m.num_pages * e.runner.bytes_per_page
    # The CPU pool: capped at max_num_seqs full-length requests (the default 1 GiB is plenty).
    assert m.usable_pages == 3 * m.pages_per_seq and e.max_concurrency == m.max_concurrency == 3.0
    pool, concurrency = m.lines()
    assert "--max-num-seqs 3 full-length requests" in pool and "3.00 requests" in concurrency


# ---- the profile step --------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens,max_num_seqs,b,d,max_model_len", [
    (2048, 64, 16, 16, 4096), (2048, 8, 4, 16, 256), (40, 8, 4, 8, 256), (7, 4, 1, 0, 64), (300, 1, 4, 4, 128),
    (10, 3, 4, 0, 64)])
def test_profile_plan_is_the_largest_step_and_stays_in_a_two_page_cache(num_tokens, max_num_seqs, b, d, max_model_len):
    page, reserve = 16, max(b, d)
    plan = _core.profile_plan(num_tokens, max_num_seqs, b, d, reserve, max_model_len, page, 7)
    rows, reqs, n_dec = len(plan.input_ids), len(plan), plan.num_decode
    assert reqs <= max_num_seqs and n_dec <= max(0, max_num_seqs - 1)
    q = np.diff(plan.query_start_loc)
    assert (q[:n_dec] == b).all() and (q > 0).all() and (q <= max_model_len).all()
    # As many rows as the budget, unless the request limit caps them.
    assert rows == num_tokens or (reqs == max_num_seqs and rows < num_tokens)
    assert len(plan.sample_rows) == n_dec * b + (reqs - n_dec) == plan.sample_start[-1]
    slots = np.concatenate([plan.slot_mapping, plan.draft_slot_mapping])
    assert ((slots >= page) & (slots < 2 * page)).all()  # page 1 of 2
    assert (plan.page_tables == 0).all() and plan.page_tables.shape[1] == _core.pages_per_seq(max_model_len, reserve, page)
    assert (plan.positions >= 0).all() and (plan.positions < max_model_len).all()
    dr = max(b, d) if b > 1 else 0
    assert plan.draft_rows == dr and len(plan.draft_input_ids) == n_dec * dr == len(plan.draft_slot_mapping)
    assert len(plan.verify_target_rows) == n_dec * (b - 1) == len(plan.draft_proposal_rows) * (dr > 0)


def _kv_snapshot(runner) -> list[torch.Tensor]:
    return [t.clone() for pair in runner.kv.target + runner.kv.draft for t in pair]


def test_profile_runs_on_cpu_and_leaves_the_pool_alone(qwen3_dir, random_draft_dir):
    e = engine(qwen3_dir, max_num_seqs=4, max_num_batched_tokens=200, speculative_config=spec(random_draft_dir))
    from dflash_engine import SamplingParams

    e.add_request("a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    before, kv = _kv_snapshot(e.runner), e.runner.kv
    steps_before = e.runner.step_timer.totals()
    assert e.runner.profile() == (None, None)  # measured on CUDA only
    assert e.runner.kv is kv and all(torch.equal(a, b) for a, b in zip(before, _kv_snapshot(e.runner)))
    # The engine still works after a profile.
    e.add_request("b", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    assert steps_before[2] > 0


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the interpreter mode is for machines without a GPU")
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")


def test_profile_runs_the_kernel_path_and_the_decode_step(qwen3_dir, random_draft_dir, kernels_on_cpu):
    """What the GPU runs at startup (Triton kernels, the padded decode step), under Triton's
    interpreter at small sizes: shapes and bounds, not bytes."""
    e = engine(qwen3_dir, max_num_seqs=3, max_num_batched_tokens=24, max_model_len=48,
               speculative_config=spec(random_draft_dir))
    g = e.runner.graphs[e.runtime_config.block_rows]
    calls = []
    real_step = g.step
    g.step = lambda bs, all_greedy, p=0: calls.append((bs, all_greedy, p)) or real_step(bs, all_greedy, p)
    before = _kv_snapshot(e.runner)
    assert e.runner.profile() == (None, None)
    # the largest bucket, sampled (on CUDA the largest mixed step too: its peak sizes the graph pool)
    assert calls == [(3, False, 0)]
    assert all(torch.equal(a, b) for a, b in zip(before, _kv_snapshot(e.runner)))


def test_the_cuda_branch_arithmetic_with_a_stand_in_device(qwen3_dir, random_draft_dir, monkeypatch):
    """The CUDA branch of the sizing, its device calls replaced by fixed numbers (the real
    thing runs on the device machine): the report carries the profile's numbers, the pool is
    `size_pool` of them, graphs get the decode peak plus slack, and the override still wins."""
    import dataclasses
    from types import SimpleNamespace

    e = engine(qwen3_dir, max_num_seqs=4, speculative_config=spec(random_draft_dir))
    r = e.runner
    fake = {"empty_cache": lambda *a: None, "memory_allocated": lambda *a: 5 * GiB,
            "mem_get_info": lambda *a: (70 * GiB, 80 * GiB)}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    rc = SimpleNamespace(**{f.name: getattr(e.runtime_config, f.name) for f in dataclasses.fields(e.runtime_config)})
    rc.device, rc.max_model_len, rc.reserve_rows = SimpleNamespace(type="cuda"), 256, e.runtime_config.reserve_rows
    rc.gpu_memory_utilization = 0.9

    def profile(report):
        report.profile_tokens = 99
        return 3 * GiB, GiB  # (largest eager step, decode step) peaks

    m = size_kv_pool(rc, r.bytes_per_page, profile, graphs=True)
    reserve = GiB + GRAPH_SLACK_BYTES
    assert (m.weights_bytes, m.in_use_bytes, m.total_bytes, m.peak_activation_bytes) == (5 * GiB, 10 * GiB, 80 * GiB,
                                                                                         3 * GiB)
    assert m.graph_reserve_bytes == reserve and m.profile_tokens == 99
    assert m.num_pages == size_pool(80 * GiB, 10 * GiB, 3 * GiB, 0.9, r.bytes_per_page, reserve) > 0
    assert m.source == "--gpu-memory-utilization 0.9" and "peak activation 3.00 GiB" in m.lines()[1]
    assert size_kv_pool(rc, r.bytes_per_page, profile, graphs=False).graph_reserve_bytes == 0  # no graphs: no reserve
    assert size_kv_pool(rc, r.bytes_per_page, profile, graphs=True, num_graphs=70).graph_reserve_bytes == \
        reserve + 70 * GRAPH_BYTES_EACH  # each startup graph's own memory
    rc.num_gpu_blocks_override = 100
    m = size_kv_pool(rc, r.bytes_per_page, profile, graphs=True)
    assert m.num_pages == 101 and m.source == "--num-gpu-blocks-override 100" and m.peak_activation_bytes == 3 * GiB
