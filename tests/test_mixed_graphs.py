"""Mixed steps (a prefill chunk beside decode rows) through the graph runner's padded shapes
(worker/graph_runner.py): which plans fit a mixed graph, how one is staged, and an engine
whose mixed steps replay those shapes producing what eager mixed steps and the reference
path produce. On CPU the kernels run under Triton's interpreter, the runner in eager mode
over the same padded buffers a CUDA graph captures."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_engine import LLM, SamplingParams
from dflash_engine.distributed.step_message import WirePlan
from dflash_engine.worker.graph_runner import MIXED_REQUESTS, GraphRunner, mixed_buckets
from dflash_engine.worker.sampling_batch import RequestParams, SamplingBatch


def test_mixed_buckets():
    assert mixed_buckets(0) == []
    assert mixed_buckets(16) == [16]
    assert mixed_buckets(100) == [16, 32, 64, 96, 100]
    assert mixed_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]


def runner(b: int = 3, d: int = 4, mixed_tokens: int = 64) -> GraphRunner:
    return GraphRunner(None, None, block_rows=b, draft_rows=d, max_num_seqs=8, page_table_width=5,
                       enforce_eager=True, capture_buckets=[], device=torch.device("cpu"), mixed_tokens=mixed_tokens)


class Plan(SimpleNamespace):
    def __len__(self) -> int:
        return self.r

    # The numpy staging a tensor-parallel worker's plan copy uses (tests/test_core.py checks the
    # core's against it).
    stage_into = WirePlan.stage_into
    max_pages = WirePlan.max_pages


def make(b: int, decode_positions: list[int], chunks: list[tuple[int, int, bool]], d: int = 4) -> Plan:
    """A plan as the core lays it out: decoding requests (B rows each at their positions), then
    prefill chunks (start position, length, whether the chunk ends its prompt and samples)."""
    rd = len(decode_positions)
    q_lens = [b] * rd + [n for _, n, _ in chunks]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + b) for p in decode_positions]
                               + [np.arange(s, s + n) for s, n, _ in chunks]).astype(np.int64)
    seq_lens = np.array([p + b for p in decode_positions] + [s + n for s, n, _ in chunks], np.int32)
    sample_rows, sample_start = [], [0]
    for i in range(rd):
        sample_rows += list(range(i * b, i * b + b))
        sample_start.append(len(sample_rows))
    for j, (_, _, samples) in enumerate(chunks):
        if samples:
            sample_rows.append(int(qsl[rd + j + 1]) - 1)
        sample_start.append(len(sample_rows))
    rows = int(qsl[-1])
    r = rd + len(chunks)
    return Plan(
        num_decode=rd, block_rows=b, num_rows=rows, query_start_loc=qsl, seq_lens=seq_lens, positions=positions,
        input_ids=np.arange(100, 100 + rows, dtype=np.int64), slot_mapping=np.arange(rows, dtype=np.int64) + 1000,
        page_tables=np.arange(1, 1 + 2 * r, dtype=np.int32).reshape(r, 2),
        sample_rows=np.array(sample_rows, np.int64), sample_start=np.array(sample_start, np.int64),
        draft_input_ids=np.full(rd * d, 7, np.int64), draft_positions=np.zeros(rd * d, np.int64),
        draft_slot_mapping=np.zeros(rd * d, np.int64), draft_seq_lens=np.array(decode_positions, np.int32) + 1,
        r=r)


def batch(p, **values) -> SamplingBatch:
    """A step's sampling parameters from one value per request of plan `p`."""
    return SamplingBatch(RequestParams(values, p.sample_start), p)


def test_which_mixed_plans_fit_a_graph():
    g = runner()
    assert g.mixed_bucket(make(3, [10, 20], [(0, 5, True)])) == 16
    assert g.mixed_bucket(make(3, [10], [(0, 17, True), (32, 8, False)])) == 32
    assert g.mixed_bucket(make(3, [10], [(0, 64, False)])) == 64
    assert g.mixed_bucket(make(3, [10], [(0, 65, True)])) is None, "more prefill tokens than the largest bucket"
    assert g.mixed_bucket(make(3, [], [(0, 5, True)])) is None, "no decoding request: eager"
    assert g.mixed_bucket(make(3, [10], [(0, 2, True)] * (MIXED_REQUESTS + 1))) is None
    assert g.mixed_bucket(make(4, [10], [(0, 5, True)])) is None, "another runner's B"
    odd = make(3, [10], [(0, 5, True)])
    odd.sample_rows = odd.sample_rows.copy()
    odd.sample_rows[-1] -= 1  # a prefill request sampling a row other than its chunk's last
    assert g.mixed_bucket(odd) is None
    assert runner(mixed_tokens=0).mixed_bucket(make(3, [10], [(0, 5, True)])) is None, "mixed graphs off"


def test_a_mixed_plan_is_staged_with_padding_blocks_apart_from_real_rows():
    b, d = 3, 4
    g = runner(b, d)
    p = make(b, [10, 20, 30], [(0, 5, True), (40, 6, False)])  # 3 decoding requests: bucket 4
    bs, pb = g.bucket(3), g.mixed_bucket(p)
    assert (bs, pb) == (4, 16)
    r = len(p)
    st = batch(p, top_k=np.arange(r) + 2, seed=np.arange(r) + 50, greedy=np.zeros(r, bool),
               temperature=np.full(r, 0.5), top_p=np.full(r, 0.9), min_p=np.zeros(r))
    slot_of = g._stage(p, st, bs, pb)
    v = {name: g._view(g.host_i64, name).numpy() for name, _ in g.fields}
    rows, n = p.num_rows, bs * b + pb  # 9 + 11 real rows; 12 + 16 in the graph
    assert (v["input_ids"][:rows] == p.input_ids).all() and (v["slots"][rows:n] == -1).all()
    nr = bs + MIXED_REQUESTS
    assert list(v["qsl"][:nr + 1]) == list(p.query_start_loc) + [rows] * (nr - len(p))
    srows = v["srows"][:bs * b + MIXED_REQUESTS]
    # decoding slots 0-2: their own blocks; slot 3 (padding): three padding rows past the real ones
    assert list(srows[:9]) == list(range(9)) and list(srows[9:12]) == [rows, rows + 1, rows + 2]
    assert list(srows[12:14]) == [13, 19], "each prefill request's chunk's last row"
    assert set(v["vrows"][:bs * (b - 1)]) == {1, 2, 4, 5, 7, 8, rows + 1, rows + 2}
    assert list(slot_of) == list(range(9)) + [12], "the prefill request that samples: slot bs*B + 0"
    assert list(v["seed"][slot_of]) == list(st["seed"]) and v["top_k"][13] == 1 and v["greedy"][13] == 1
    ns = g.max_sample
    assert g.host_f32.numpy()[slot_of] == pytest.approx(0.5) and g.host_f32.numpy()[ns + 12] == pytest.approx(0.9)
    assert list(v["d_seq_lens"][:bs]) == [11, 21, 31, 0]


def random_plan(rng, g: GraphRunner, b: int, d: int):
    """A plan of 1-8 decoding requests (and, with at most 4, 0-2 prefill chunks) with random
    page tables of a random width, and its sampling batch. -> (plan, batch, decoding requests,
    table width)."""
    rd = int(rng.integers(1, 9))
    chunks = [(0, int(rng.integers(1, 6)), True)] * int(rng.integers(0, 3)) if rd <= 4 else []
    p = make(b, [10] * rd, chunks, d)
    width = int(rng.integers(1, g.width + 1))
    p.page_tables = rng.integers(1, 1000, size=(len(p), width)).astype(np.int32)
    n = len(p)
    st = batch(p, top_k=np.ones(n), seed=np.zeros(n), greedy=np.ones(n, bool), temperature=np.ones(n),
               top_p=np.ones(n), min_p=np.zeros(n))
    return p, st, rd, width


def test_staged_page_tables_are_each_plans_own_and_the_null_page_elsewhere():
    """Staging writes a plan's page tables and zeroes only what the previous plan covered and
    this one does not (not every row's whole width): after any sequence of plans of varying
    requests and table widths, decode and mixed, the staged tables are exactly this plan's,
    with the null page (0) everywhere else -- what a padding request and a table's tail read."""
    b, d = 3, 4
    g = runner(b, d)
    rng = np.random.default_rng(5)
    full = g._view(g.host_i64, "pages").numpy()
    for _ in range(60):
        p, st, rd, width = random_plan(rng, g, b, d)
        pb = g.mixed_bucket(p) if p.r > rd else 0
        g._stage(p, st, g.bucket(rd), pb or 0)
        want = np.zeros_like(full).reshape(-1, g.width)
        want[:len(p), :width] = p.page_tables
        assert (full.reshape(-1, g.width) == want).all()
    g.reset_inputs()
    assert (full == 0).all() and g._pages_used == (0, 0)


def test_a_steps_device_inputs_are_its_own_plans_after_any_sequence_of_buckets():
    """`run` copies the staged buffer to the device only up to its bucket's page-table rows (the
    tables are last in it): after steps of growing and shrinking buckets, decode and mixed, what
    the step reads on the device (its inputs' ids, positions and page tables) is this plan's,
    never a larger bucket's leftovers."""
    b, d = 3, 4
    g = runner(b, d)
    g.timer = SimpleNamespace(begin=lambda cell: None, end=lambda: None)
    seen = {}

    def step(bs, all_greedy, p=0):  # the device step, reading its inputs as the graph does
        x = g._inputs(bs, p)
        seen.update(ids=x.input_ids.clone(), pages=x.meta.page_tables.clone(), nr=x.meta.seq_lens.numel())
    g.step = step
    rng = np.random.default_rng(7)
    for _ in range(40):
        p, st, rd, width = random_plan(rng, g, b, d)
        p.input_ids = rng.integers(1, 1000, size=p.num_rows).astype(np.int64)
        n = len(p)
        pb = (g.mixed_bucket(p) or 0) if n > rd else 0
        if n > rd and not pb:
            continue
        g.run(p, st, True, pb)
        want = np.zeros((seen["nr"], g.width), np.int32)  # the real requests in plan order, then padding
        want[:n, :width] = p.page_tables
        assert (seen["pages"].numpy() == want).all()
        assert (seen["ids"][:rd * b].numpy() == p.input_ids[:rd * b]).all()


def test_staged_sampling_fields_are_always_this_steps_even_when_their_writes_are_skipped():
    """Steady decoding hands `_stage` the same per-request parameters step after step and they
    are then not rewritten: after any sequence of decode and mixed plans, bucket changes, reused
    or new parameters and captures (reset_inputs), the staged sampling fields are exactly this
    plan's, row by row."""
    b, d = 3, 4
    g = runner(b, d)
    rng = np.random.default_rng(9)
    v = {name: g._view(g.host_i64, name).numpy() for name, _ in g.fields}
    f32, big = g.host_f32.numpy(), g.max_sample
    params, key, skipped, rd = None, None, 0, 1
    for _ in range(200):
        if rng.random() < 0.3:  # otherwise the batch stays (steady decoding)
            rd = int(rng.integers(1, 9))
        chunks = [(0, int(rng.integers(1, 6)), True)] * int(rng.integers(1, 3)) if rd <= 4 and rng.random() < 0.3 else []
        p = make(b, [10] * rd, chunks, d)
        n, r = len(p.sample_rows), len(p)
        if params is None or key != (rd, len(chunks)) or rng.random() < 0.2:  # a new batch: new parameters
            params = RequestParams({"top_k": rng.integers(2, 50, r), "seed": rng.integers(0, 1 << 40, r),
                                    "greedy": rng.random(r) < 0.5, "temperature": rng.random(r),
                                    "top_p": rng.random(r), "min_p": rng.random(r)}, p.sample_start)
            key = (rd, len(chunks))
        st = SamplingBatch(params, p)  # a new mapping each step, as the engine's
        if rng.random() < 0.05:
            g.reset_inputs()
        bs, pb = g.bucket(rd), (g.mixed_bucket(p) or 0) if chunks else 0
        before = g._staged_sampling
        slot_of = g._stage(p, st, bs, pb)
        skipped += before is not None and g._staged_sampling is before
        ns = g._shape(bs, pb)[2]
        slots = np.arange(n) if slot_of is None else slot_of
        for name, pad in (("top_k", 1), ("seed", 0), ("greedy", 1)):
            want = np.full(ns, pad, np.int64)
            want[slots] = st[name]
            assert (v[name][:ns] == want).all(), name
        for i, name in enumerate(("temperature", "top_p", "min_p")):
            want = np.ones(ns, np.float32)
            want[slots] = st[name]
            assert (f32[i * big:i * big + ns] == want).all(), name
    assert skipped > 50, "steady decoding skips rewriting its sampling fields"


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter mode is for machines without a GPU")


def arrivals(n: int, seed: int = 9, most: int = 8) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts of 3..36 tokens with 2..`most` new tokens each: with 2-3 seats, requests finish at
    different steps and the next one's prefill (chunked past the step budget) joins decode rows."""
    rng = np.random.default_rng(seed)
    ps = [{"prompt_token_ids": rng.integers(3, 250, size=int(rng.integers(3, 36))).tolist()} for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(2, most + 1)), ignore_eos=True) for _ in range(n)]
    return ps, params


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@CPU_ONLY
def test_mixed_steps_through_the_graph_shapes_equal_the_reference(qwen3_dir, random_draft_dir, monkeypatch):
    """Spec on (K = 3, fixed), 4 seats (buckets 1, 2, 4: three decoding requests pad to 4),
    6 requests arriving as seats free, a 24-token step budget (prompts over it are chunked):
    the mixed steps replay the runner's padded shapes and give the tokens the reference path
    gives (its mixed steps eager, in the plan's own shapes). Drafts are accepted by a seeded RNG (the random draft's own would all be rejected), so accepted runs
    of every length pass through the mixed steps' acceptance. Every other request samples
    (temperature, top-k, top-p; keyed by seed and position, so any path gives its tokens)."""
    # (seed 14, up to 8 tokens: 6 steps, 4 of them mixed, with 3 decoding requests in one and
    # accepted runs of 0-3 drafts among them; each kernel-path row costs ~0.1 s)
    ps, params = arrivals(6, seed=14, most=8)
    params = [p if i % 2 else SamplingParams(temperature=0.9, top_k=30, top_p=0.95, max_tokens=p.max_tokens,
                                             ignore_eos=True, seed=i) for i, p in enumerate(params)]
    spec = {"method": "dflash", "model": str(random_draft_dir), "draft_length": "fixed",
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.7, 0.5]}
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    kw = dict(model=str(qwen3_dir), device="cpu", max_num_seqs=4, max_num_batched_tokens=24, speculative_config=spec)
    mixed = LLM(**kw)
    got = tokens(mixed.generate(ps, params, use_tqdm=False))
    paths = mixed.engine.runner.steps_by_path()
    assert paths["mixed_graph"] >= 3 and paths["decode_graph"] > 0, paths
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    ref = LLM(**kw)
    assert got == tokens(ref.generate(ps, params, use_tqdm=False))
    assert ref.engine.runner.steps_by_path()["mixed_graph"] == 0


def eager_replay(self, bs, p, all_greedy):
    """GraphRunner._capture_one on CPU: a "graph" that replays the padded step eagerly."""
    self.graphs[(bs, p, all_greedy)] = SimpleNamespace(replay=lambda: self.step(bs, all_greedy, p))


@CPU_ONLY  # (the kernels run on CPU tensors: the interpreter's mode; run 46 met it on an H100 unmarked)
def test_a_failed_mixed_capture_falls_back_to_eager_steps(qwen3_dir, random_draft_dir, monkeypatch, caplog):
    """A mixed graph's first-use capture that raises (out of memory, say) costs no request:
    that step and every later mixed step run eagerly, and the tokens are the reference's."""
    # (seed 14, up to 3 tokens: 5 steps, two of them mixed, i.e. the failed capture's and a later one)
    ps, params = arrivals(3, seed=14, most=3)
    spec = {"method": "dflash", "model": str(random_draft_dir), "draft_length": "fixed"}

    def capture(self, bs, p, all_greedy):  # decode "graphs" replay eagerly; mixed ones fail
        if p:
            raise RuntimeError("capture refused")
        eager_replay(self, bs, p, all_greedy)

    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    kw = dict(model=str(qwen3_dir), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, speculative_config=spec)
    llm = LLM(**kw)
    monkeypatch.setattr(GraphRunner, "_capture_one", capture)
    for g in llm.engine.runner.graphs.values():
        g.enforce_eager = False
    llm.engine.scheduler.set_mixed_step_limit(*llm.engine.runner.mixed_step_limit())
    assert llm.engine.scheduler.mixed_step_limit() == (16, MIXED_REQUESTS)
    got = tokens(llm.generate(ps, params, use_tqdm=False))
    paths = llm.engine.runner.steps_by_path()
    assert paths["mixed_graph"] == 0 and paths["decode_graph"] > 0 and paths["eager"] >= 2, paths
    assert llm.engine.scheduler.mixed_step_limit() == (0, 0), "no graph holds mixed steps now: limit lifted"
    assert all(g.mixed_tokens == 0 for g in llm.engine.runner.graphs.values())
    assert "mixed steps run eagerly from now on" in caplog.text
    assert "the mixed-step limit is lifted" in caplog.text
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    assert got == tokens(LLM(**kw).generate(ps, params, use_tqdm=False))


def test_the_mixed_step_limit_is_what_the_graphs_hold():
    from dflash_engine.worker.model_runner import ModelRunner

    def limit(*graphs):
        return ModelRunner.mixed_step_limit(SimpleNamespace(graphs=dict(enumerate(graphs))))
    assert limit(SimpleNamespace(mixed_tokens=512, enforce_eager=False),
                 SimpleNamespace(mixed_tokens=512, enforce_eager=False)) == (512, MIXED_REQUESTS)
    assert limit(SimpleNamespace(mixed_tokens=512, enforce_eager=True)) == (0, 0), "eager: no graphs to fit"
    assert limit(SimpleNamespace(mixed_tokens=0, enforce_eager=False)) == (0, 0), "mixed graphs off"
    assert limit() == (0, 0), "no graph runner (CPU)"


@CPU_ONLY
def test_the_mixed_step_limit_keeps_steps_with_arrivals_in_graphs(qwen3_dir, random_draft_dir, monkeypatch):
    """With the core's mixed-step limit at what the graphs hold (16 prefill tokens here, under a
    64-token step budget), a step with decoding requests never carries more prefill than a
    mixed graph takes: none of them runs eagerly, where without the limit some do; the tokens
    are the reference path's either way (a chunk that waits a step changes no output)."""
    # 2 seats, 4 requests: the first decodes 12 tokens while the second's 2 finish; the third's
    # 17-token prompt then joins its decode rows (one token over the graphs' 16: the unlimited run
    # takes that step eagerly, the limited run splits the chunk), the fourth's 4 tokens fit a mixed
    # graph either way (each kernel-path row costs ~0.1 s under the interpreter: few, short prompts)
    rng = np.random.default_rng(9)
    ps = [{"prompt_token_ids": rng.integers(3, 250, size=n).tolist()} for n in (3, 3, 17, 4)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 2, 2, 2)]
    spec = {"method": "dflash", "model": str(random_draft_dir), "draft_length": "fixed",
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.9, 0.7, 0.5]}
    kw = dict(model=str(qwen3_dir), device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
              max_mixed_graph_tokens=16, speculative_config=spec)
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    monkeypatch.setattr(GraphRunner, "_capture_one", eager_replay)
    got, eager_with_decode = {}, {}
    for limited in (False, True):
        llm = LLM(**kw)
        eng = llm.engine
        assert eng.scheduler.mixed_step_limit() == (0, 0), "interpreter mode: eager graph runners"
        for g in eng.runner.graphs.values():
            g.enforce_eager = False
        if limited:
            eng.scheduler.set_mixed_step_limit(*eng.runner.mixed_step_limit())
            assert eng.scheduler.mixed_step_limit() == (16, MIXED_REQUESTS)
        launch, counts = eng.runner._launch_eager, []

        def counting(plan, st, all_greedy, launch=launch, counts=counts):
            counts.append(plan.num_decode > 0)
            return launch(plan, st, all_greedy)
        eng.runner._launch_eager = counting
        got[limited] = tokens(llm.generate(ps, params, use_tqdm=False))
        eager_with_decode[limited] = sum(counts)
        assert eng.runner.steps_by_path()["mixed_graph"] > 0
    assert eager_with_decode[False] > 0, "the unlimited run should meet a step over the graphs' 16 tokens"
    assert eager_with_decode[True] == 0
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    ref = tokens(LLM(**kw).generate(ps, params, use_tqdm=False))
    assert got[False] == ref and got[True] == ref


def test_max_mixed_graph_tokens_is_checked_and_reaches_the_engine():
    import argparse

    from dflash_engine.cli_args import add_serve_args, engine_kwargs
    from dflash_engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_mixed_graph_tokens"):
        EngineConfig(speculative_config=None, max_mixed_graph_tokens=-1)
    parser = add_serve_args(argparse.ArgumentParser())
    assert engine_kwargs(parser.parse_args(["--max-mixed-graph-tokens", "0"]))["max_mixed_graph_tokens"] == 0
    assert "max_mixed_graph_tokens" not in engine_kwargs(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-mixed-graph-tokens", "-3"])
