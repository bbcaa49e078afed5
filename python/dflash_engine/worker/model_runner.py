"""The model runner: sets up the models and memory once, then launches steps.

Setup reads in order: load (target, draft, the CPU backend's packed weights) -> size the
KV pool (a profile step of the largest plan on CUDA) -> allocate -> warm up and capture the
decode graphs (they bake in the pool's addresses). Each engine step then `launch`es the
step's device work (a captured graph for a pure-decode plan or a mixed one that fits the
mixed graphs' buckets, else the eager step; all run `step.run_step`) and `wait`s for its
results: (accepted drafts per plan entry, sampled token
per sample row). The step crosses to the core once each way: the plan in, results out.

A hybrid target (Qwen3.5: GDN + attention layers) keeps its recurrent state in slots that are
pages of the same pool (worker/state_pool.py: views into the KV tensors; the core owns and
counts them). Its decode graphs also stage the state slots (graph_runner.py); it runs
without the fast CPU backend (torch reference layers on the CPU).

Under tensor parallelism (`tp`: distributed/rank.py) each rank's runner holds its shard and a
KV pool of its kv heads, runs eager steps on the plain torch layers, and launches each step
through `tp.launch` (the driver's broadcasts it to the workers first); TP = 1 is untouched.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import _core
from ..cpu import install as install_cpu_backend
from ..models import load_draft, load_target
from ..models.parallel import rank_config
from ..ops.dispatch import use_kernels
from ..runtime_config import RuntimeConfig
from . import step_costs
from .deferred_context import DeferredContext
from .graph_runner import MIXED_REQUESTS, GraphRunner, MixedCaptureFailed, batch_buckets, bucket_of
from .in_flight import InFlight
from .kv_cache import KVCache
from .memory import MemoryReport, peak_bytes, size_kv_pool
from .sampling_batch import SamplingBatch
from .state_pool import layout, state_views
from .step import StepInputs, StepModels, run_step
from .step_timer import StepTimer

if TYPE_CHECKING:
    from ..distributed.rank import TPRank

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, rc: RuntimeConfig, tp: TPRank | None = None):
        self.rc = rc
        self.device = rc.device
        # ---- tensor parallelism (distributed/; None at TP = 1) ----------------------------
        # This rank's shard of the models; its KV pool holds its kv heads (the per-rank config
        # views); no fast CPU backend; every rank agrees on the pool size. Every rank captures
        # the same decode graphs in the same order (their all-reduces inside) and replays the
        # one the broadcast plan selects, so the collectives of all ranks line up.
        self.tp = tp
        self.deferred: DeferredContext | None = None  # set after the startup probes (below)
        shard = None if tp is None else tp.shard
        size = 1 if tp is None else tp.size
        self.target_config = rank_config(rc.model_config, size)
        self.draft_config = None if rc.draft_config is None else rank_config(rc.draft_config, size)
        # ------------------------------------------------------------------------------------
        target = load_target(rc.model_path, rc.dtype, rc.device, batch_invariant=rc.batch_invariant, tp=shard)
        if rc.draft_vocab is not None:  # (before a CPU backend repacks the logits weight)
            target.set_draft_vocab(torch.from_numpy(rc.draft_vocab))
        draft = None
        if rc.draft_path is not None:
            draft = load_draft(rc.draft_path, rc.model_config, rc.dtype, rc.device, batch_invariant=rc.batch_invariant,
                               tp=shard)
        if tp is not None:  # every rank has its shard before the first collective of a step
            tp.barrier()
        self.state_layout = None
        if rc.hybrid:
            # this rank's view (under TP its GDN heads only): its slots' bytes and places
            self.state_layout = layout(self.target_config, self.draft_config, rc.page_size, rc.dtype)
            logger.info("hybrid target: %d GDN layers' state in slots of the KV pool (no fast CPU backend)",
                        len(rc.model_config.gdn_layer_ids))
        elif tp is None:
            for line in install_cpu_backend(target, draft, rc.cpu_weights):
                logger.info(line)
        if draft is not None and tp is None and not rc.batch_invariant and use_kernels(draft.fc.weight):
            draft.stack_context_weights()  # the context write: one GEMM + one launch for every layer
        rates = None if rc.synthetic_rates is None else torch.tensor(rc.synthetic_rates, dtype=torch.float64,
                                                                     device=rc.device)
        self.models = StepModels(target=target, draft=draft, kv=None, tap_layers=list(rc.tap_layers or []) or None,
                                 synthetic_rates=rates)
        self.step_timer = StepTimer(rc.device)
        self._buckets = batch_buckets(rc.max_num_seqs)
        self.bytes_per_page = KVCache.bytes_per_page(self.target_config, self.draft_config, rc.page_size, rc.dtype)
        # The GPU's graph step: fixed shapes per batch bucket (and prefill-token bucket for mixed
        # steps), one CUDA graph each, one runner per verify block B (several with a draft-length
        # schedule or the adaptive policy). Mixed graphs: single-process dense targets.
        self.graphs: dict[int, GraphRunner] = {}
        self.eager_steps = 0
        # Called once mixed steps stop replaying graphs (a capture failed): the engine lifts the
        # core's mixed-step limit (mixed_step_limit) then.
        self.on_mixed_disabled: Callable[[], None] | None = None
        mixed_tokens = 0 if tp is not None else min(rc.max_mixed_graph_tokens, rc.max_num_batched_tokens)
        if use_kernels(target.model.embed_tokens.weight):
            width = _core.pages_per_seq(rc.max_model_len, rc.reserve_rows, rc.page_size)
            for k in rc.draft_lengths:  # the longest block first: it sizes the shared graph pool
                self.graphs[k + 1] = GraphRunner(
                    self.models, self.step_timer, block_rows=k + 1, draft_rows=rc.draft_rows_for(k + 1),
                    max_num_seqs=rc.max_num_seqs, page_table_width=width, enforce_eager=rc.enforce_eager,
                    capture_buckets=self._buckets_for(k), device=rc.device, hybrid=rc.hybrid,
                    collectives=tp is not None, mixed_tokens=mixed_tokens)
        capturing = any(not g.enforce_eager for g in self.graphs.values())
        self.memory: MemoryReport = size_kv_pool(rc, self.bytes_per_page, self.profile, capturing,
                                                 self.state_layout.bytes_per_slot if self.state_layout else 0,
                                                 num_graphs=sum(g.startup_graphs for g in self.graphs.values()))
        if tp is not None:  # every rank's pool has the pages the tightest rank fits
            self.memory.num_pages = tp.agree_min(self.memory.num_pages)
        self.memory.check_holds_one_request()
        self.num_pages = self.memory.num_pages
        self.models.kv = self._allocate(self.num_pages)
        if rc.device.type == "cuda" and use_kernels(self.models.kv.target[0][0]):
            try:
                self._warm_up_attention()
            except Exception:  # noqa: BLE001  (an optimisation: serving works without it)
                logger.exception("attention warm-up failed; kernels compile on first use instead")
        self.gemm_picks: dict = {}  # ops/gemm_tuning's picks for this engine's step shapes
        if capturing and rc.tune_gemms:
            self._tune_gemms()
        pool = None
        for g in self.graphs.values():
            g.pool = pool
            g.capture()
            pool = g.pool
        self.memory.graph_bytes = sum(g.graph_bytes for g in self.graphs.values())
        if self.memory.graph_bytes > self.memory.graph_reserve_bytes:
            logger.warning("CUDA graphs took %.0f MiB, more than the %.0f MiB reserved for them; if the GPU runs "
                           "out of memory, lower --gpu-memory-utilization", self.memory.graph_bytes / 2**20,
                           self.memory.graph_reserve_bytes / 2**20)
        for line in self.memory.lines():
            logger.info(line)
        # The adaptive draft-length policy's cost model: each (batch bucket, K) step, timed.
        self.step_costs: step_costs.StepCosts | None = None
        if rc.draft_len_policy == "adaptive":
            self.step_costs = step_costs.measure(self, list(rc.draft_len_candidates))
            logger.info("adaptive draft length over K in %s: %s", list(rc.draft_len_candidates),
                        self.step_costs.summary())
        self.step_timer.reset()  # the profile and capture steps are no engine steps
        # Plain steps keep their draft-context rows for one batched write (deferred_context.py):
        # the CPU's fast mode (eager steps, one process); enabled only now, after the probes
        # that ran on a temporary 2-page cache.
        if (draft is not None and rc.device.type == "cpu" and not rc.batch_invariant and not self.graphs
                and tp is None):
            self.deferred = DeferredContext(self.models.draft, lambda: self.models.kv)

    # ---- setup ------------------------------------------------------------------------------
    @property
    def target(self) -> torch.nn.Module:
        return self.models.target

    @property
    def draft(self) -> torch.nn.Module | None:
        return self.models.draft

    @property
    def kv(self) -> KVCache:
        return self.models.kv

    def _allocate(self, num_pages: int) -> KVCache:
        """The pool: KV pages, and for a hybrid target the state slots as views into them."""
        kv = KVCache.allocate(self.target_config, self.draft_config, num_pages, self.rc.page_size,
                              self.rc.dtype, self.device, flat=self.state_layout is not None)
        if self.state_layout is not None:
            kv.state = state_views(kv, self.state_layout)
        return kv

    def _buckets_for(self, k: int) -> list[int]:
        """The batch buckets whose steps verify k drafts under the schedule (all without one);
        others are captured on first use."""
        rc = self.rc
        buckets = batch_buckets(rc.max_num_seqs)
        if not rc.draft_len_schedule:
            return buckets
        k_of = lambda n: _core.draft_len_for(list(rc.draft_len_schedule), rc.num_speculative_tokens, n)  # noqa: E731
        return sorted({next(b for b in buckets if b >= n) for n in range(1, rc.max_num_seqs + 1) if k_of(n) == k})

    @torch.inference_mode()
    def profile(self, report: MemoryReport | None = None) -> tuple[int | None, int | None]:
        """Run the largest steps the engine can schedule on a 2-page KV cache and return their
        peak memory growth on CUDA (None on CPU, where the step still runs): (the largest eager
        step, the pure-decode step at the largest bucket (None without decode graphs)). The
        plan comes from the core (`_core.profile_plan`); every read and write stays inside the
        temporary cache (the decode step runs padding requests only)."""
        rc = self.rc
        plan = _core.profile_plan(rc.max_num_batched_tokens, rc.max_num_seqs, rc.block_rows, rc.draft_rows,
                                  rc.reserve_rows, rc.max_model_len, rc.page_size, rc.mask_token_id, rc.hybrid)
        if report is not None:
            report.profile_tokens, report.profile_sample_rows = plan.num_rows, len(plan.sample_rows)
        real_kv, self.models.kv = self.models.kv, self._allocate(2)
        try:
            step = peak_bytes(self.device, lambda: self._launch_eager(plan, _profile_sampling(plan, rc), False))
            decode = None
            if self.graphs:
                g = self.graphs[rc.block_rows]
                g.reset_inputs()  # every request a padding request: q_len 0, slots -1, null pages
                decode = peak_bytes(self.device, lambda: g.step(g.max_bs, all_greedy=False))
                if g.mixed_tokens and self.device.type == "cuda":  # the graphs' pool also holds the largest mixed step
                    mixed = peak_bytes(self.device, lambda: g.step(g.max_bs, False, g.mixed_tokens))
                    decode = None if decode is None else max(decode, mixed or 0)
        finally:
            self.models.kv = real_kv  # None until the pool exists
        return step, decode

    def _tune_gemms(self) -> None:
        """Before capture: run each startup graph's shape eagerly once, noting its few-row
        GEMMs, and time the skinny GEMM against cuBLAS on them (ops/gemm_tuning.py); the
        graphs then capture the faster of each."""
        from ..ops import gemm_tuning

        try:
            with gemm_tuning.recording() as seen:
                for g in self.graphs.values():
                    g.run_few_row_shapes(gemm_tuning.MAX_ROWS)
            gemm_tuning.tune(seen)  # (keys another engine of this process tuned are not timed again)
            table = gemm_tuning.picks()
            self.gemm_picks = {key: table.get(key) for key in seen}
        except Exception:  # noqa: BLE001  (an optimisation: cuBLAS serves every shape without it)
            logger.exception("GEMM tuning failed; cuBLAS runs every GEMM")

    def _warm_up_attention(self) -> None:
        """Compile the attention kernels' variants now rather than in a request's step (a
        prefix-cache hit's short query over a long context, say, first met mid-serving)."""
        from ..kernels.attention import warmup

        t0, n = time.perf_counter(), 0
        shapes: dict[tuple[int, int, int], bool] = {}  # (heads, kv heads, head dim) -> any windowed layer
        for c in [self.target_config] + ([self.draft_config] if self.draft_config else []):
            key = (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
            windowed = any(w is not None for w in getattr(c, "layer_windows", ()))
            shapes[key] = shapes.get(key, False) or windowed
        for (heads, kv_heads, head_dim), windowed in sorted(shapes.items()):
            n += warmup(heads, kv_heads, head_dim, self.rc.page_size, self.rc.dtype, self.device,
                        exact=self.rc.batch_invariant, windowed=windowed)
        torch.cuda.synchronize(self.device)
        logger.info("attention kernels: %d variants ready in %.1f s", n, time.perf_counter() - t0)

    # ---- the step -----------------------------------------------------------------------
    def launch(self, plan, st: SamplingBatch, all_greedy: bool) -> InFlight:
        """Launch the step's device work (in_flight.py). `st`: the step's sampling parameters
        (sampling_batch.py: per request, read per sample row by the eager path)."""
        if self.tp is not None:  # tensor parallel: the driver sends the step to the workers first
            return self.tp.launch(plan, st, all_greedy, self._launch_here)
        return self._launch_here(plan, st, all_greedy)

    def _launch_here(self, plan, st: SamplingBatch, all_greedy: bool) -> InFlight:
        """This rank's launch: a pure-decode step replays its batch bucket's graph, a mixed one
        its (batch, prefill tokens) bucket's graph where it fits one (GraphRunner.mixed_bucket),
        any other runs eagerly. The choice reads the plan alone: under TP every rank makes the
        same one."""
        if self.graphs and plan.num_decode == len(plan):
            return self.graphs[plan.block_rows].run(plan, st, all_greedy)
        g = self.graphs.get(plan.block_rows)
        p = g.mixed_bucket(plan) if g is not None else None
        if p:
            try:
                return g.run(plan, st, all_greedy, p)
            except MixedCaptureFailed:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # (what the failed capture left queued)
                if self.on_mixed_disabled is not None:
                    self.on_mixed_disabled()
        self.eager_steps += 1
        return self._launch_eager(plan, st, all_greedy)

    def mixed_step_limit(self) -> tuple[int, int]:
        """(prefill tokens, prefill requests) a step with decoding requests may carry and still
        replay a mixed graph; (0, 0) when mixed steps run eagerly anyway (CPU, enforce_eager, TP,
        hybrid targets, --max-mixed-graph-tokens 0). The engine hands it to the core's scheduler
        (`set_mixed_step_limit`): a chunk past it waits a step rather than send the whole step
        down the eager path (on a small model an eager step costs about ten graph steps)."""
        live = [g for g in self.graphs.values() if g.mixed_tokens and not g.enforce_eager]
        if not live:
            return 0, 0
        return min(g.mixed_tokens for g in live), MIXED_REQUESTS

    def steps_by_path(self) -> dict[str, int]:
        """Steps launched so far: "decode_graph", "mixed_graph" (a graph runner's steps; eager
        replays of the same padded shapes with enforce_eager) and "eager" (the plan's own shapes)."""
        return {"decode_graph": sum(g.steps["decode"] for g in self.graphs.values()),
                "mixed_graph": sum(g.steps["mixed"] for g in self.graphs.values()),
                "eager": self.eager_steps}

    def wait(self, flight: InFlight) -> tuple[np.ndarray, np.ndarray]:
        """(accepted drafts per plan entry, sampled token per plan sample row)."""
        out = flight.wait()
        self.step_timer.host.start()  # the device waits on the host from here (host_path.py)
        return out

    @torch.inference_mode()
    def _launch_eager(self, plan, st: Mapping[str, np.ndarray], all_greedy: bool) -> InFlight:
        tag = None  # a pure-decode step's (batch bucket, K): its time refines the adaptive policy's costs
        if plan.num_decode == len(plan):
            tag = (bucket_of(self._buckets, len(plan)), plan.block_rows - 1)
        self.step_timer.begin(tag)  # the step's first launch follows (busy/idle marks: step_timer.py)
        x = StepInputs.from_plan(plan, st, self.device)
        keep = None  # (a batched write of kept rows counts in the busy time of the step that needs it)
        if self.deferred is not None and self.deferred.before_step(plan.handles.tolist(), x.draft is not None):
            keep = self.deferred.keep
        accepted, sampled = run_step(self.models, x, all_greedy, keep)
        r = len(plan)
        rest = torch.zeros(r - (0 if accepted is None else accepted.shape[0]), dtype=torch.int64, device=self.device)
        out = torch.cat([rest, sampled] if accepted is None else [accepted, rest, sampled])
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=self.device.type == "cuda")
        host.copy_(out, non_blocking=True)  # one device-to-host copy (the last launch)
        self.step_timer.end()
        return InFlight(lambda: (host[:r].numpy(), host[r:].numpy()), self.device)


def _profile_sampling(plan, rc: RuntimeConfig) -> dict[str, np.ndarray]:
    """Sampling parameters for the profile plan: the random path (a full sort per row), the
    heavier one."""
    n = len(plan.sample_rows)
    return {"greedy": np.zeros(n, np.bool_), "temperature": np.ones(n, np.float32),
            "top_k": np.full(n, rc.model_config.vocab_size, np.int64), "top_p": np.ones(n, np.float32),
            "min_p": np.zeros(n, np.float32), "seed": np.zeros(n, np.int64),
            "position": plan.positions[plan.sample_rows] + 1}
