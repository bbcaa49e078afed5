"""Runs one step plan: draft pass, target verify/prefill pass, sampling, acceptance, and
the draft-context write (DFLASH.md, "One speculative step").

Everything positional (rows, slots, pages, positions) comes from the Rust plan. The step
crosses to the core once each way: the plan in, (accepted, sampled) out. The draft context
is written for every target row, before acceptance is known: rows past the accepted
prefix land at positions >= the new committed length, which the next draft block
overwrites (as scratch) before any draft pass reads them (GPU.md, "One step, one graph").
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from . import _core
from .config import EngineConfig, synthetic_rates
from .kv_cache import KVCache, MemoryReport, cpu_pool_pages, size_pool
from .model_path import is_gguf_model
from .models import load_draft, load_target
from .models.cpu_weights import pack_cpu_weights, pack_proposal_logits, resolve_cpu_weights, row_argmax
from .ops.attention import AttentionMetadata
from .decode_graph import DecodeGraphRunner
from .draft_block import draft_block
from .in_flight import InFlight
from .ops.dispatch import use_kernels
from .sampler import SamplingTensors, accept, sample, synthetic_accept
from .step_timer import StepTimer

logger = logging.getLogger(__name__)

_CPU_KV_BYTES_DEFAULT = 1 << 30
# The fast CPU mode's default number of verified drafts. A CPU verify pass costs about
# linearly in its rows, so verifying 3 of the full draft block's 15 proposals pays best: the
# shipped draft, HumanEval, 2 cores: 1.53x spec-off at K = 3, 1.06x at 5, 1.20x at 7, 0.99x at
# 15 (docs/perf.md, "Shorter draft blocks"). The exact mode's GEMMs run 16-row blocks
# whatever K is, so it verifies the draft's full block.
CPU_NUM_SPECULATIVE_TOKENS = 3
# Budgeted for CUDA graphs on top of the measured decode step (module loads, workspaces).
_GRAPH_SLACK_BYTES = 256 << 20


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return dev


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_path: Path, max_model_len: int):
        self.device = resolve_device(cfg.device)
        self.target = load_target(model_path, cfg.dtype, self.device, batch_invariant=cfg.batch_invariant)
        self.model_config = self.target.config
        self.dtype = self.target.model.embed_tokens.weight.dtype
        self.draft = None
        self.num_speculative_tokens = 0
        self.draft_rows = 0  # D: rows of the draft's block (draft_block.py); 0 without a draft
        self.draft_len_schedule: list[tuple[int, int]] = []  # (max decoding requests, k), ascending
        self.tap_layers: list[int] | None = None
        self.mask_token_id = 0
        spec = cfg.speculative_config
        if spec is not None:
            self.draft = load_draft(spec.model, self.model_config, cfg.dtype, self.device,
                                    batch_invariant=cfg.batch_invariant)
            dcfg = self.draft.config
            n = spec.num_speculative_tokens
            if n is None:  # the draft's block, or fewer in the fast CPU mode (CPU_NUM_SPECULATIVE_TOKENS)
                n = dcfg.block_size - 1
                if (self.device.type == "cpu" and not cfg.batch_invariant and not spec.num_speculative_tokens_schedule
                        and not spec.synthetic):
                    n = min(n, CPU_NUM_SPECULATIVE_TOKENS)
            if n >= dcfg.block_size:
                raise ValueError(
                    f"num_speculative_tokens ({n}) must be < the draft's block_size ({dcfg.block_size})"
                )
            self.num_speculative_tokens = n
            self.draft_len_schedule = list(spec.num_speculative_tokens_schedule or [])
            if any(k > n for _, k in self.draft_len_schedule):
                raise ValueError(f"num_speculative_tokens_schedule {self.draft_len_schedule}: every k must be "
                                 f"<= num_speculative_tokens ({n})")
            # Every decode step drafts the draft's whole block (draft_block.py), verifies K.
            self.draft_rows = dcfg.block_size
            self.tap_layers = list(dcfg.target_layer_ids)
            self.mask_token_id = dcfg.mask_token_id
        # The fast CPU mode's packed GEMM weights (models/cpu_weights.py).
        self.cpu_weights = resolve_cpu_weights(cfg.cpu_weights, self.device, bool(cfg.batch_invariant), cfg.dtype,
                                               self.dtype, is_gguf_model(cfg.model))
        if self.cpu_weights != "none":
            # int4: the draft's GEMMs and its proposals' logits GEMM run int4 too, its weights
            # rounded to the grid (lossy: a proposal is a guess the target verifies, so this moves
            # the acceptance rate, never the output; docs/perf.md, "CPU spec step").
            rounded = self.cpu_weights == "int4"
            for name, model in (("target", self.target), ("draft", self.draft)):
                if model is not None:
                    logger.info("CPU weights (%s) of the %s: %s", self.cpu_weights, name,
                                pack_cpu_weights(model, self.cpu_weights, rounded=rounded and name == "draft"))
            if self.draft is not None and rounded:
                logger.info("CPU proposal logits weight: %s", pack_proposal_logits(self.target))
        # Benchmark-only synthetic acceptance (never on by default; labelled wherever it shows).
        self.synthetic_rates: torch.Tensor | None = None
        if spec is not None and spec.synthetic:
            rates = synthetic_rates(self.num_speculative_tokens, spec.synthetic_acceptance_length,
                                    spec.synthetic_acceptance_rates)
            self.synthetic_rates = torch.tensor(rates, dtype=torch.float64, device=self.device)
            expected = sum(float(np.prod(rates[:i])) for i in range(len(rates) + 1))
            logger.warning("SYNTHETIC acceptance (benchmark only): per-position rates %s, expected "
                           "acceptance length %.2f; outputs are NOT the target's", [round(r, 4) for r in rates],
                           expected)
        self.page_size = cfg.block_size  # vLLM's --block-size: tokens per KV page
        self.bytes_per_page = KVCache.bytes_per_page(
            self.model_config, self.draft.config if self.draft else None, self.page_size, self.dtype
        )
        b = self.num_speculative_tokens + 1
        # The scheduler's token budget per step (its default lives here: the profile step needs it).
        self.max_num_batched_tokens = cfg.max_num_batched_tokens or max(2048, b * cfg.max_num_seqs)
        self.step_timer = StepTimer(self.device)
        # The GPU's pure-decode step: fixed shapes per batch bucket, one CUDA graph each.
        # With a draft-length schedule, one more runner per shorter block (graphs keyed by B).
        self.decode_graphs: DecodeGraphRunner | None = None
        self.graphs_by_b: dict[int, DecodeGraphRunner] = {}
        if use_kernels(self.target.model.embed_tokens.weight):
            self.decode_graphs = DecodeGraphRunner(self, cfg.max_num_seqs, max_model_len, cfg.enforce_eager,
                                                   capture_buckets=self._buckets_for(cfg.max_num_seqs, None))
            self.graphs_by_b[self.decode_graphs.b] = self.decode_graphs
            for k in sorted({k for _, k in self.draft_len_schedule} - {self.num_speculative_tokens}, reverse=True):
                self.graphs_by_b[k + 1] = DecodeGraphRunner(
                    self, cfg.max_num_seqs, max_model_len, cfg.enforce_eager, num_speculative_tokens=k,
                    capture_buckets=self._buckets_for(cfg.max_num_seqs, k))
        # Size the pool (profile step on CUDA), refuse one that cannot hold a full-length
        # request, allocate it, then capture the graphs (they bake in the pool's addresses).
        self.memory = self._size_pool(cfg, max_model_len)
        self.memory.check_holds_one_request()
        self.num_pages = self.memory.num_pages
        self.kv = KVCache.allocate(
            self.model_config, self.draft.config if self.draft else None,
            self.num_pages, self.page_size, self.dtype, self.device,
        )
        if self.device.type == "cuda" and use_kernels(self.kv.target[0][0]):
            try:
                self._warm_up_attention()
            except Exception:  # noqa: BLE001  (an optimisation: serving works without it)
                logger.exception("attention warm-up failed; kernels compile on first use instead")
        if self.decode_graphs is not None:
            for g in self.graphs_by_b.values():  # the longest block first; one memory pool
                g.pool = self.decode_graphs.pool
                g.capture()
            self.memory.graph_bytes = sum(g.graph_bytes for g in self.graphs_by_b.values())
            if self.memory.graph_bytes > self.memory.graph_reserve_bytes:
                logger.warning("CUDA graphs took %.0f MiB, more than the %.0f MiB reserved for them; if the GPU "
                               "runs out of memory, lower --gpu-memory-utilization", self.memory.graph_bytes / 2**20,
                               self.memory.graph_reserve_bytes / 2**20)
        for line in self.memory.lines():
            logger.info(line)
        self.step_timer = StepTimer(self.device)  # afresh: the profile step is no engine step

    # ---- memory ----------------------------------------------------------------------------
    def _warm_up_attention(self) -> None:
        """Compile the attention kernels' variants now rather than in a request's step (a
        prefix-cache hit's short query over a long context, say, first met mid-serving)."""
        import time

        from .kernels.attention import warmup

        t0, n = time.perf_counter(), 0
        shapes = {(c.num_attention_heads, c.num_key_value_heads, c.head_dim)
                  for c in [self.model_config] + ([self.draft.config] if self.draft else [])}
        for heads, kv_heads, head_dim in sorted(shapes):
            n += warmup(heads, kv_heads, head_dim, self.page_size, self.dtype, self.device)
        torch.cuda.synchronize(self.device)
        logger.info("attention kernels: %d variants ready in %.1f s", n, time.perf_counter() - t0)

    def _buckets_for(self, max_num_seqs: int, k: int | None) -> list[int]:
        """The batch buckets whose steps draft k tokens under the schedule (k None: the full
        length); all of them without a schedule. Others are captured on first use."""
        from .decode_graph import batch_buckets

        buckets = batch_buckets(max_num_seqs)
        if not self.draft_len_schedule:
            return buckets
        k = self.num_speculative_tokens if k is None else k
        k_of = lambda n: _core.draft_len_for(self.draft_len_schedule, self.num_speculative_tokens, n)  # noqa: E731
        return sorted({next(b for b in buckets if b >= n) for n in range(1, max_num_seqs + 1) if k_of(n) == k})

    def _size_pool(self, cfg: EngineConfig, max_model_len: int) -> MemoryReport:
        """Pages in the pool, null page included, and how they were decided.
        CUDA: profile the largest step, then vLLM's budget (`size_pool`). CPU: a byte budget.
        `num_gpu_blocks_override` wins over both (the profile still runs on CUDA: it also
        proves at startup that the largest step fits)."""
        report = MemoryReport(
            device=self.device.type, num_pages=0, page_size=self.page_size, bytes_per_page=self.bytes_per_page,
            max_model_len=max_model_len, reserve_k=self.reserve_k,
            max_num_seqs=cfg.max_num_seqs, source="",
        )
        if self.device.type == "cuda":
            # Memory cached by torch for engines already dropped in this process counts as free.
            gc.collect()
            torch.cuda.empty_cache()
            report.weights_bytes = torch.cuda.memory_allocated(self.device)
            step_peak, decode_peak = self.profile(cfg.max_num_seqs, max_model_len, report)
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            report.total_bytes, report.in_use_bytes = total, total - free
            report.utilization = cfg.gpu_memory_utilization
            report.peak_activation_bytes = max(step_peak, decode_peak or 0)
            graphs = self.decode_graphs is not None and not self.decode_graphs.enforce_eager
            # The graphs' private pool holds about one decode step at the largest bucket (the
            # buckets share it, largest captured first); plus slack for what capture loads
            # (cuBLAS workspaces, Triton modules). Checked against the real number after capture.
            report.graph_reserve_bytes = (decode_peak or 0) + _GRAPH_SLACK_BYTES if graphs else 0
            report.num_pages = size_pool(total, report.in_use_bytes, report.peak_activation_bytes,
                                         cfg.gpu_memory_utilization, self.bytes_per_page, report.graph_reserve_bytes)
            report.source = f"--gpu-memory-utilization {cfg.gpu_memory_utilization}"
        else:
            gb = float(os.environ.get("DFLASH_CPU_KV_CACHE_GB", "0") or 0)
            budget = int(gb * (1 << 30)) or _CPU_KV_BYTES_DEFAULT
            report.num_pages = cpu_pool_pages(budget, self.bytes_per_page, cfg.max_num_seqs, report.pages_per_seq)
            report.source = f"DFLASH_CPU_KV_CACHE_GB={gb:g}" if gb else "DFLASH_CPU_KV_CACHE_GB (default 1)"
            if report.num_pages < budget // self.bytes_per_page:
                report.source = f"--max-num-seqs {cfg.max_num_seqs} full-length requests (within {report.source})"
        if cfg.num_gpu_blocks_override is not None:
            report.num_pages = cfg.num_gpu_blocks_override + 1
            report.source = f"--num-gpu-blocks-override {cfg.num_gpu_blocks_override}"
        return report

    @torch.inference_mode()
    def profile(self, max_num_seqs: int, max_model_len: int, report: MemoryReport | None = None
                ) -> tuple[int | None, int | None]:
        """Run the largest steps the engine can schedule on a 2-page KV cache and return their
        peak memory growth on CUDA (None on CPU, where the step still runs): (the largest eager
        step, the pure-decode step at the largest batch bucket (None without decode graphs)).
        Reads and writes stay inside the temporary cache (`_profile_plan`; the decode step
        runs padding requests only); the real pool, if any, is left untouched."""
        plan, st = _profile_plan(self.max_num_batched_tokens, max_num_seqs, self.num_speculative_tokens + 1,
                                 self.reserve_k, max_model_len, self.page_size, self.model_config.vocab_size)
        if report is not None:
            report.profile_tokens, report.profile_sample_rows = len(plan.input_ids), len(plan.sample_rows)
        real_kv = getattr(self, "kv", None)
        self.kv = KVCache.allocate(self.model_config, self.draft.config if self.draft else None, 2,
                                   self.page_size, self.dtype, self.device)
        try:
            step = self._peak_bytes(lambda: self._execute_eager(plan, st, all_greedy=False))
            decode = None
            g = self.decode_graphs
            if g is not None:
                g._reset_inputs()  # every request a padding request: q_len 0, slots -1, null pages
                decode = self._peak_bytes(lambda: g._step(g.max_bs, all_greedy=False))
        finally:
            self.kv = real_kv  # None until the pool exists
        return step, decode

    def _peak_bytes(self, fn) -> int | None:
        """Run `fn`; on CUDA return how far the allocator's reserved memory (what it took from
        the device) rose above its level before (CPU: no allocator statistics, None)."""
        if self.device.type != "cuda":
            fn()
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_reserved(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device) - base

    @property
    def reserve_k(self) -> int:
        """KV rows past a request's last token, less one: max(K, D - 1) (pages_per_seq's K)."""
        return max(self.num_speculative_tokens, self.draft_rows - 1)

    def _t(self, a: np.ndarray) -> torch.Tensor:
        # Plan arrays are read-only numpy: copy rather than alias them.
        return torch.tensor(a, device=self.device)

    def _meta(self, slots, qsl, seq_lens, tables, causal: bool) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._t(slots), query_start_loc=self._t(qsl), seq_lens=self._t(seq_lens),
            page_tables=self._t(tables), causal=causal, max_query_len=int(np.diff(qsl).max(initial=0)),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
        )

    def launch(self, plan, st: dict[str, np.ndarray], all_greedy: bool) -> InFlight:
        """Launch the step's device work (in_flight.py); `wait` gives (accepted drafts per plan
        entry, sampled token per plan sample row). `st`: per sample row, the owning request's
        sampling parameters (numpy)."""
        if self.decode_graphs is not None and plan.num_decode == len(plan):
            return self.graphs_by_b[plan.block_rows].run(plan, st, all_greedy)
        return self._execute_eager(plan, st, all_greedy)

    def wait(self, flight: InFlight) -> tuple[np.ndarray, np.ndarray]:
        out = flight.wait()
        self.step_timer.resolve()  # the step has waited for its results: its marks are readable
        return out

    def execute(self, plan, st: dict[str, np.ndarray], all_greedy: bool) -> tuple[np.ndarray, np.ndarray]:
        """Launch and wait: (accepted drafts per plan entry, sampled token per sample row)."""
        return self.wait(self.launch(plan, st, all_greedy))

    def _sample(self, logits: torch.Tensor, st: dict[str, np.ndarray], all_greedy: bool) -> torch.Tensor:
        if all_greedy and logits.device.type == "cpu" and not use_kernels(logits):
            return row_argmax(logits)  # what `sample` gives every greedy row, without its parameters
        t = SamplingTensors.from_numpy(st, self.device)
        if not use_kernels(logits):
            return sample(logits, t)
        from .kernels import sampling

        return sampling.sample(logits, t.greedy, t.temperature, t.top_k, t.top_p, t.min_p, t.seed, t.position,
                               all_greedy=all_greedy)

    @torch.inference_mode()
    def _execute_eager(self, plan, st: dict[str, np.ndarray], all_greedy: bool) -> InFlight:
        self.step_timer.begin()  # the step's first launch follows (busy/idle marks: step_timer.py)
        input_ids = self._t(plan.input_ids)
        draft_tokens = None
        n_dec = plan.num_decode
        if self.draft is not None and n_dec:
            b, d = plan.block_rows, self.draft_rows  # (draft_block.py: D >= B rows)
            committed = plan.positions[plan.query_start_loc[:n_dec]]
            tables = self._t(plan.draft_page_tables)
            blk = draft_block(self._t(committed), self._t(plan.input_ids[plan.query_start_loc[:n_dec]]), tables,
                              d, b, self.page_size, self.mask_token_id)
            meta = AttentionMetadata(
                slot_mapping=blk.slot_mapping, query_start_loc=blk.query_start_loc, seq_lens=blk.seq_lens,
                page_tables=tables, causal=False, max_query_len=d,
                query_start_loc_cpu=list(range(0, (n_dec + 1) * d, d)), seq_lens_cpu=(committed + d).tolist())
            h = self.draft(self.target.embed(blk.input_ids), blk.positions, meta, self.kv)
            draft_tokens = self.target.propose(h[blk.proposal_rows])  # rows 1..K of each block
            input_ids = input_ids.index_put((self._t(plan.verify_target_rows),), draft_tokens)

        positions = self._t(plan.positions)
        slots = self._t(plan.slot_mapping)
        meta = self._meta(plan.slot_mapping, plan.query_start_loc, plan.seq_lens, plan.page_tables, causal=True)
        hidden, taps = self.target(input_ids, positions, meta, self.kv, self.tap_layers)
        if self.draft is not None:
            # Every row's taps become draft context now, at its own slot (see module doc).
            self.draft.write_context(taps, positions, slots, self.kv)
        logits = self.target.compute_logits(hidden[self._t(plan.sample_rows)])
        sampled = self._sample(logits, st, all_greedy)

        accepted = torch.zeros(len(plan), dtype=torch.int64, device=self.device)
        if draft_tokens is not None:
            b = plan.block_rows
            rows = self._t(plan.sample_start[:n_dec])[:, None] + torch.arange(b, device=self.device)
            drafts = draft_tokens.view(n_dec, b - 1)
            if self.synthetic_rates is None:
                accepted[:n_dec] = accept(drafts, sampled[rows])
            else:
                bonus_rows = plan.query_start_loc[:n_dec]
                seeds = self._t(st["seed"][plan.sample_start[:n_dec]])
                accepted[:n_dec], sampled[rows] = synthetic_accept(
                    drafts, sampled[rows], seeds, self._t(plan.positions[bonus_rows]), self.synthetic_rates)
        out = torch.cat([accepted, sampled])
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(out, non_blocking=True)  # one device-to-host copy (the last launch)
        self.step_timer.end()
        r = len(plan)
        return InFlight(lambda: (host[:r].numpy(), host[r:].numpy()), self.device)


class _ProfilePlan(SimpleNamespace):
    def __len__(self) -> int:
        return len(self.seq_lens)


def _profile_plan(num_tokens: int, max_num_seqs: int, b: int, reserve_k: int, max_model_len: int, page_size: int,
                  vocab_size: int) -> tuple[_ProfilePlan, dict[str, np.ndarray]]:
    """The largest eager step the scheduler can plan, as a step plan for a 2-page KV cache.

    max_num_seqs - 1 decoding requests of B rows (draft pass, verify block, B sampled rows
    each) as far as the token budget allows, then prefill chunks (one sampled row each, at
    most max_model_len rows) filling the rest of it: the target pass sees `num_tokens` rows,
    the logits and the sampler nearly max_num_seqs * B rows. Every context is max_model_len
    long (the widest attention and page tables), every page-table entry page 0 and every slot
    in page 1: in bounds of a 2-page cache. Sampling is the random path (a full sort per
    row), the heavier one."""
    n_dec = min(max_num_seqs - 1, num_tokens // b)
    q_lens = [b] * n_dec
    rest = num_tokens - n_dec * b
    while rest > 0 and len(q_lens) < max_num_seqs:
        q_lens.append(min(rest, max_model_len))
        rest -= q_lens[-1]
    r = len(q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    seq_lens = np.full(r, max_model_len, np.int32)
    positions = np.concatenate([np.arange(max_model_len - q, max_model_len) for q in q_lens]).astype(np.int64)
    width = _core.pages_per_seq(max_model_len, reserve_k, page_size)
    tables = np.zeros((r, width), np.int32)
    sample_rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) if i < n_dec else [qsl[i + 1] - 1]
                                  for i in range(r)]).astype(np.int64)
    per_req = [b if i < n_dec else 1 for i in range(r)]
    rows = int(qsl[-1])
    slots = page_size + np.arange(rows, dtype=np.int64) % page_size  # page 1, over and over
    dec_rows = n_dec * b
    plan = _ProfilePlan(
        input_ids=np.zeros(rows, np.int64), positions=positions, slot_mapping=slots, query_start_loc=qsl,
        seq_lens=seq_lens, page_tables=tables, sample_rows=sample_rows,
        sample_start=np.concatenate([[0], np.cumsum(per_req)]).astype(np.int64),
        num_drafts=np.array([b - 1 if i < n_dec else 0 for i in range(r)], np.int64), handles=np.arange(r),
        num_decode=n_dec, block_rows=b,
        draft_input_ids=np.zeros(dec_rows, np.int64), draft_positions=positions[:dec_rows],
        draft_slot_mapping=slots[:dec_rows], draft_query_start_loc=qsl[:n_dec + 1], draft_seq_lens=seq_lens[:n_dec],
        draft_page_tables=tables[:n_dec],
        verify_target_rows=(qsl[:n_dec, None] + np.arange(1, b)).reshape(-1).astype(np.int64),
    )
    n = len(sample_rows)
    st = {"greedy": np.zeros(n, np.bool_), "temperature": np.ones(n, np.float32),
          "top_k": np.full(n, vocab_size, np.int64), "top_p": np.ones(n, np.float32),
          "min_p": np.zeros(n, np.float32), "seed": np.zeros(n, np.int64), "position": positions[sample_rows] + 1}
    return plan, st
