"""The pure-decode step on the GPU: one fixed-shape function per batch-size bucket, captured
as one CUDA graph and replayed (GPU.md, "One step, one graph").

A decode step has B rows per request (B = 1 with speculation off), so its shape is fixed by
the number of requests. Requests are padded up to the next bucket (1, 2, 4, 8, 16, 24, 32,
... up to max_num_seqs). Inside the step, all on persistent device buffers:

    draft pass (non-causal, B rows per request) -> draft logits -> argmax -> drafts
    verify pass (causal, [bonus, drafts])       -> draft-context write for all B rows
    logits -> sampling (keyed by seed, position) -> acceptance (compare, cumulative product)

Host side per step: the plan's arrays are packed into one pinned int64 buffer and one pinned
float32 buffer, copied to the device in two async copies; the graph unpacks them. The
results (sampled tokens, then accepted counts) come back in one non-blocking device-to-host
copy, waited for later (in_flight.py): the host works on the previous step meanwhile.

Padding requests have q_len 0, seq_len 0, page table of null pages and slot -1: attention
gives them nothing, the KV store skips them, and their rows' garbage never reaches a real
row (every op here is row-wise or per request). Eager mode (`enforce_eager`) runs the same
function on the same padded shapes, so graphs and eager give the same tokens.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import _core
from .draft_block import draft_block
from .in_flight import InFlight
from .kernels import sampling as ksampling
from .ops.attention import AttentionMetadata
from .sampler import synthetic_accept

logger = logging.getLogger(__name__)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, 40, ... capped by (and including) max_num_seqs."""
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b = b * 2 if b < 16 else b + 8
    out.append(max_num_seqs)
    return sorted(set(out))


# Packed layout of the int64 staging buffer, per field: (name, rows per request or "req+1").
@dataclass
class _Layout:
    max_bs: int
    b: int
    width: int  # page-table columns

    def fields(self) -> list[tuple[str, int]]:
        n = self.max_bs * self.b
        return [("input_ids", n), ("positions", n), ("slots", n), ("qsl", self.max_bs + 1),
                ("seq_lens", self.max_bs), ("pages", self.max_bs * self.width),
                ("top_k", n), ("seed", n), ("greedy", n)]

    def offsets(self) -> dict[str, tuple[int, int]]:
        out, at = {}, 0
        for name, size in self.fields():
            out[name] = (at, size)
            at += size
        return out


_FLOAT_FIELDS = ("temperature", "top_p", "min_p")


class DecodeGraphRunner:
    """Owns the static buffers and the captured graphs of the decode step."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, enforce_eager: bool,
                 num_speculative_tokens: int | None = None, capture_buckets: list[int] | None = None,
                 pool=None):
        """num_speculative_tokens: this runner's draft length (default: the runner's; shorter
        ones serve the draft-length schedule, one runner per length); capture_buckets: the
        buckets captured at startup (default: all; others are captured on first use); pool:
        a graph memory pool to share with other runners."""
        self.r = runner
        self.device = runner.device
        k = runner.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        self.b = k + 1
        self.buckets = batch_buckets(max_num_seqs)
        self.capture_buckets = self.buckets if capture_buckets is None else sorted(capture_buckets)
        self.max_bs = self.buckets[-1]
        self.width = _core.pages_per_seq(max_model_len, runner.reserve_k, runner.page_size)
        # D: the draft block's rows (draft_block.py), built on the device from the verify block.
        self.d = max(self.b, runner.draft_rows) if runner.draft is not None else self.b
        on_gpu = self.device.type == "cuda"
        self.enforce_eager = enforce_eager or not on_gpu  # (CPU: the interpreter test mode)
        self.layout = _Layout(self.max_bs, self.b, self.width)
        self.offsets = self.layout.offsets()
        total = sum(size for _, size in self.layout.fields())
        n = self.max_bs * self.b
        dev = self.device
        self.host_i64 = torch.zeros(total, dtype=torch.int64, pin_memory=on_gpu)
        self.host_f32 = torch.zeros(3 * n, dtype=torch.float32, pin_memory=on_gpu)
        self.dev_i64 = torch.zeros(total, dtype=torch.int64, device=dev)
        self.dev_f32 = torch.zeros(3 * n, dtype=torch.float32, device=dev)
        # Typed static inputs, filled from the packed buffers inside the step.
        self.qsl = torch.zeros(self.max_bs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(self.max_bs, dtype=torch.int32, device=dev)
        self.pages = torch.zeros(self.max_bs, self.width, dtype=torch.int32, device=dev)
        # Rows 1..B-1 of each block: where drafts go, and the draft rows whose logits are read.
        rows = torch.arange(n, device=dev).view(self.max_bs, self.b)[:, 1:]
        self.verify_rows = rows.reshape(-1).contiguous()
        self.out = torch.zeros(n + self.max_bs, dtype=torch.int64, device=dev)
        self.host_out = torch.zeros(n + self.max_bs, dtype=torch.int64, pin_memory=on_gpu)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self._warmup_stream = None
        self.capture_seconds = 0.0
        self.graph_bytes = 0

    # ---- host side --------------------------------------------------------------------
    def bucket(self, num_reqs: int) -> int:
        for bs in self.buckets:
            if bs >= num_reqs:
                return bs
        raise ValueError(f"{num_reqs} decoding requests exceed max_num_seqs ({self.max_bs})")

    def _view(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        at, size = self.offsets[name]
        return buf[at:at + size]

    def _stage(self, plan, st: dict[str, np.ndarray], bs: int) -> None:
        """Pack the plan (padded to `bs` requests) into the pinned buffers."""
        r, b, n = len(plan), self.b, bs * self.b
        v = {name: self._view(self.host_i64, name).numpy() for name, _ in self.layout.fields()}
        rows = r * b
        v["input_ids"][:rows] = plan.input_ids
        v["input_ids"][rows:n] = 0
        v["positions"][:rows] = plan.positions
        v["positions"][rows:n] = 0
        v["slots"][:rows] = plan.slot_mapping
        v["slots"][rows:n] = -1
        v["qsl"][:r + 1] = plan.query_start_loc
        v["qsl"][r + 1:bs + 1] = rows
        v["seq_lens"][:r] = plan.seq_lens
        v["seq_lens"][r:bs] = 0
        pages = v["pages"][:bs * self.width].reshape(bs, self.width)
        pages[:] = 0
        pt = plan.page_tables
        pages[:r, :pt.shape[1]] = pt
        v["top_k"][:rows] = st["top_k"]
        v["top_k"][rows:n] = 1
        v["seed"][:rows] = st["seed"]
        v["seed"][rows:n] = 0
        v["greedy"][:rows] = st["greedy"]
        v["greedy"][rows:n] = 1
        f = self.host_f32.numpy()
        big = self.max_bs * self.b
        for i, name in enumerate(_FLOAT_FIELDS):
            f[i * big:i * big + rows] = st[name]
            f[i * big + rows:i * big + n] = 1.0

    # ---- the step (device side; captured) --------------------------------------------------
    def _inputs(self, bs: int) -> dict[str, torch.Tensor]:
        """Unpack the staged buffers into typed views / static buffers for `bs` requests."""
        n = bs * self.b
        i64 = {name: self._view(self.dev_i64, name) for name, _ in self.layout.fields()}
        big = self.max_bs * self.b
        self.qsl[:bs + 1].copy_(i64["qsl"][:bs + 1])
        self.seq_lens[:bs].copy_(i64["seq_lens"][:bs])
        self.pages[:bs].copy_(i64["pages"][:bs * self.width].view(bs, self.width))
        x = {name: i64[name][:n] for name in ("input_ids", "positions", "slots", "top_k", "seed", "greedy")}
        x.update({name: self.dev_f32[i * big:i * big + n] for i, name in enumerate(_FLOAT_FIELDS)})
        return x

    def _meta(self, bs: int, slots: torch.Tensor, causal: bool) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=slots, query_start_loc=self.qsl[:bs + 1], seq_lens=self.seq_lens[:bs],
                                 page_tables=self.pages[:bs], causal=causal, max_query_len=self.b)

    def _draft(self, bs: int, x: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft pass: [bonus, MASK...] blocks -> drafts [bs*(B-1)]; returns (verify ids, drafts)."""
        r, b = self.r, self.b
        vrows = self.verify_rows[:bs * (b - 1)]
        if self.d == b:  # the verify block itself
            ids, pos, meta, rows = x["input_ids"], x["positions"], self._meta(bs, x["slots"], False), vrows
        else:  # the draft's whole D-row block (draft_block.py); padding requests write nowhere
            blk = draft_block(x["positions"].view(bs, b)[:, 0], x["input_ids"].view(bs, b)[:, 0], self.pages[:bs],
                              self.d, b, r.page_size, r.mask_token_id, live=self.seq_lens[:bs] > 0)
            ids, pos, rows = blk.input_ids, blk.positions, blk.proposal_rows
            meta = AttentionMetadata(slot_mapping=blk.slot_mapping, query_start_loc=blk.query_start_loc,
                                     seq_lens=blk.seq_lens, page_tables=self.pages[:bs], causal=False,
                                     max_query_len=self.d)
        h = r.draft(r.target.embed(ids), pos, meta, r.kv)
        drafts = r.target.compute_logits(h[rows]).argmax(-1)
        return x["input_ids"].index_put((vrows,), drafts), drafts

    def _verify(self, bs: int, x: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        """Target pass over the blocks, and the draft-context write for all rows -> logits."""
        r = self.r
        hidden, taps = r.target(ids, x["positions"], self._meta(bs, x["slots"], True), r.kv, r.tap_layers)
        if r.draft is not None:
            r.draft.write_context(taps, x["positions"], x["slots"], r.kv)
        return r.target.compute_logits(hidden)

    def _step(self, bs: int, all_greedy: bool) -> None:
        n = bs * self.b
        x = self._inputs(bs)
        ids, drafts = self._draft(bs, x) if self.r.draft is not None else (x["input_ids"], None)
        logits = self._verify(bs, x, ids)
        sampled = self.out[:n]
        ksampling.sample(
            logits, x["greedy"].bool(), x["temperature"], x["top_k"], x["top_p"], x["min_p"],
            x["seed"], x["positions"] + 1, all_greedy=all_greedy, out=sampled,
        )
        if drafts is None:
            return
        drafts, blocks = drafts.view(bs, self.b - 1), sampled.view(bs, self.b)
        if self.r.synthetic_rates is None:
            ksampling.accept(drafts, blocks, out=self.out[n:n + bs])
        else:  # benchmark-only: accepted counts from a seeded RNG, accepted drafts committed
            first = slice(0, n, self.b)  # each request's bonus row
            acc, toks = synthetic_accept(drafts, blocks, x["seed"][first], x["positions"][first],
                                         self.r.synthetic_rates)
            self.out[n:n + bs].copy_(acc)
            blocks.copy_(toks)

    # ---- capture and replay ----------------------------------------------------------------
    def capture(self, modes: tuple[bool, ...] = (True,)) -> None:
        """Capture the step for every bucket (largest first, sharing one memory pool)."""
        if self.enforce_eager:
            return
        self._reset_inputs()
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
        logger.info("captured %d decode graphs (B = %d, buckets %s) in %.1f s, %.0f MiB", len(self.graphs),
                    self.b, self.capture_buckets, self.capture_seconds, self.graph_bytes / 2**20)

    def _reset_inputs(self) -> None:
        # Capture-time inputs: every request a padding request (writes nothing anywhere).
        h = self.host_i64.numpy()
        h[:] = 0
        self._view(self.host_i64, "slots").numpy()[:] = -1
        self._view(self.host_i64, "greedy").numpy()[:] = 1
        self._view(self.host_i64, "top_k").numpy()[:] = 1
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
                self._step(bs, all_greedy)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self._step(bs, all_greedy)
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
            self._reset_inputs()
            self._capture_one(bs, all_greedy)
        self._stage(plan, st, bs)
        timer = self.r.step_timer
        timer.begin()  # the step's first launch follows: the two input copies
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_f32.copy_(self.host_f32, non_blocking=True)
        if self.enforce_eager:
            self._step(bs, all_greedy)
        else:
            self.graphs[key].replay()
        self.host_out[:n + bs].copy_(self.out[:n + bs], non_blocking=True)
        timer.end()  # after the last launch (the copy back), before the wait for it
        spec = self.r.draft is not None

        def unpack() -> tuple[np.ndarray, np.ndarray]:
            out = self.host_out.numpy()
            sampled = out[:r * self.b].copy()
            accepted = out[n:n + r].copy() if spec else np.zeros(r, np.int64)
            return accepted, sampled

        return InFlight(unpack, self.device)
