"""The GPU step: `step.run_step` over static padded buffers, one CUDA graph per shape
bucket, replayed. Pure-decode steps (bucket: decoding requests) and mixed steps (a new
request's prefill chunk beside decode rows; bucket: decoding requests x prefill tokens).

A decode step has B rows per request (B = 1 with speculation off, or a step that verifies
no drafts), so its shape is fixed by the number of requests. Requests are padded up to the
next bucket (1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs). One runner serves one B; with
several draft lengths the model runner holds one per B, sharing one graph memory pool.

Host side per step: the plan's arrays (target and draft pass) are packed into one pinned
int64 buffer and one pinned float32 buffer, copied to the device in two async copies; the
graph unpacks them. The results (sampled tokens, then accepted counts) come back in one
non-blocking device-to-host copy, waited for later (in_flight.py).

Padding requests have q_len 0 in the target pass, seq_len 0, page tables of null pages and
slot -1 (target and draft rows): attention gives them nothing, the KV store skips them, and
their rows' garbage never reaches a real row (every op here is row-wise or per request).
Eager mode (`enforce_eager`, and the CPU interpreter tests) runs the same function on the
same padded shapes, so graphs and eager give the same tokens.

Mixed steps (`mixed_tokens` > 0). Rows: the decoding requests' blocks, the prefill chunks,
then padding up to `bs*B + P` (P: the prefill tokens' bucket, `mixed_buckets`). Requests:
the real ones in plan order, then padding ones (q_len 0) up to `bs + MIXED_REQUESTS`. Sample
slots (the rows whose logits are taken, staged per step): `bs*B` block rows, decoding slot i's
block at rows i*B.. for a real request and at distinct padding rows for a padding one (so
its drafts land in padding rows), then one slot per prefill request (its chunk's last row;
a chunk that ends before its prompt does samples a row nobody reads). The draft pass and the
acceptance read the first bs*B sample slots as the decode step does. A step with more
prefill requests or tokens than that, no decoding request, or a hybrid target runs
eagerly. Greedy mixed graphs are captured at startup with the decode ones (every capture
bucket x prefill bucket); sampled ones and buckets captured later on first use.

A hybrid target's step also stages its state slots (`state_read` per request, `state_write`
per row; padding: -1, nothing read or kept) and marks the step all-per-token
(StateMetadata.all_per_token), so that its GDN layers run the recurrent kernels without
reading anything back to the host.
"""
from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

from .. import _core
from ..models.hybrid_state import StateMetadata
from ..ops.attention import AttentionMetadata
from ..ops.sampling import SamplingTensors
from .in_flight import InFlight
from .sampling_batch import SamplingBatch
from .step import DraftInputs, StepInputs, StepModels, run_step
from .step_timer import StepTimer

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 40, ... capped by (and including) max_num_seqs."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b = b * 2 if b < 16 else b + 8
    out.append(max_num_seqs)
    return sorted(set(out))


def mixed_buckets(max_tokens: int) -> list[int]:
    """Prefill-token buckets of the mixed graphs: 16, 32, 64, then 1.5x and 2x powers of two
    (96, 128, 192, 256, 384, 512, ...) up to and including `max_tokens` (0: none)."""
    if max_tokens <= 0:
        return []
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        if b >= 64:
            out.append(b * 3 // 2)
        b *= 2
    out.append(max_tokens)
    return sorted({x for x in out if x <= max_tokens})


# Prefill requests a mixed graph holds besides its decoding requests (more: the step runs eagerly).
MIXED_REQUESTS = 4
# Mixed graphs one runner captures at most (the startup set: capture buckets x prefill buckets;
# a sampled variant's first use stalls its step by a capture); a new shape past this runs eagerly.
MAX_MIXED_GRAPHS = 256


class MixedCaptureFailed(RuntimeError):
    """A mixed step's first-use capture failed: mixed graphs are off for the runner from now
    on, and this step runs eagerly (the model runner's fallback)."""


def bucket_of(buckets: list[int], num_reqs: int) -> int:
    """The smallest bucket that holds `num_reqs` decoding requests."""
    for bs in buckets:
        if bs >= num_reqs:
            return bs
    raise ValueError(f"{num_reqs} decoding requests exceed max_num_seqs ({buckets[-1]})")


_FLOAT_FIELDS = ("temperature", "top_p", "min_p")


class GraphRunner:
    """Static buffers and captured graphs of the decode step with B = `block_rows`."""

    def __init__(self, models: StepModels, timer: StepTimer, *, block_rows: int, draft_rows: int,
                 max_num_seqs: int, page_table_width: int, enforce_eager: bool, capture_buckets: list[int],
                 device: torch.device, hybrid: bool = False, collectives: bool = False, mixed_tokens: int = 0):
        """draft_rows: D of this B's draft pass (0: none); capture_buckets: those captured at
        startup (others on first use); hybrid: the target keeps recurrent state in slots;
        mixed_tokens: the most prefill tokens a mixed step's graph carries (0: mixed steps
        run eagerly; so for hybrid targets, whose prefill chunks read their state differently);
        collectives: the step all-reduces across tensor-parallel ranks (NCCL kernels inside
        the graphs; captured in thread-local mode so that the process group's watchdog
        thread, which polls its events, does not invalidate the capture)."""
        self.models, self.timer, self.device = models, timer, device
        self.collectives = collectives
        self.b, self.d, self.width, self.hybrid = block_rows, draft_rows, page_table_width, hybrid
        self.buckets = batch_buckets(max_num_seqs)
        self.capture_buckets = sorted(capture_buckets)
        self.max_bs = self.buckets[-1]
        on_gpu = device.type == "cuda"
        self.enforce_eager = enforce_eager or not on_gpu  # (CPU: the interpreter test mode)
        self.token_buckets = [] if hybrid else mixed_buckets(mixed_tokens)
        self.mixed_tokens = self.token_buckets[-1] if self.token_buckets else 0
        pr = MIXED_REQUESTS if self.mixed_tokens else 0
        bs = self.max_bs
        nd = bs * self.d
        n = bs * self.b + self.mixed_tokens  # target rows
        nr, ns = bs + pr, bs * self.b + pr  # requests, sample slots
        self.max_sample = ns
        self.fields = [("input_ids", n), ("positions", n), ("slots", n), ("qsl", nr + 1), ("seq_lens", nr),
                       ("top_k", ns), ("seed", ns), ("greedy", ns),
                       ("srows", ns if pr else 0), ("vrows", bs * (self.b - 1) if pr else 0),
                       ("d_ids", nd), ("d_positions", nd), ("d_slots", nd), ("d_seq_lens", bs if self.d else 0),
                       ("s_read", bs if hybrid else 0), ("s_write", n if hybrid else 0),
                       ("pages", nr * self.width)]  # last: a step copies only its bucket's rows of it
        self.offsets, at = {}, 0
        for name, size in self.fields:
            self.offsets[name] = (at, size)
            at += size
        self.host_i64 = torch.zeros(at, dtype=torch.int64, pin_memory=on_gpu)
        self.host_f32 = torch.zeros(3 * ns, dtype=torch.float32, pin_memory=on_gpu)
        self.dev_i64 = torch.zeros(at, dtype=torch.int64, device=device)
        self.dev_f32 = torch.zeros(3 * ns, dtype=torch.float32, device=device)
        # Typed static inputs, filled from the packed buffers inside the step.
        self.qsl = torch.zeros(nr + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(nr, dtype=torch.int32, device=device)
        self.pages = torch.zeros(nr, self.width, dtype=torch.int32, device=device)
        self.d_seq_lens = torch.zeros(bs, dtype=torch.int32, device=device)
        # The draft blocks' offsets and rows are fixed by the shape: i*D, and rows 1..B-1.
        steps = torch.arange(bs + 1, device=device)
        self.d_qsl = (steps * self.d).to(torch.int32)
        self.proposal_rows = (steps[:bs, None] * self.d + torch.arange(1, self.b, device=device)).reshape(-1)
        self.verify_rows = (steps[:bs, None] * self.b + torch.arange(1, self.b, device=device)).reshape(-1)
        self.out = torch.zeros(ns + bs, dtype=torch.int64, device=device)
        self.host_out = torch.zeros(ns + bs, dtype=torch.int64, pin_memory=on_gpu)
        # numpy views of the pinned buffers, made once: `_stage` runs on the critical path
        # between steps, where making 17 views a step cost ~85 us of the ~130 us it took.
        self._np = {name: self._view(self.host_i64, name).numpy() for name, _ in self.fields}
        self._np_f32 = self.host_f32.numpy()
        self._np_i64 = self.host_i64.numpy()
        self._np_out = self.host_out.numpy()
        # Per (bucket, P): the plan arrays `_stage` copies in one core call (StepPlan.stage_into).
        self._plan_fields: dict[tuple[int, int], list[tuple[str, int, int, int | None]]] = {}
        # The sampling parameters (RequestParams) the pinned buffers hold from the last decode
        # staging, and its slot count: steady decoding stages the same object again
        # (engine._sampling_arrays reuses it while the batch stays), so they are written only
        # when they change.
        self._staged_sampling: tuple[int, object] | None = None
        # The extent of the page tables the last staging wrote ([requests, width] rows of
        # "pages"): everything outside it is the null page (0), so staging zeroes only what the
        # last plan covered and this one does not, not every row's width.
        self._pages_used = (0, 0)
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (bs, P (0: decode), all greedy)
        self.pdl_graphs: set[tuple[int, int, bool]] = set()  # the graphs captured with PDL asked (kernels/pdl.py)
        self.steps = {"decode": 0, "mixed": 0}  # steps this runner ran, by kind
        self.pool = None  # a graph memory pool, shared by every runner of the model runner
        self._warmup_stream = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0

    @property
    def mixed_graphs(self) -> int:
        """Mixed graphs captured."""
        return sum(1 for key in self.graphs if key[1])

    @property
    def startup_graphs(self) -> int:
        """Graphs `capture` takes (0 in eager mode)."""
        return 0 if self.enforce_eager else len(self.capture_buckets) * (1 + len(self.token_buckets))

    # ---- host side --------------------------------------------------------------------
    def bucket(self, num_reqs: int) -> int:
        return bucket_of(self.buckets, num_reqs)

    def mixed_bucket(self, plan) -> int | None:
        """P, the prefill-token bucket of a mixed plan this runner can replay, or None (the
        step runs eagerly): at least one decoding request (leading the plan, B rows each), at
        most MIXED_REQUESTS prefill requests of at most `mixed_tokens` rows in all, and each
        prefill request sampling nothing or its chunk's last row."""
        if not self.mixed_tokens or plan.block_rows != self.b:
            return None
        prefill = _core.mixed_prefill_tokens(plan.query_start_loc, plan.sample_start, plan.sample_rows,
                                             plan.num_decode, self.b, MIXED_REQUESTS)
        if prefill is None or prefill > self.mixed_tokens:
            return None
        p = next(p for p in self.token_buckets if p >= prefill)
        # a new shape past the cap runs eagerly (counted only then: off the common path)
        bs = self.bucket(plan.num_decode)
        if (not self.enforce_eager and (bs, p, True) not in self.graphs and (bs, p, False) not in self.graphs
                and self.mixed_graphs >= MAX_MIXED_GRAPHS):
            return None
        return p

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        at, size = self.offsets[name]
        return buf[at:at + size]

    def _shape(self, bs: int, p: int) -> tuple[int, int, int]:
        """(target rows, requests, sample slots) of bucket `bs` (and P = `p`; 0: decode)."""
        pr = MIXED_REQUESTS if p else 0
        return bs * self.b + p, bs + pr, bs * self.b + pr

    def _fields(self, bs: int, p: int) -> list[tuple[str, int, int, int | None]]:
        """(plan array, offset in the pinned buffer, length at bucket `bs` and `p`, padding;
        None: the array's last value) of every plan array `_stage` copies."""
        fields = self._plan_fields.get((bs, p))
        if fields is None:
            n, nr, _ = self._shape(bs, p)
            dn = bs * self.d
            at = {name: self.offsets[name][0] for name, _ in self.fields}
            fields = [("input_ids", at["input_ids"], n, 0), ("positions", at["positions"], n, 0),
                      ("slot_mapping", at["slots"], n, -1),
                      ("query_start_loc", at["qsl"], nr + 1, None),  # padding requests: empty, at the end
                      ("seq_lens", at["seq_lens"], nr, 0)]
            if self.d:
                fields += [("draft_input_ids", at["d_ids"], dn, 0), ("draft_positions", at["d_positions"], dn, 0),
                           ("draft_slot_mapping", at["d_slots"], dn, -1), ("draft_seq_lens", at["d_seq_lens"], bs, 0)]
            if self.hybrid:
                fields += [("state_read", at["s_read"], bs, -1), ("state_write", at["s_write"], n, -1)]
            self._plan_fields[(bs, p)] = fields
        return fields

    def _stage(self, plan, st: SamplingBatch, bs: int, p: int) -> np.ndarray | None:
        """Pack the plan (padded to bucket `bs`, and `p` prefill tokens) into the pinned
        buffers. -> for a mixed step, the sample slot of each of the plan's sample rows."""
        r, rd = len(plan), plan.num_decode
        ns = self._shape(bs, p)[2]
        v = self._np
        # The plan's arrays, padded, and its page tables (zeroing what the last plan's covered
        # and this one's do not): one core call.
        plan.stage_into(self._np_i64, self._fields(bs, p), (self.offsets["pages"][0], self.width, *self._pages_used))
        self._pages_used = (r, plan.max_pages)
        slot_of = mixed = None
        if p:  # the sample rows and verify rows in the graph's slots; each plan sample row's slot
            slot_of = _core.stage_mixed_rows(v["srows"][:ns], v["vrows"][:bs * (self.b - 1)], plan.query_start_loc,
                                             plan.sample_start, rd, bs, self.b)
            mixed = (rd, bs * self.b)
        params = st.params  # (per request: worker/sampling_batch.py)
        last = self._staged_sampling
        if mixed is None and last is not None and last[0] == ns and last[1] is params:
            return None  # the same batch as the last decode step's: the buffers hold its parameters already
        self._staged_sampling = (ns, params) if mixed is None else None
        f, big, values = self._np_f32, self.max_sample, params.values
        _core.stage_sampling([(v["top_k"][:ns], values["top_k"], 1), (v["seed"][:ns], values["seed"], 0),
                              (v["greedy"][:ns], params.greedy_i64, 1)],
                             [(f[i * big:i * big + ns], values[name], 1.0) for i, name in enumerate(_FLOAT_FIELDS)],
                             params.sample_start, mixed)
        return slot_of

    # ---- the step (device side; captured) --------------------------------------------------
    def _inputs(self, bs: int, p: int) -> StepInputs:
        """Unpack the staged buffers into `run_step`'s inputs for bucket `bs` (and `p`)."""
        n, nr, ns = self._shape(bs, p)
        nd = bs * self.d
        i64 = {name: self._view(self.dev_i64, name) for name, _ in self.fields}
        self.qsl[:nr + 1].copy_(i64["qsl"][:nr + 1])
        self.seq_lens[:nr].copy_(i64["seq_lens"][:nr])
        self.pages[:nr].copy_(i64["pages"][:nr * self.width].view(nr, self.width))
        big = self.max_sample
        f = {name: self.dev_f32[i * big:i * big + ns] for i, name in enumerate(_FLOAT_FIELDS)}
        positions = i64["positions"][:n]
        sample_rows = i64["srows"][:ns] if p else None
        sample_positions = positions if sample_rows is None else positions.index_select(0, sample_rows)
        sampling = SamplingTensors(greedy=i64["greedy"][:ns].bool(), temperature=f["temperature"],
                                   top_k=i64["top_k"][:ns], top_p=f["top_p"], min_p=f["min_p"],
                                   seed=i64["seed"][:ns], position=sample_positions + 1)
        meta = AttentionMetadata(slot_mapping=i64["slots"][:n], query_start_loc=self.qsl[:nr + 1],
                                 seq_lens=self.seq_lens[:nr], page_tables=self.pages[:nr], causal=True,
                                 max_query_len=max(self.b, p))
        draft = None
        if self.d:
            self.d_seq_lens[:bs].copy_(i64["d_seq_lens"][:bs])
            # (the draft's page tables: the first bs requests'; a padding slot's reads nothing, seq_len 0)
            draft = DraftInputs(
                input_ids=i64["d_ids"][:nd], positions=i64["d_positions"][:nd],
                meta=AttentionMetadata(slot_mapping=i64["d_slots"][:nd], query_start_loc=self.d_qsl[:bs + 1],
                                       seq_lens=self.d_seq_lens[:bs], page_tables=self.pages[:bs], causal=False,
                                       max_query_len=self.d),
                proposal_rows=self.proposal_rows[:bs * (self.b - 1)],
                verify_rows=i64["vrows"][:bs * (self.b - 1)] if p else self.verify_rows[:bs * (self.b - 1)])
        state_meta = None
        if self.hybrid:
            state_meta = StateMetadata(read=i64["s_read"][:bs], write=i64["s_write"][:n], all_per_token=True)
        return StepInputs(input_ids=i64["input_ids"][:n], positions=positions, meta=meta, sample_rows=sample_rows,
                          sampling=sampling, num_decode=bs, block_rows=self.b, draft=draft, state_meta=state_meta)

    def step(self, bs: int, all_greedy: bool, p: int = 0) -> None:
        """`run_step` on the staged inputs of bucket `bs` (and P = `p`), results into `out`:
        the sampled token of each sample slot, then the accepted drafts of each decoding slot."""
        ns = self._shape(bs, p)[2]
        accepted, sampled = run_step(self.models, self._inputs(bs, p), all_greedy)
        self.out[:ns].copy_(sampled)
        if accepted is not None:
            self.out[ns:ns + bs].copy_(accepted)

    # ---- capture and replay ----------------------------------------------------------------
    def capture(self, modes: tuple[bool, ...] = (True,)) -> None:
        """Capture the decode step, and the mixed step of every prefill-token bucket, for
        every startup bucket (largest first, sharing one memory pool): a capture in the middle
        of serving stalls its step (run 36: the first pass of a 164-prompt HumanEval run at
        c = 32 ran at half the speed of the next while capturing). Sampled variants are
        captured on first use."""
        if self.enforce_eager:
            return
        self.reset_inputs()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        for all_greedy in modes:
            for bs in reversed(self.capture_buckets):
                for p in [0] + list(reversed(self.token_buckets)):
                    self._capture_one(bs, p, all_greedy)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        torch.cuda.empty_cache()  # the warm-ups' cached blocks: not graph memory; the pool stays
        self.graph_bytes += max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("captured %d step graphs (B = %d, D = %d, buckets %s, %d of them mixed: prefill buckets %s) in "
                    "%.1f s, %.0f MiB", len(self.graphs), self.b, self.d, self.capture_buckets, self.mixed_graphs,
                    self.token_buckets, self.capture_seconds, self.graph_bytes / 2**20)

    @torch.inference_mode()
    def run_few_row_shapes(self, max_rows: int) -> None:
        """One eager step of each startup graph's shape whose target or draft rows are at most
        `max_rows` (GEMM tuning records the GEMMs they call), every request a padding one."""
        self.reset_inputs()
        with self._on_warmup_stream():
            for bs in self.capture_buckets:
                for p in [0] + self.token_buckets:
                    if bs * self.b + p <= max_rows or (not p and 0 < bs * self.d <= max_rows):
                        self.step(bs, True, p)

    @contextlib.contextmanager
    def _on_warmup_stream(self):
        """Eager work before a capture, on the one warm-up stream of every capture (each new
        stream would get its own cuBLAS workspace and its own cached blocks); on CPU, inline."""
        if self.device.type != "cuda":
            yield
            return
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(self.device)
        self._warmup_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._warmup_stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self._warmup_stream)

    def reset_inputs(self) -> None:
        """Every request a padding request (writes nothing anywhere): capture and profiling."""
        self.host_i64.numpy()[:] = 0
        for name in ("slots", "d_slots", "s_read", "s_write"):
            self._view(self.host_i64, name).numpy()[:] = -1
        for name in ("greedy", "top_k"):
            self._view(self.host_i64, name).numpy()[:] = 1
        self.host_f32.numpy()[:] = 1.0
        self._pages_used = (0, 0)
        self._staged_sampling = None
        self.dev_i64.copy_(self.host_i64)
        self.dev_f32.copy_(self.host_f32)

    @torch.inference_mode()
    def _capture_one(self, bs: int, p: int, all_greedy: bool) -> None:
        from ..kernels import capture_scope, pdl  # (CUDA only: captures never run on CPU)

        # (launch choices for small batches read the bucket: kernels/capture_scope.py)
        with capture_scope.for_bucket(bs, bs * self.b, mixed=bool(p)):
            with self._on_warmup_stream():
                for _ in range(1 if p else 2):  # warm up: Triton compiles, cuBLAS picks its kernels (the
                    self.step(bs, all_greedy, p)  # mixed shapes after the decode ones: compiled already)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool,
                                  capture_error_mode="thread_local" if self.collectives else "global"):
                self.step(bs, all_greedy, p)
            if pdl.active():
                self.pdl_graphs.add((bs, p, all_greedy))
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[(bs, p, all_greedy)] = g

    def run(self, plan, st: SamplingBatch, all_greedy: bool, p: int = 0) -> InFlight:
        """Launch a pure-decode plan (`p` = 0) or a mixed one (`p`: its `mixed_bucket`); the
        InFlight's `wait` gives (accepted per plan entry, sampled per plan sample row). The
        caller waits before the next `run` (which restages the pinned buffers and reuses
        `host_out`)."""
        r, rd = len(plan), plan.num_decode
        bs = self.bucket(rd)
        ns = self._shape(bs, p)[2]
        key = (bs, p, all_greedy)
        if not self.enforce_eager and key not in self.graphs:
            # First step of this shape (greedy decode graphs exist from startup): capture now.
            t0 = time.perf_counter()
            self.reset_inputs()
            if not p:
                self._capture_one(bs, p, all_greedy)
            else:
                try:
                    self._capture_one(bs, p, all_greedy)
                except Exception as e:  # noqa: BLE001  (an optimisation: the step still runs eagerly)
                    logger.warning("capturing the mixed step %s failed (%s: %s); mixed steps run eagerly from now on",
                                   key, type(e).__name__, e)
                    self.token_buckets, self.mixed_tokens = [], 0
                    raise MixedCaptureFailed(str(key)) from e
            logger.debug("captured the step graph %s (B = %d) in %.2f s", key, self.b, time.perf_counter() - t0)
        slot_of = self._stage(plan, st, bs, p)
        self.steps["mixed" if p else "decode"] += 1
        # the step's first launch follows (the two input copies); a mixed step's time is not a cell's
        self.timer.begin(None if p else (bs, self.b - 1))
        # (the buffer up to the bucket's page-table rows: the tables of the largest bucket are
        # most of it, ~290 KB for the default SmolLM2 engine, read by no smaller bucket)
        end = self.offsets["pages"][0] + self._shape(bs, p)[1] * self.width
        self.dev_i64[:end].copy_(self.host_i64[:end], non_blocking=True)
        self.dev_f32.copy_(self.host_f32, non_blocking=True)
        if self.enforce_eager:
            with torch.inference_mode():
                self.step(bs, all_greedy, p)
        else:  # (no autograd mode to enter: a replay and copies of buffers that need no grad)
            self.graphs[key].replay()
        self.host_out[:ns + bs].copy_(self.out[:ns + bs], non_blocking=True)
        self.timer.end()  # after the last launch (the copy back), before the wait for it
        spec = self.d > 0

        def unpack() -> tuple[np.ndarray, np.ndarray]:
            out = self._np_out
            accepted = np.zeros(r, np.int64)
            if spec:
                accepted[:rd] = out[ns:ns + rd]
            sampled = out[:r * self.b].copy() if slot_of is None else out[slot_of]
            return accepted, sampled

        return InFlight(unpack, self.device)
