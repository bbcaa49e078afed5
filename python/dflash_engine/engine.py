"""LLMEngine: schedule (Rust) -> launch (torch) -> wait -> commit (Rust) -> outputs.

The host overlaps the device (`overlap=False` or `DFLASH_OVERLAP=0` turn it off): a step
waits for the step in flight (launched by the previous call) and commits it, schedules and
launches the next one from that committed state (so drafting never misses its acceptance),
then, while the device runs it, turns the committed result into outputs (detokenise, stop
strings, RequestOutputs, and the async engine's hand-off to streams via `output_sink`) and
returns with the new step still in flight. So the caller's work between two calls (the
server's admissions, aborts, stats) also runs during device time, not in the device's idle
gap. Outputs come one step late; a step with nothing to run returns the pending ones at once.
Anything that changes the core between calls (`abort_request`, turning `overlap` off) first
lands the step in flight, so it sees the state of a step boundary.

Not thread-safe: one thread drives `step()`; the async engine serialises add/abort.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import _core
from .config import EngineConfig
from .distributed.executor import start_executor
from .outputs import CompletionOutput, RequestOutput
from .request_state import RequestState
from .runtime_config import resolve
from .sampling_params import RequestOutputKind, SamplingParams
from .tokenizer import Tokenizer
from .worker import step_costs
from .worker.model_runner import ModelRunner
from .worker.sampling_batch import SamplingBatch, SamplingTable

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # Steps with decoding requests, by the K they verified (0: no draft pass); the draft-length
    # policy's choices.
    spec_draft_len_counts: dict[int, int] = field(default_factory=dict)
    # Per K > 0: request-steps that drafted K, and the drafts of those accepted (the committed
    # tokens per request-step at K are 1 + accepted / drafted: does a longer block pay?).
    spec_drafts_by_len: dict[int, int] = field(default_factory=dict)
    spec_accepted_by_len: dict[int, int] = field(default_factory=dict)
    # The adaptive policy's calibration per draft position 1..K: observed over predicted
    # acceptances through it (1 = its estimates are right; what it scales them by).
    spec_acceptance_calibration: list[float] = field(default_factory=list)
    # Prefix cache, in tokens: looked up at admission, and of those served from the cache.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Device time per step (step_timer.py): busy from a step's first launch to its last; idle
    # from one step's end to the next one's start, counted only while requests were waiting.
    step_busy_seconds: float = 0.0
    step_idle_seconds: float = 0.0
    num_steps: int = 0
    # The host's side of the idle gaps, by phase (worker/host_path.py), and the gaps counted.
    step_host_seconds: dict[str, float] = field(default_factory=dict)
    step_host_gaps: int = 0
    step_host_overlapped_seconds: float = 0.0  # outputs built while the device ran the next step
    # Steps launched, by how: "decode_graph", "mixed_graph" (the graph runner's padded shapes)
    # and "eager" (the plan's own shapes: CPU fast mode, prefill-only and oversized mixed steps).
    steps_by_path: dict[str, int] = field(default_factory=dict)

    @property
    def mean_acceptance_length(self) -> float:
        """τ = 1 + accepted / drafts (the committed tokens per verify step)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0


class FaultInjector:
    """Test hook: override to raise inside a step or while processing one request. Hooks
    see the requests themselves (ids are minted by whoever adds them; prompts are not)."""

    def step(self, requests: list[RequestState]) -> None:  # noqa: B027
        pass

    def request(self, request: RequestState) -> None:  # noqa: B027
        pass


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        rc = self.runtime_config = resolve(config)  # every default decided here, once
        self.model_path = rc.model_path
        self.tokenizer = Tokenizer.from_dir(rc.model_path) if (rc.model_path / "tokenizer.json").exists() else None
        self.max_model_len = rc.max_model_len
        # Tensor parallelism (distributed/): ranks 1..N-1 in worker processes, this one rank 0;
        # None at TP = 1 (no process, no communication).
        self.executor = start_executor(rc)
        self.runner = ModelRunner(rc) if self.executor is None else self.executor.build_runner(ModelRunner, rc)
        self.model_config = rc.model_config
        self.num_speculative_tokens = rc.num_speculative_tokens
        self.max_num_batched_tokens = rc.max_num_batched_tokens
        self.scheduler = _core.Scheduler(
            num_pages=self.runner.num_pages,
            page_size=rc.page_size,
            max_num_seqs=rc.max_num_seqs,
            max_num_batched_tokens=rc.max_num_batched_tokens,
            max_model_len=rc.max_model_len,
            num_speculative_tokens=rc.num_speculative_tokens,
            mask_token_id=rc.mask_token_id,
            enable_prefix_caching=rc.enable_prefix_caching,
            draft_len_schedule=list(rc.draft_len_schedule),
            draft_len_policy="adaptive" if rc.draft_len_policy == "adaptive" else "fixed",
            draft_len_candidates=list(rc.draft_len_candidates),
            draft_block_rows=rc.draft_rows,
            state_slots=rc.hybrid,  # a hybrid target's recurrent-state slots: pages of the same pool
        )
        # Steps with decoding requests carry no more prefill than a mixed graph holds.
        mixed_tokens, mixed_requests = self.runner.mixed_step_limit()
        self.scheduler.set_mixed_step_limit(mixed_tokens, mixed_requests)
        self.runner.on_mixed_disabled = self._lift_mixed_step_limit
        if mixed_tokens:
            logger.info("mixed-step limit: while requests decode, a step takes at most %d prefill tokens "
                        "of %d requests (what its CUDA graphs hold)", mixed_tokens, mixed_requests)
        # The adaptive policy's cost model: measured at startup, refined live (step_costs.LiveCosts).
        self._live_costs = None if self.runner.step_costs is None else step_costs.LiveCosts(self.runner.step_costs)
        if self.runner.step_costs is not None:
            c = self.runner.step_costs
            self.scheduler.set_step_costs(c.buckets, c.ks, c.seconds)
        if rc.draft_config is not None:
            logger.info("draft length: %s", {
                "fixed": f"fixed, K = {rc.num_speculative_tokens}",
                "schedule": f"schedule {list(rc.draft_len_schedule)}",
                "adaptive": f"adaptive, K in {list(rc.draft_len_candidates)} chosen each step from measured "
                            "acceptance and step cost"}[rc.draft_len_policy])
        eos = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        self.eos_token_ids = sorted(eos | set(self.model_config.eos_token_ids))
        # Keyed by the core's handle; the request-id registry is the core's (`handle_of`).
        self._requests: dict[int, RequestState] = {}
        self._rng = np.random.default_rng(config.seed)
        self._stats = EngineStats()  # (spec_accepted_per_pos: made by stats() from the histogram below)
        # Request-steps by accepted drafts 0..K (_record_spec; stats() reads it per position).
        self._accepted_hist = np.zeros(self.num_speculative_tokens + 1, np.int64)
        self.fault_injector: FaultInjector | None = None
        self._pending = None  # the latest step's committed result, not yet turned into outputs
        self._flight = None  # (plan, InFlight): the step the last overlapped call launched, not yet landed
        self._carried: list[RequestOutput] = []  # outputs of a step that failed while landed between calls
        # Process step N's outputs while the device runs step N+1 (module doc): the step
        # function is chosen here (and where `overlap` is set), not in every step.
        self.step: Callable[[], list[RequestOutput]]
        self.overlap = rc.overlap
        # When set, outputs ready during a step's device time go here at once (from the
        # stepping thread) rather than into step()'s return value.
        self.output_sink: Callable[[list[RequestOutput]], None] | None = None
        self._sampling_cache = None  # (plan key, RequestParams): _sampling_arrays
        self._sampling_table = SamplingTable()  # every live request's sampling parameters
        self._spec_backlog: list[tuple[np.ndarray, np.ndarray]] = []  # committed, not yet in _stats

    @property
    def overlap(self) -> bool:
        return self.step == self._step_overlapped

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if not on:
            self._land_flight()  # the synchronous step starts from a step boundary
        self.step = self._step_overlapped if on else self._step_sync

    @classmethod
    def from_kwargs(cls, **kwargs) -> LLMEngine:
        return cls(EngineConfig(**kwargs))

    @property
    def fatal_error(self) -> BaseException | None:
        """Set once the engine cannot serve at all (a tensor-parallel rank died); every step
        then raises it. None while it can."""
        return None if self.executor is None else self.executor.failure

    def close(self) -> None:
        """Release what outlives the engine object otherwise: the tensor-parallel workers
        (also stopped on garbage collection and at interpreter exit). Idempotent."""
        if self.executor is not None:
            self.executor.shutdown()

    # ---- capacity ---------------------------------------------------------------
    @property
    def num_usable_pages(self) -> int:
        return self.scheduler.num_usable_pages

    @property
    def synthetic_acceptance(self) -> bool:
        """Benchmark-only synthetic acceptance is on: label every output it touches."""
        return self.runtime_config.synthetic

    @property
    def max_concurrency(self) -> float:
        """How many full-length requests the KV pool holds at once."""
        return self.runner.memory.max_concurrency

    # ---- requests ---------------------------------------------------------------
    def _lift_mixed_step_limit(self) -> None:
        """The runner lost its mixed-step graphs (a capture failed): steps with decoding requests
        run eagerly anyway, so their prefill goes back to the full token budget."""
        self.scheduler.set_mixed_step_limit(0, 0)
        logger.warning("mixed-step graphs disabled: the mixed-step limit is lifted")

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        final_only: bool = False,
    ) -> None:
        """Queue a request. Bad input raises `_core.RequestRejectedError` (a ValueError with
        `.param`) or the sampling parameters' own error; a live id `DuplicateRequestError`.
        final_only: step() reports this request once, when it finishes (no per-step outputs;
        `LLM.generate` asks for that, as vLLM's offline API does), whatever `params.output_kind`
        says; `output_kind` FINAL_ONLY does the same, DELTA makes each output carry only its news."""
        vocab = self.model_config.vocab_size
        try:
            ids = [int(t) for t in prompt_token_ids]
        except (TypeError, ValueError):
            raise _reject("prompt", "prompt token ids must be integers") from None
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise _reject("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        params.validate(vocab_size=vocab)
        # Length limits (empty prompt, max_model_len, pool size) are checked once, in the core.
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - len(ids))
        stops = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stops |= set(self.eos_token_ids)
        handle = self.scheduler.add_request(request_id, np.asarray(ids, np.int64), max_tokens, sorted(stops))
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**62))
        self._requests[handle] = RequestState(
            request_id, handle, prompt, ids, params, seed & ((1 << 63) - 1),
            self.tokenizer if params.detokenize else None,
            final_only=final_only or params.output_kind == RequestOutputKind.FINAL_ONLY,
            delta=params.output_kind == RequestOutputKind.DELTA,
        )
        self._sampling_table.add(handle, self._sampling_row(self._requests[handle]))
        self._stats.prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self._land_flight()  # (its tokens then go into the abort's output, as at any boundary)
        handle = self.scheduler.handle_of(request_id)
        if handle is not None:
            self.scheduler.abort(handle)
        else:  # finished by the pending step's commit, not reported yet: abort it all the same
            handle = self._pending_handle(request_id)
            if handle is None:
                return None
        self._absorb_pending(handle)
        return self._finish(handle, "abort")

    def abort_unstarted(self) -> list[str]:
        """Abort every request still waiting for its first step (never scheduled); the others
        run on. Returns their ids (a batch job's deadline: what has started finishes, nothing
        new starts)."""
        ids = [r.request_id for h, r in list(self._requests.items())
               if not r.token_ids and self.scheduler.request_state(h)[0] == "waiting"]
        for rid in ids:
            self.abort_request(rid)
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- the step -----------------------------------------------------------------
    def _step_overlapped(self) -> list[RequestOutput]:
        """Land the step in flight, schedule and launch the next from its committed state,
        build the landed step's outputs while the device runs the new one, and return with
        it in flight (the next call, or `_land_flight`, waits for it)."""
        host = self.runner.step_timer.host  # the host's part of the gap between steps (host_path.py)
        host.mark("between_steps")  # (a gap is open here only if a flight was landed between calls)
        self._land_flight()  # (a step that failed there is recovered; its outputs come below)
        plan = self.scheduler.schedule()  # from the committed state: the landed step is in it
        host.mark("schedule")
        if plan is None:
            self.runner.step_timer.pause()  # nothing to run: the wait until the next step is not idle time
            return self._take_outputs()
        try:
            flight = self._launch(plan)
        except Exception as e:  # noqa: BLE001  (a failed step must not take the engine down)
            return self._take_outputs() + self._recover(plan, e)
        self._flight = (plan, flight)
        t0 = time.perf_counter()
        try:
            outputs = self._emit(self._take_outputs())
        except BaseException:
            self._flight = None
            self._abandon(plan, flight)
            raise
        host.overlapped += time.perf_counter() - t0
        if not self._requests:  # every request finished on the host (a stop string): nothing to wait for
            self._land_flight()
            self.runner.step_timer.pause()  # idle now: the wait for the next request is no gap
        return outputs

    def _land_flight(self) -> None:
        """Wait for the step in flight, if any, and commit it (its outputs come with the next
        `_take_outputs`): the core is then at a step boundary. A step that fails here is
        recovered (its requests retried one by one); those outputs come the same way."""
        if self._flight is None:
            return
        plan, flight = self._flight
        self._flight = None
        assert self._pending is None, "a step in flight with an earlier result still pending"
        try:
            self._pending = self._land(plan, flight)
        except Exception as e:  # noqa: BLE001
            self._carried = self._take_outputs() + self._recover(plan, e)  # (the earlier carried included)

    def _step_sync(self) -> list[RequestOutput]:
        """Schedule, launch, wait, commit, then build this step's outputs."""
        host = self.runner.step_timer.host
        host.mark("between_steps")
        plan = self.scheduler.schedule()
        host.mark("schedule")
        if plan is None:
            self.runner.step_timer.pause()
            return self._take_outputs()
        try:
            self._pending = self._land(plan, self._launch(plan))
        except Exception as e:  # noqa: BLE001  (a failed step must not take the engine down)
            return self._take_outputs() + self._recover(plan, e)
        outputs = self._take_outputs()
        host.mark("return")
        return outputs

    def _launch(self, plan):
        if self.fault_injector is not None:
            self.fault_injector.step([self._requests[int(h)] for h in plan.handles])
        st, all_greedy = self._sampling_arrays(plan)
        self.runner.step_timer.host.mark("sampling_arrays")
        return self.runner.launch(plan, st, all_greedy)

    def _land(self, plan, flight):
        """Wait for a launched step and commit it; returns the core's CommitResult."""
        accepted, sampled = self.runner.wait(flight)
        result = self.scheduler.commit(plan, accepted, sampled)
        self.runner.step_timer.host.mark("commit")
        # Counted with the outputs (_take_outputs: off the critical path when overlapped).
        self._spec_backlog.append((plan.num_drafts, accepted))
        return result

    def _abandon(self, plan, flight) -> None:
        """Host work between launch and wait raised: let the device finish, drop the step."""
        self.runner.step_timer.pause()
        try:
            self.runner.wait(flight)
        finally:
            self.scheduler.cancel(plan)

    def _take_outputs(self) -> list[RequestOutput]:
        # The device times of the steps that have finished (here: off the critical path when
        # overlapped; the live costs below read them).
        self.runner.step_timer.resolve()
        for num_drafts, accepted in self._spec_backlog:
            self._record_spec(num_drafts, accepted)
        self._spec_backlog.clear()
        # The adaptive policy's live cost table, every LiveCosts.EVERY steps: here, while the
        # device runs the next step when overlapped (rebuilding it took ~0.3 ms of host time
        # on the 2-core CPU: a stall between steps every EVERY steps where it was, after the
        # wait); the next schedule reads it.
        if self._live_costs is not None and (table := self._live_costs.refresh(self.runner.step_timer)) is not None:
            c = self._live_costs.startup
            self.scheduler.set_step_costs(c.buckets, c.ks, table)
        result, self._pending = self._pending, None
        carried, self._carried = self._carried, []
        return carried + (self._process(result) if result is not None else [])

    def _emit(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.output_sink is None or not outputs:
            return outputs
        self.output_sink(outputs)
        return []

    def _recover(self, plan, e: Exception) -> list[RequestOutput]:
        self._raise_if_fatal(plan, e)
        logger.exception("engine step failed; retrying its %d requests one by one", len(plan))
        self.runner.step_timer.pause()  # a half-timed step: neither busy nor idle
        self.scheduler.cancel(plan)
        if len(plan) == 1:
            return self._fail_alone(int(plan.handles[0]), e)
        return self._retry_alone([int(h) for h in plan.handles])

    def _run(self, plan) -> list[RequestOutput]:
        """One step, synchronously (the failed-step retry): launch, wait, commit, process."""
        return self._process(self._land(plan, self._launch(plan)))

    def _retry_alone(self, handles: list[int]) -> list[RequestOutput]:
        """After a failed step: run each of its requests in a step of its own, so that only
        the request that fails alone is failed (an innocent one never fails with it)."""
        outputs = []
        for h in handles:
            if h not in self._requests:
                continue
            plan = self.scheduler.schedule_only(h)
            if plan is None:
                continue  # preempted meanwhile: it runs again later
            try:
                outputs += self._run(plan)
            except Exception as e:  # noqa: BLE001
                self._raise_if_fatal(plan, e)
                logger.exception("request %s failed its step alone", self._requests[h].request_id)
                self.runner.step_timer.pause()
                self.scheduler.cancel(plan)
                outputs += self._fail_alone(h, e)
        return outputs

    def _raise_if_fatal(self, plan, e: Exception) -> None:
        """A failure no retry can fix (fatal_error): drop the step and raise it."""
        fatal = self.fatal_error
        if fatal is not None:
            self.runner.step_timer.pause()
            self.scheduler.cancel(plan)
            raise fatal from e

    def _fail_alone(self, handle: int, e: Exception) -> list[RequestOutput]:
        if handle not in self._requests:
            return []  # finished while its step ran (a stop string in the previous step's output)
        self.scheduler.finish(handle, "error")
        return [self._finish(handle, "error", f"engine step failed: {e}")]

    def _sampling_arrays(self, plan) -> tuple[SamplingBatch, bool]:
        """The step's sampling parameters (kept per request: worker/sampling_batch.py); and
        whether every row is greedy. A request's parameters never change and the core never
        reuses a handle, so a step with the previous step's requests and row counts (steady
        decoding) reuses them (and the graph runner, seeing the same object, skips restaging)."""
        key = (plan.handles.tobytes(), plan.sample_start.tobytes())
        cached = self._sampling_cache
        if cached is None or cached[0] != key:
            # On the critical path between steps whenever the batch changed: one gather per
            # parameter from the live requests' table (filled at add_request).
            cached = self._sampling_cache = (key, self._sampling_table.params(plan.handles, plan.sample_start))
        params = cached[1]
        return SamplingBatch(params, plan), params.all_greedy

    def _sampling_row(self, req: RequestState) -> tuple:
        """(greedy, temperature, top_k, top_p, min_p, seed) of a request (sampling_batch.FIELDS'
        order), for the sampling table at admission."""
        x = req.params
        top_k = x.effective_top_k(self.model_config.vocab_size)
        return (x.greedy, max(x.temperature, 1e-5), top_k, x.top_p, x.min_p, req.seed)

    def _record_spec(self, drafts: np.ndarray, accepted: np.ndarray) -> None:
        """Count a committed step's drafts and acceptances (drafts, accepted: per plan entry).
        Accepted counts go into a histogram (`_accepted_hist`); `stats()` turns it into the
        per-position counts. ~15 us a step for 32 requests on the 2-core CPU (was ~55 with
        np.unique and a per-position loop every step): it runs while the device computes, but
        on a small model the whole output path is close to a step's length."""
        spec = drafts > 0
        d = drafts[spec]
        n = len(d)
        if n == 0:
            return
        acc = accepted[spec].astype(np.int64, copy=False)
        s = self._stats
        accepted_total = int(acc.sum())
        s.spec_num_drafts += n
        s.spec_num_draft_tokens += int(d.sum())
        s.spec_num_accepted_tokens += accepted_total
        hist = self._accepted_hist
        hist += np.bincount(acc, minlength=len(hist))[:len(hist)]
        k0 = int(d[0])
        if (d == k0).all():  # one draft length this step (the common case: one K a step)
            s.spec_drafts_by_len[k0] = s.spec_drafts_by_len.get(k0, 0) + n
            s.spec_accepted_by_len[k0] = s.spec_accepted_by_len.get(k0, 0) + accepted_total
            return
        lens, inverse = np.unique(d, return_inverse=True)
        for i, (n_k, a_k) in enumerate(zip(np.bincount(inverse).tolist(), np.bincount(inverse, acc).tolist())):
            kk = int(lens[i])
            s.spec_drafts_by_len[kk] = s.spec_drafts_by_len.get(kk, 0) + n_k
            s.spec_accepted_by_len[kk] = s.spec_accepted_by_len.get(kk, 0) + int(a_k)

    def _accepted_per_pos(self) -> list[int]:
        """Request-steps whose draft at position 1..K was accepted (accepted count >= pos)."""
        at_least = self._accepted_hist[::-1].cumsum()[::-1]
        return at_least[1:self.num_speculative_tokens + 1].tolist()

    def _process(self, result) -> list[RequestOutput]:
        outputs = []
        offsets, tokens, codes = result.offsets, result.new_tokens, result.finish_codes
        cached = result.num_cached_tokens
        for i, h in enumerate(result.handles.tolist()):
            req = self._requests.get(h)
            if req is None:
                continue  # aborted while this result was pending (abort_request took its tokens)
            req.num_cached_tokens = int(cached[i])
            new = tokens[offsets[i]:offsets[i + 1]].tolist()
            reason = _core.FINISH_REASONS[codes[i]]
            if not new and reason is None:
                continue  # a prefill chunk that produced nothing visible yet
            try:
                if self.fault_injector is not None:
                    self.fault_injector.request(req)
                stopped = req.append(new)
            except Exception as e:  # one request's failure finishes only that request
                logger.exception("request %s failed", req.request_id)
                if reason is None:
                    self.scheduler.finish(h, "error")
                outputs.append(self._finish(h, "error", f"request processing failed: {e}"))
                continue
            self._stats.generation_tokens += len(new)
            if stopped:
                if reason is None:
                    self.scheduler.finish(h, "stop")
                reason = "stop"
            if reason:
                outputs.append(self._finish(h, reason))
            elif not req.final_only:
                outputs.append(req.output())
        return outputs

    def _pending_handle(self, request_id: str) -> int | None:
        if self._pending is None:
            return None
        for h in self._pending.handles.tolist():
            req = self._requests.get(h)
            if req is not None and req.request_id == request_id:
                return h
        return None

    def _absorb_pending(self, handle: int) -> None:
        """Give an aborted request its tokens from the pending result (its abort output then
        carries them); the pending result later skips it."""
        r = self._pending
        if r is None:
            return
        for i, h in enumerate(r.handles.tolist()):
            if h == handle:
                new = r.new_tokens[r.offsets[i]:r.offsets[i + 1]].tolist()
                if new:
                    try:
                        self._requests[h].append(new)
                    except Exception:  # noqa: BLE001  (it is being aborted anyway)
                        logger.exception("request %s failed while aborted", self._requests[h].request_id)
                    self._stats.generation_tokens += len(new)
                return

    def _finish(self, handle: int, reason: str, error: str | None = None) -> RequestOutput:
        out = self._requests.pop(handle).finish(reason, error)
        self._sampling_table.remove(handle)
        if not self._requests:
            self.runner.step_timer.pause()  # the engine is idle now, not the device waiting on it
        return out

    def stats(self) -> EngineStats:
        """A snapshot (safe to read while the engine keeps stepping)."""
        s = self._stats
        busy, idle, steps = self.runner.step_timer.totals()
        return dataclasses.replace(
            s, num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.scheduler.kv_usage, num_preemptions=self.scheduler.num_preemptions,
            spec_accepted_per_pos=self._accepted_per_pos(),
            spec_drafts_by_len=dict(s.spec_drafts_by_len), spec_accepted_by_len=dict(s.spec_accepted_by_len),
            spec_draft_len_counts=self.scheduler.draft_len_counts() if self.num_speculative_tokens else {},
            spec_acceptance_calibration=(self.scheduler.acceptance_calibration()
                                         if self.scheduler.draft_len_policy == "adaptive" else []),
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            step_busy_seconds=busy, step_idle_seconds=idle, num_steps=steps,
            step_host_seconds=self.runner.step_timer.host.totals(), step_host_gaps=self.runner.step_timer.host.gaps,
            step_host_overlapped_seconds=self.runner.step_timer.host.overlapped,
            steps_by_path=self.runner.steps_by_path(),
        )


def _reject(param: str, message: str) -> ValueError:
    err = _core.RequestRejectedError(message)
    err.param = param
    return err


__all__ = ["LLMEngine", "EngineStats", "FaultInjector", "RequestOutput", "CompletionOutput"]
