"""The engine behind the server: EngineClient (what routes call), EngineLoop (what drives
the engine), and AsyncLLMEngine, both in one process: the synchronous LLMEngine driven by one
background thread (`--disable-frontend-multiprocessing`; engine_process.py runs the same
EngineLoop in a process of its own, the default of `serve`).

The engine object is only touched from the thread (or process) that steps it, so the event
loop never waits on a step. Request ids are the caller's (the server mints a fresh one per
HTTP request); an abort names the stream it came from, so it can only ever end the request
that stream added. Failure handling is EngineLoop's (its docstring).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import sys
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from .. import envs
from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:  # the engine pulls in torch; importing the server package stays light
    from ..engine import EngineStats, LLMEngine
    from ..tokenizer import Tokenizer
    from .metrics import ServerMetrics

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """The engine finished the request with an error (the server answers 500)."""


class RequestAborted(Exception):
    """The request was aborted before it finished (client gone, or shutdown)."""


class EngineDead(Exception):
    """The engine thread has stopped; nothing can be served (the server answers 503)."""


@dataclass(eq=False)  # identity: an abort names the very stream it came from
class RequestStream:
    """Outputs of one request, delivered on the event loop that created it."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    client_request_id: str | None = None  # the client's X-Request-Id: for logs only
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_tokens: int = 0
    # The engine sends each output's news only (RequestOutputKind.DELTA): merging outputs
    # concatenates their completions too.
    delta: bool = False
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: hands ``item`` to the consumer's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    async def get(self) -> RequestOutput:
        """The next output; when the consumer fell behind, every output already queued, merged
        into one (as vLLM's output collector does): one SSE chunk, not one per engine step."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        while not item.finished and not self.queue.empty():
            nxt = self.queue._queue[0]  # type: ignore[attr-defined]  # peek: an error stays queued
            if isinstance(nxt, BaseException):
                break
            self.queue.get_nowait()
            item = merge_outputs(item, nxt, self.delta)
        return item


def merge_outputs(earlier: RequestOutput, later: RequestOutput, delta: bool = False) -> RequestOutput:
    """``later`` carrying the news of both: its cumulative fields already cover ``earlier``,
    unless the outputs are deltas (``delta``), whose completions are the news themselves."""
    later.new_token_ids = earlier.new_token_ids + later.new_token_ids
    later.new_text = earlier.new_text + later.new_text
    if delta:
        c = later.outputs[0]
        c.token_ids, c.text = later.new_token_ids, later.new_text
    return later


class _Stream(Protocol):
    """Where one request's outputs go: a RequestStream, or a handle naming one in another
    process (engine_process.py)."""

    request_id: str
    client_request_id: str | None

    def put(self, item: RequestOutput | BaseException) -> None: ...


@dataclass
class _Add:
    stream: _Stream
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None


@dataclass
class _Abort:
    stream: _Stream


class _Stop:
    """Shutdown: the engine thread returns once it reads this command."""


_STOP = _Stop()
_Command = _Add | _Abort | _Stop


def _shorten_switch_interval() -> None:
    """Python's GIL switch interval (default 5 ms) is how long the engine thread, back from
    waiting on the device, may wait for the GIL while the event loop runs Python (SSE, JSON):
    the device idles meanwhile. The server shortens it (envs.switch_interval_ms; 0 keeps
    Python's default)."""
    ms = envs.switch_interval_ms()
    if ms > 0:
        sys.setswitchinterval(ms / 1000)


def _freeze_startup_heap() -> None:
    """What startup built (the models' modules and parameters' Python objects, the tokenizer,
    the graph runners, the server's routes: some 300k objects) lives as long as the server.
    `gc.freeze()` moves it out of the cyclic collector's reach, so that a full collection
    while serving walks only what serving made instead of all of it: such a pass runs on the
    engine thread between two steps, where the device waits for it (vLLM freezes its engine
    core's heap after startup the same way). Shutdown unfreezes it (`_unfreeze_heap`): frozen
    objects are never collected, and native bindings (Triton's) then report them as leaked at
    interpreter exit."""
    gc.collect()
    gc.freeze()


def _unfreeze_heap() -> None:
    gc.unfreeze()


class EngineClient:
    """The engine as the server's routes see it: add a request and read its stream, abort it,
    ask for health and stats. Request ids are the caller's (the server mints a fresh one per
    HTTP request) and unique among live requests. Subclasses say how a request reaches the
    engine (``_submit_add`` / ``_submit_abort``) and what the engine is (the properties)."""

    engine: LLMEngine | None = None  # the engine object, where it lives in this process

    def __init__(self) -> None:
        self.metrics: ServerMetrics | None = None  # set by build_app: latency histograms
        self._live: dict[str, RequestStream] = {}  # event loop only: added, not yet done with

    # ---- what the engine is (subclasses) -------------------------------------------------

    tokenizer: Tokenizer | None
    vocab_size: int  # valid token ids are [0, vocab_size)
    synthetic_acceptance: bool  # benchmark-only synthetic acceptance is on: outputs say so
    max_model_len: int

    @property
    def is_healthy(self) -> bool:
        raise NotImplementedError

    @property
    def dead_error(self) -> BaseException | None:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 30.0) -> None:
        raise NotImplementedError

    def _new_stream(self, request_id: str, client_request_id: str | None, prompt_token_ids: list[int],
                    prompt: str | None) -> RequestStream:
        return RequestStream(request_id, asyncio.get_running_loop(), client_request_id)

    def _submit_add(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None) -> None:
        raise NotImplementedError

    def startup_report(self) -> list[str]:
        """What `serve` prints before it listens (startup_report.py)."""
        raise NotImplementedError

    def _submit_abort(self, stream: RequestStream) -> None:
        raise NotImplementedError

    def _fail_queued_adds(self) -> None:
        """Fail adds the engine will never read (it died meanwhile)."""
        raise NotImplementedError

    # ---- streams ---------------------------------------------------------------------------

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet released by their consumer (event-loop view)."""
        return len(self._live)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        client_request_id: str | None = None,
    ) -> RequestStream:
        """Queue a request; errors (including the engine's ValueError) arrive on the stream.

        ``request_id`` must be unique among live requests (a ValueError otherwise, and the
        live request is untouched); call ``release`` once done with the stream.
        """
        if not self.is_healthy:
            raise EngineDead(f"engine is not running: {self.dead_error!r}")
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in flight")
        ids = list(prompt_token_ids)
        stream = self._new_stream(request_id, client_request_id, ids, prompt)
        stream.delta = params.output_kind == RequestOutputKind.DELTA
        self._live[request_id] = stream
        self._submit_add(stream, ids, params, prompt)
        if not self.is_healthy:  # the engine died meanwhile; its last drain may have missed this
            self._fail_queued_adds()
        return stream

    def release(self, stream: RequestStream, abort: bool) -> None:
        """The consumer is done with ``stream``; with ``abort``, end its request in the engine."""
        if self._live.get(stream.request_id) is stream:
            del self._live[stream.request_id]
        if abort:
            self._submit_abort(stream)

    def abort(self, request_id: str) -> None:
        """Abort the live request added under ``request_id`` (no-op once it is done)."""
        stream = self._live.get(request_id)
        if stream is not None:
            self._submit_abort(stream)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        client_request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's outputs until it finishes; raise what failed it."""
        stream = self.add_request(request_id, prompt_token_ids, params, prompt, client_request_id)
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                if out.finished and (out.error is not None or out.outputs[0].finish_reason == "error"):
                    raise RequestFailed(out.error or "request failed in the engine")
                yield out
        finally:
            self.release(stream, abort=not finished)


class EngineLoop:
    """Drives an LLMEngine on the thread that owns it: commands (add, abort, stop) are applied
    between steps, outputs leave through ``_hand_off`` in one batch per step (mostly via the
    engine's output_sink, during device time). A step that raises past the engine's own
    isolation fails the requests the engine holds and aborts them, so their pages return, and
    the loop goes on. The loop dies only when the engine cannot even be reset (or reports a
    fatal error): every request then fails with EngineDead.

    Streams here are whatever the commands carry: the consumer's RequestStream (one process)
    or a handle naming it across the process boundary (engine_process.py); an abort ends a
    request only when it names the stream that added it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._dead: BaseException | None = None
        self._last_stats = engine.stats()  # a snapshot already
        # A command taken off the queue during a step that must wait for the step boundary
        # (an abort or the stop): it and everything after it are applied there, in order.
        self._held: _Command | None = None
        self._sink_ran = False  # the output sink ran during the current step (device time)
        engine.output_sink = self._sink

    def _fatal(self) -> BaseException | None:
        """The engine's own verdict that it cannot serve (a tensor-parallel rank died)."""
        return getattr(self.engine, "fatal_error", None)

    def _hand_off(self, items: list[tuple[_Stream, RequestOutput]], now: float) -> None:
        raise NotImplementedError

    def _after_step(self) -> None:
        # A copy: the engine updates its stats object in place during steps.
        self._last_stats = self.engine.stats()

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests() or self._held is not None
                if not self._apply_commands(block=not busy):
                    break
                self._sink_ran = False
                if self.engine.has_unfinished_requests():
                    self._step()
                # The stats snapshot: taken in the sink, during device time, when the step had
                # one (the overlapped step); here otherwise, and always once the engine is idle.
                if not self._sink_ran or not self.engine.has_unfinished_requests():
                    self._after_step()
        except BaseException as e:  # the engine could not be reset: stop serving, truthfully
            logger.exception("engine loop died")
            self._dead = e
        finally:
            for stream in self._streams.values():
                stream.put(EngineDead(f"engine stopped: {self._dead!r}"))
            self._streams.clear()
            self._fail_queued_adds()

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (at the step boundary); False once shutdown is requested."""
        if self._held is not None:
            cmd, self._held = self._held, None
        else:
            try:
                cmd = self._commands.get() if block else self._commands.get_nowait()
            except queue.Empty:
                return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                self._abort(cmd.stream)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _sink(self, outputs: list[RequestOutput]) -> None:
        """The engine's output sink: called while the device runs a step (the overlapped step),
        with the previous step's outputs. Delivers them, takes the stats snapshot, then admits the requests queued
        meanwhile, so that the gap between steps, where the device waits on the host, does
        not pay for their admission (host_path.py's "between_steps"). A new request only
        joins the core's waiting queue; the step in flight is not touched. Aborts and the
        stop wait for the step boundary (a request of the step in flight may not leave it),
        and so does every command after them: commands apply in the order they came."""
        self._deliver(outputs)
        self._sink_ran = True
        self._after_step()
        while self._held is None:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._add(cmd)
            else:
                self._held = cmd

    def _add(self, cmd: _Add) -> None:
        rid = cmd.stream.request_id
        if rid in self._streams:
            cmd.stream.put(ValueError(f"request id {rid!r} is already in flight"))
            return
        try:
            self.engine.add_request(rid, cmd.prompt_token_ids, cmd.params, prompt=cmd.prompt)
        except ValueError as e:
            cmd.stream.put(e)
            return
        except Exception as e:  # a bug on one request's way in must not stop the loop
            logger.exception("add_request %s (X-Request-Id %r) failed", rid, cmd.stream.client_request_id)
            cmd.stream.put(RequestFailed(f"could not add the request: {e!r}"))
            return
        self._streams[rid] = cmd.stream

    def _abort(self, stream: _Stream) -> None:
        rid = stream.request_id
        if self._streams.get(rid) != stream:  # identity, or a handle's (id, serial)
            return  # already finished, never admitted, or not this stream's request
        del self._streams[rid]
        self.engine.abort_request(rid)
        stream.put(RequestAborted(rid))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            if self._fatal() is not None:
                raise  # the engine cannot serve any more: the loop ends, every request fails
            # The engine is meant to contain step failures itself; this is the backstop.
            logger.exception("engine step raised; failing its %d requests", len(self._streams))
            for rid, stream in list(self._streams.items()):
                self.engine.abort_request(rid)
                stream.put(RequestFailed(f"engine step failed: {e!r}"))
            self._streams.clear()
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams, in one batch (``_hand_off``)."""
        items: list[tuple[_Stream, RequestOutput]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            items.append((stream, out))
        if items:
            self._hand_off(items, time.monotonic())

    def _fail_queued_adds(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                cmd.stream.put(EngineDead("engine stopped"))


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    """On the event loop: each item into its stream's queue."""
    for q, item in items:
        q.put_nowait(item)


def hand_off_to_loops(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Outputs to their streams' event loops: one hand-off per loop for the whole batch, not
    one per output (each `call_soon_threadsafe` wakes the loop through its self-pipe, and the
    loop's wake-ups contend with the caller's thread for the GIL). A stream's items keep their
    order: one loop runs its callbacks first in, first out."""
    batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
    for stream, out in items:
        batches.setdefault(stream.loop, []).append((stream.queue, out))
    for loop, batch in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more


class AsyncLLMEngine(EngineLoop, EngineClient):
    """The engine on a background thread of the server's process (module doc).

        event loop (asyncio)                         engine thread
        --------------------                         -------------
        add_request / abort  --> commands queue -->  applied between steps
        RequestStream.get()  <-- call_soon_threadsafe <-- step() outputs, one batch a step

    The engine is only touched from its thread, so the event loop never waits on a step; but
    both share the GIL, so the event loop's Python (HTTP, SSE, JSON) delays the engine's host
    work at high request rates: engine_process.py is the default of `serve` for that reason.
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        EngineClient.__init__(self)
        EngineLoop.__init__(self, engine)
        self.metrics = metrics
        self._thread: threading.Thread | None = None
        self._go: threading.Event | None = None  # set by start() when built on its own thread (build)

    @property
    def tokenizer(self) -> Tokenizer | None:  # type: ignore[override]
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.engine.model_config.vocab_size

    @property
    def synthetic_acceptance(self) -> bool:  # type: ignore[override]
        return self.engine.synthetic_acceptance

    @property
    def max_model_len(self) -> int:  # type: ignore[override]
        # The engine resolves the effective length (config.max_model_len may be None).
        return self.engine.max_model_len

    @property
    def is_healthy(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self._dead is None
                and self._fatal() is None)

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead or self._fatal()

    def stats(self) -> EngineStats:
        """The engine's stats as of the end of the latest step (never races a step)."""
        return self._last_stats

    @property
    def model_path(self) -> str:
        return str(self.engine.model_path)

    def startup_report(self) -> list[str]:
        from .startup_report import startup_report

        return startup_report(self.engine)

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine]) -> AsyncLLMEngine:
        """Build the engine (`factory()`) on the thread that will run its steps; returns once
        it is built (a build error is raised here); `start()` then lets that thread serve.
        Every torch op of the engine then runs on one thread. On a CPU that is worth 2x:
        torch's OpenMP pool belongs to the thread that runs a parallel op, and steps on a
        second thread beside the one that loaded the model ran at half speed (two teams on
        the cores; measured in docs/perf.md "CPU serving: one thread for the engine")."""
        built: dict[str, object] = {}
        ready, go = threading.Event(), threading.Event()

        def target() -> None:
            try:
                built["self"] = cls(factory())
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller)
                built["error"] = e
                return
            finally:
                ready.set()
            go.wait()
            built["self"]._run()

        thread = threading.Thread(target=target, name="dflash-engine", daemon=True)
        thread.start()
        ready.wait()
        if "error" in built:
            thread.join()
            raise built["error"]  # type: ignore[misc]
        self = built["self"]
        assert isinstance(self, cls)
        self._thread, self._go = thread, go
        return self

    def start(self) -> None:
        if self._go is not None:  # built on its own thread (build): let it serve
            _shorten_switch_interval()
            _freeze_startup_heap()
            self._go.set()
            self._go = None
        elif self._thread is None:
            _shorten_switch_interval()
            _freeze_startup_heap()
            self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        _unfreeze_heap()
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            if self._go is not None:  # built but never started: its thread waits for the start
                self._go.set()
            self._thread.join(timeout)

    def _submit_add(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None) -> None:
        self._commands.put(_Add(stream, prompt_token_ids, params, prompt))

    def _submit_abort(self, stream: RequestStream) -> None:
        self._commands.put(_Abort(stream))

    def _hand_off(self, items: list[tuple[RequestStream, RequestOutput]], now: float) -> None:  # type: ignore[override]
        if self.metrics is not None:
            for stream, out in items:
                self.metrics.observe_output(stream, out, now)
        hand_off_to_loops(items)
