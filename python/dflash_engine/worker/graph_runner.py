"""The pure-decode step on the GPU: `step.run_step` over static padded buffers, one CUDA
graph per batch-size bucket, replayed.

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

A hybrid target's step also stages its state slots (`state_read` per request, `state_write`
per row; padding: -1, nothing read or kept) and marks the step all-per-token
(StateMetadata.all_per_token), so that its GDN layers run the recurrent kernels without
reading anything back to the host.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..models.hybrid_state import StateMetadata
from ..ops.attention import AttentionMetadata
from ..ops.sampling import SamplingTensors
from .in_flight import InFlight
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
                 device: torch.device, hybrid: bool = False, collectives: bool = False):
        """draft_rows: D of this B's draft pass (0: none); capture_buckets: those captured at
        startup (others on first use); hybrid: the target keeps recurrent state in slots;
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
        n, nd, bs = self.max_bs * self.b, self.max_bs * self.d, self.max_bs
        self.fields = [("input_ids", n), ("positions", n), ("slots", n), ("qsl", bs + 1), ("seq_lens", bs),
                       ("pages", bs * self.width), ("top_k", n), ("seed", n), ("greedy", n),
                       ("d_ids", nd), ("d_positions", nd), ("d_slots", nd), ("d_seq_lens", bs if self.d else 0),
                       ("s_read", bs if hybrid else 0), ("s_write", n if hybrid else 0)]
        self.offsets, at = {}, 0
        for name, size in self.fields:
            self.offsets[name] = (at, size)
            at += size
        self.host_i64 = torch.zeros(at, dtype=torch.int64, pin_memory=on_gpu)
        self.host_f32 = torch.zeros(3 * n, dtype=torch.float32, pin_memory=on_gpu)
        self.dev_i64 = torch.zeros(at, dtype=torch.int64, device=device)
        self.dev_f32 = torch.zeros(3 * n, dtype=torch.float32, device=device)
        # Typed static inputs, filled from the packed buffers inside the step.
        self.qsl = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(bs, dtype=torch.int32, device=device)
        self.pages = torch.zeros(bs, self.width, dtype=torch.int32, device=device)
        self.d_seq_lens = torch.zeros(bs, dtype=torch.int32, device=device)
        # The draft blocks' offsets and rows are fixed by the shape: i*D, and rows 1..B-1.
        steps = torch.arange(bs + 1, device=device)
        self.d_qsl = (steps * self.d).to(torch.int32)
        self.proposal_rows = (steps[:bs, None] * self.d + torch.arange(1, self.b, device=device)).reshape(-1)
        self.verify_rows = (steps[:bs, None] * self.b + torch.arange(1, self.b, device=device)).reshape(-1)
        self.out = torch.zeros(n + bs, dtype=torch.int64, device=device)
        self.host_out = torch.zeros(n + bs, dtype=torch.int64, pin_memory=on_gpu)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = None  # a graph memory pool, shared by every runner of the model runner
        self._warmup_stream = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0

    # ---- host side --------------------------------------------------------------------
    def bucket(self, num_reqs: int) -> int:
        return bucket_of(self.buckets, num_reqs)

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        at, size = self.offsets[name]
        return buf[at:at + size]

    def _stage(self, plan, st: dict[str, np.ndarray], bs: int) -> None:
        """Pack the plan (padded to `bs` requests) into the pinned buffers."""
        r, n = len(plan), bs * self.b
        rows, drows, dn = r * self.b, r * self.d, bs * self.d
        v = {name: self._view(self.host_i64, name).numpy() for name, _ in self.fields}

        def put(name: str, real: np.ndarray, used: int, total: int, pad: int) -> None:
            v[name][:used] = real
            v[name][used:total] = pad

        put("input_ids", plan.input_ids, rows, n, 0)
        put("positions", plan.positions, rows, n, 0)
        put("slots", plan.slot_mapping, rows, n, -1)
        put("qsl", plan.query_start_loc, r + 1, bs + 1, rows)
        put("seq_lens", plan.seq_lens, r, bs, 0)
        pages = v["pages"][:bs * self.width].reshape(bs, self.width)
        pages[:] = 0
        pages[:r, :plan.page_tables.shape[1]] = plan.page_tables
        put("top_k", st["top_k"], rows, n, 1)
        put("seed", st["seed"], rows, n, 0)
        put("greedy", st["greedy"], rows, n, 1)
        if self.d:
            put("d_ids", plan.draft_input_ids, drows, dn, 0)
            put("d_positions", plan.draft_positions, drows, dn, 0)
            put("d_slots", plan.draft_slot_mapping, drows, dn, -1)
            put("d_seq_lens", plan.draft_seq_lens, r, bs, 0)
        if self.hybrid:
            put("s_read", plan.state_read, r, bs, -1)
            put("s_write", plan.state_write, rows, n, -1)
        f = self.host_f32.numpy()
        big = self.max_bs * self.b
        for i, name in enumerate(_FLOAT_FIELDS):
            f[i * big:i * big + rows] = st[name]
            f[i * big + rows:i * big + n] = 1.0

    # ---- the step (device side; captured) --------------------------------------------------
    def _inputs(self, bs: int) -> StepInputs:
        """Unpack the staged buffers into `run_step`'s inputs for `bs` requests."""
        n, nd = bs * self.b, bs * self.d
        i64 = {name: self._view(self.dev_i64, name) for name, _ in self.fields}
        self.qsl[:bs + 1].copy_(i64["qsl"][:bs + 1])
        self.seq_lens[:bs].copy_(i64["seq_lens"][:bs])
        self.pages[:bs].copy_(i64["pages"][:bs * self.width].view(bs, self.width))
        big = self.max_bs * self.b
        f = {name: self.dev_f32[i * big:i * big + n] for i, name in enumerate(_FLOAT_FIELDS)}
        positions = i64["positions"][:n]
        sampling = SamplingTensors(greedy=i64["greedy"][:n].bool(), temperature=f["temperature"],
                                   top_k=i64["top_k"][:n], top_p=f["top_p"], min_p=f["min_p"],
                                   seed=i64["seed"][:n], position=positions + 1)
        meta = AttentionMetadata(slot_mapping=i64["slots"][:n], query_start_loc=self.qsl[:bs + 1],
                                 seq_lens=self.seq_lens[:bs], page_tables=self.pages[:bs], causal=True,
                                 max_query_len=self.b)
        draft = None
        if self.d:
            self.d_seq_lens[:bs].copy_(i64["d_seq_lens"][:bs])
            draft = DraftInputs(
                input_ids=i64["d_ids"][:nd], positions=i64["d_positions"][:nd],
                meta=AttentionMetadata(slot_mapping=i64["d_slots"][:nd], query_start_loc=self.d_qsl[:bs + 1],
                                       seq_lens=self.d_seq_lens[:bs], page_tables=self.pages[:bs], causal=False,
                                       max_query_len=self.d),
                proposal_rows=self.proposal_rows[:bs * (self.b - 1)],
                verify_rows=self.verify_rows[:bs * (self.b - 1)])
        state_meta = None
        if self.hybrid:
            state_meta = StateMetadata(read=i64["s_read"][:bs], write=i64["s_write"][:n], all_per_token=True)
        return StepInputs(input_ids=i64["input_ids"][:n], positions=positions, meta=meta, sample_rows=None,
                          sampling=sampling, num_decode=bs, block_rows=self.b, draft=draft, state_meta=state_meta)

    def step(self, bs: int, all_greedy: bool) -> None:
        """`run_step` on the staged inputs of `bs` requests, results into `out`."""
        n = bs * self.b
        accepted, sampled = run_step(self.models, self._inputs(bs), all_greedy)
        self.out[:n].copy_(sampled)
        if accepted is not None:
            self.out[n:n + bs].copy_(accepted)

    # ---- capture and replay ----------------------------------------------------------------
    def capture(self, modes: tuple[bool, ...] = (True,)) -> None:
        """Capture the step for every startup bucket (largest first, sharing one memory pool)."""
        if self.enforce_eager:
            return
        self.reset_inputs()
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        t0 = time.perf_counter()
        for all_greedy in modes:
            for bs in reversed(self.capture_buckets):
                self._capture_one(bs, all_greedy)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        torch.cuda.empty_cache()  # the warm-ups' cached blocks: not graph memory; the pool stays
        self.graph_bytes += max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        logger.info("captured %d decode graphs (B = %d, D = %d, buckets %s) in %.1f s, %.0f MiB", len(self.graphs),
                    self.b, self.d, self.capture_buckets, self.capture_seconds, self.graph_bytes / 2**20)

    def reset_inputs(self) -> None:
        """Every request a padding request (writes nothing anywhere): capture and profiling."""
        self.host_i64.numpy()[:] = 0
        for name in ("slots", "d_slots", "s_read", "s_write"):
            self._view(self.host_i64, name).numpy()[:] = -1
        for name in ("greedy", "top_k"):
            self._view(self.host_i64, name).numpy()[:] = 1
        self.host_f32.numpy()[:] = 1.0
        self.dev_i64.copy_(self.host_i64)
        self.dev_f32.copy_(self.host_f32)

    @torch.inference_mode()
    def _capture_one(self, bs: int, all_greedy: bool) -> None:
        # One warm-up stream for every capture: each new stream would get its own cuBLAS
        # workspace and its own cached blocks.
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(self.device)
        stream = self._warmup_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self.step(bs, all_greedy)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local" if self.collectives else "global"):
            self.step(bs, all_greedy)
        if self.pool is None:
            self.pool = g.pool()
        self.graphs[(bs, all_greedy)] = g

    @torch.inference_mode()
    def run(self, plan, st: dict[str, np.ndarray], all_greedy: bool) -> InFlight:
        """Launch a pure-decode plan; the InFlight's `wait` gives (accepted per request,
        sampled per row). The caller waits before the next `run` (which restages the
        pinned buffers and reuses `host_out`)."""
        r = len(plan)
        bs = self.bucket(r)
        n = bs * self.b
        key = (bs, all_greedy)
        if not self.enforce_eager and key not in self.graphs:
            # First sampled step at this size: capture now (greedy graphs exist from startup).
            self.reset_inputs()
            self._capture_one(bs, all_greedy)
        self._stage(plan, st, bs)
        self.timer.begin((bs, self.b - 1))  # the step's first launch follows: the two input copies
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_f32.copy_(self.host_f32, non_blocking=True)
        if self.enforce_eager:
            self.step(bs, all_greedy)
        else:
            self.graphs[key].replay()
        self.host_out[:n + bs].copy_(self.out[:n + bs], non_blocking=True)
        self.timer.end()  # after the last launch (the copy back), before the wait for it
        spec = self.d > 0

        def unpack() -> tuple[np.ndarray, np.ndarray]:
            out = self.host_out.numpy()
            sampled = out[:r * self.b].copy()
            accepted = out[n:n + r].copy() if spec else np.zeros(r, np.int64)
            return accepted, sampled

        return InFlight(unpack, self.device)
