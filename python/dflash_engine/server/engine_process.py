"""The engine in a process of its own: the server's event loop and the engine's steps no
longer share one GIL (the default of `serve`; `--disable-frontend-multiprocessing` keeps the
engine on a thread of the server's process, async_engine.AsyncLLMEngine).

    server process                                engine process ("dflash-engine-core")
    --------------                                -------------------------------------
    EngineProcessClient.add_request / abort       reader thread: commands -> EngineLoop's queue
       --> command pipe: ("add", id, serial, ...)  main thread: EngineLoop._run (steps)
    reader thread "dflash-engine-outputs"  <--    output pipe: ("out", [(id, serial, delta)]),
       rebuilds each RequestOutput, observes        one message a step; ("stats", EngineStats)
       the latency histograms, hands the batch      at most every STATS_PERIOD_S and whenever
       to the event loops                           the engine goes idle; ("dead", why)

Through the server, the HTTP work (parsing, chat templates, SSE, JSON) of 32 streams ran on
the GIL the engine thread needs between device steps: the GPU idled 31-43% of each step at
c = 32 (docs/perf.md, run 36). Here the engine's host work waits only for itself.

A request crosses as its id and a serial number minted by the client: an abort names both,
so it can only end the request its own stream added (the EngineLoop's rule, across the pipe).
Outputs cross as deltas (new token ids, new text, the finish); the client keeps each
request's cumulative text and token ids, so a step's message does not grow with the output.
The engine process stops on ("stop",) or when the command pipe closes (the server died): it
never outlives its server. If it dies, the reader thread sees the pipe close, every live
request fails with EngineDead, and /health answers 503.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .async_engine import (
    _STOP,
    EngineClient,
    EngineDead,
    EngineLoop,
    RequestStream,
    _Abort,
    _Add,
    _freeze_startup_heap,
    _unfreeze_heap,
    hand_off_to_loops,
)

if TYPE_CHECKING:
    from ..engine import EngineStats, LLMEngine
    from ..tokenizer import Tokenizer

logger = logging.getLogger(__name__)

STATS_PERIOD_S = 0.02  # stats snapshots while busy: /metrics reads at most this stale a view

# (new token ids, new text, finished, finish reason, stop reason, error, cached prompt tokens,
# the engine's per-request metrics: sent with the final output only)
_Delta = tuple[list[int], str, bool, str | None, int | str | None, str | None, int, dict | None]


def _delta(out: RequestOutput) -> _Delta:
    c = out.outputs[0]
    return (out.new_token_ids, out.new_text, out.finished, c.finish_reason, c.stop_reason, out.error,
            out.num_cached_tokens, out.metrics if out.finished else None)


def _picklable(e: BaseException) -> BaseException:
    """``e`` itself when it crosses a pipe intact, else the same kind of error by message
    (ValueError keeps the HTTP 400 mapping, and its ``param``)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        plain: BaseException = ValueError(str(e)) if isinstance(e, ValueError) else RuntimeError(repr(e))
        if isinstance(getattr(e, "param", None), str):
            plain.param = e.param  # type: ignore[attr-defined]
        return plain


# ---- engine process ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Handle:
    """A request's stream as the engine process sees it: (id, serial) is its identity."""

    request_id: str
    serial: int
    client_request_id: str | None = field(default=None, compare=False)
    loop: _ChildLoop | None = field(default=None, compare=False, repr=False)

    def put(self, item: RequestOutput | BaseException) -> None:
        assert self.loop is not None
        self.loop.send(("out", [(self.request_id, self.serial, self._payload(item))]))

    @staticmethod
    def _payload(item: RequestOutput | BaseException) -> _Delta | BaseException:
        return _picklable(item) if isinstance(item, BaseException) else _delta(item)


class _ChildLoop(EngineLoop):
    """The EngineLoop with its outputs going down the output pipe, one message a step."""

    def __init__(self, engine: LLMEngine, out: Connection) -> None:
        super().__init__(engine)
        self._out = out
        self._stats_sent = 0.0

    def send(self, msg: tuple) -> None:
        """Engine thread only (steps, the output sink, command handling): one sender, no lock."""
        self._out.send(msg)

    def _hand_off(self, items: list[tuple[_Handle, RequestOutput]], now: float) -> None:  # type: ignore[override]
        self.send(("out", [(h.request_id, h.serial, _delta(out)) for h, out in items]))

    def _after_step(self) -> None:
        """Stats only when they go out (the snapshot costs host time on every step otherwise)."""
        now = time.monotonic()
        if now - self._stats_sent >= STATS_PERIOD_S or not self.engine.has_unfinished_requests():
            self._stats_sent = now
            super()._after_step()
            self.send(("stats", self._last_stats))


def _read_commands(commands: Connection, loop: _ChildLoop) -> None:
    """Engine process, reader thread: the server's commands into the loop's queue; a closed
    pipe (the server is gone) stops the loop."""
    try:
        while True:
            msg = commands.recv()
            if msg[0] == "add":
                _, rid, serial, client_rid, ids, params, prompt = msg
                loop._commands.put(_Add(_Handle(rid, serial, client_rid, loop), ids, params, prompt))
            elif msg[0] == "abort":
                loop._commands.put(_Abort(_Handle(msg[1], msg[2], None, loop)))
            else:
                break
    except (EOFError, OSError):
        pass
    loop._commands.put(_STOP)


def _engine_main(kwargs: dict[str, Any], commands: Connection, out: Connection,
                 factory: Callable[..., LLMEngine] | None = None) -> None:
    """The engine process: build the engine, report what the server needs, run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's: it sends "stop"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        from ..engine import LLMEngine
        from .startup_report import startup_report

        engine = (factory or LLMEngine.from_kwargs)(**kwargs)
        loop = _ChildLoop(engine, out)
        info = {
            "tokenizer": engine.tokenizer,
            "vocab_size": engine.model_config.vocab_size,
            "max_model_len": engine.max_model_len,
            "synthetic_acceptance": engine.synthetic_acceptance,
            "model_path": str(engine.model_path),
            "report": startup_report(engine),
            "stats": engine.stats(),
        }
    except BaseException as e:  # noqa: BLE001  (raised again in the server process)
        out.send(("error", _picklable(e)))
        return
    out.send(("ready", info))
    _freeze_startup_heap()
    threading.Thread(target=_read_commands, args=(commands, loop), name="dflash-engine-commands",
                     daemon=True).start()
    try:
        loop._run()
        if loop._dead is not None:
            out.send(("dead", repr(loop._dead)))
    except (BrokenPipeError, OSError):
        pass  # the server is gone
    finally:
        _unfreeze_heap()
        engine.close()


# ---- server process ---------------------------------------------------------------------------


@dataclass(eq=False)
class _RemoteStream(RequestStream):
    """A RequestStream whose outputs arrive as deltas: it keeps the cumulative text and ids,
    unless the request asked for deltas (`delta`)."""

    serial: int = 0
    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""

    def rebuild(self, d: _Delta) -> RequestOutput:
        new_ids, new_text, finished, finish_reason, stop_reason, error, cached, metrics = d
        if self.delta:  # the news only (RequestOutputKind.DELTA): nothing kept, nothing copied
            completion = CompletionOutput(0, new_text, new_ids, finish_reason, stop_reason)
        else:
            self.token_ids.extend(new_ids)
            self.text += new_text
            completion = CompletionOutput(0, self.text, list(self.token_ids), finish_reason, stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             finished=finished, new_token_ids=new_ids, new_text=new_text, error=error,
                             metrics=metrics or {}, num_cached_tokens=cached)


_clients: weakref.WeakSet[EngineProcessClient] = weakref.WeakSet()


@atexit.register
def _stop_clients() -> None:
    """Runs before multiprocessing joins its (non-daemon) children at exit: stop them first."""
    for client in list(_clients):
        client.shutdown(timeout=10)


class EngineProcessClient(EngineClient):
    """The server's handle on an engine running in its own process (module doc)."""

    def __init__(self, proc: mp.process.BaseProcess, commands: Connection, outputs: Connection,
                 info: dict[str, Any]) -> None:
        super().__init__()
        self._proc, self._commands, self._outputs = proc, commands, outputs
        self.tokenizer: Tokenizer | None = info["tokenizer"]
        self.vocab_size: int = info["vocab_size"]
        self.max_model_len: int = info["max_model_len"]
        self.synthetic_acceptance: bool = info["synthetic_acceptance"]
        self.model_path: str = info["model_path"]
        self.report: list[str] = info["report"]
        self._last_stats: EngineStats = info["stats"]
        self._routes: dict[str, _RemoteStream] = {}  # live requests by id: event loop adds, reader pops
        self._serials = itertools.count()
        self._send_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        self._reader = threading.Thread(target=self._read, name="dflash-engine-outputs", daemon=True)
        self._reader.start()
        _clients.add(self)

    @classmethod
    def build(cls, kwargs: dict[str, Any], factory: Callable[..., LLMEngine] | None = None) -> EngineProcessClient:
        """Start the engine process and build the engine there (`LLMEngine.from_kwargs(**kwargs)`,
        or `factory(**kwargs)`: a module-level function, as the process imports it by name);
        returns once it is built. A build error is raised here, as the engine raised it."""
        ctx = mp.get_context("spawn")  # a fresh interpreter: no CUDA state inherited
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        out_r, out_w = ctx.Pipe(duplex=False)
        # Not a daemon: the engine process starts its own workers under tensor parallelism.
        proc = ctx.Process(target=_engine_main, args=(kwargs, cmd_r, out_w, factory), name="dflash-engine-core")
        proc.start()
        cmd_r.close()
        out_w.close()  # the parent holds only its ends: the pipes close when the child dies
        try:
            kind, payload = out_r.recv()
        except (EOFError, OSError):
            proc.join(10)
            raise RuntimeError(f"the engine process exited (code {proc.exitcode}) while building the engine; "
                               "its log is above") from None
        if kind == "error":
            proc.join(30)
            raise payload
        return cls(proc, cmd_w, out_r, payload)

    # ---- what the engine is ------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and not self._stopping and self._proc.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        if self._dead is None and not self._proc.is_alive():
            return EngineDead(f"the engine process exited (code {self._proc.exitcode})")
        return self._dead

    def stats(self) -> EngineStats:
        """The engine's stats as the engine process last sent them (at most STATS_PERIOD_S old
        while it steps; exact once it is idle)."""
        return self._last_stats

    def startup_report(self) -> list[str]:
        return self.report

    def start(self) -> None:
        """The engine process serves from the moment it is built."""

    def shutdown(self, timeout: float = 30.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except (EngineDead, OSError):
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating it", timeout)
            self._proc.terminate()
            self._proc.join(5)
        self._reader.join(5)
        self._commands.close()

    # ---- requests ----------------------------------------------------------------------------

    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._commands.send(msg)
        except (BrokenPipeError, OSError) as e:
            raise EngineDead(f"the engine process is gone: {e!r}") from None

    def _new_stream(self, request_id: str, client_request_id: str | None, prompt_token_ids: list[int],
                    prompt: str | None) -> RequestStream:
        stream = _RemoteStream(request_id, asyncio.get_running_loop(), client_request_id,
                               serial=next(self._serials), prompt=prompt, prompt_token_ids=prompt_token_ids)
        self._routes[request_id] = stream
        return stream

    def _submit_add(self, stream: RequestStream, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None) -> None:
        assert isinstance(stream, _RemoteStream)
        try:
            self._send(("add", stream.request_id, stream.serial, stream.client_request_id, prompt_token_ids,
                        params, prompt))
        except EngineDead:
            pass  # add_request's health check, or the reader at the pipe's end, fails the stream

    def _submit_abort(self, stream: RequestStream) -> None:
        assert isinstance(stream, _RemoteStream)
        try:
            self._send(("abort", stream.request_id, stream.serial))
        except EngineDead:
            pass  # nothing left to abort: the reader fails the stream

    def release(self, stream: RequestStream, abort: bool) -> None:
        super().release(stream, abort)
        if self._routes.get(stream.request_id) is stream:
            del self._routes[stream.request_id]  # nobody reads it any more

    def _fail_queued_adds(self) -> None:
        """The engine process is gone: every live request fails."""
        err = self.dead_error or EngineDead("the engine process stopped")
        for rid in list(self._routes):
            stream = self._routes.pop(rid, None)
            if stream is not None:
                stream.put(err)

    # ---- server process, reader thread -----------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                kind, payload = self._outputs.recv()
                if kind == "out":
                    self._dispatch(payload)
                elif kind == "stats":
                    self._last_stats = payload
                elif kind == "dead":
                    self._dead = EngineDead(f"engine stopped: {payload}")
        except (EOFError, OSError):
            pass
        except BaseException as e:  # noqa: BLE001  (a bad message: this client cannot go on)
            logger.exception("reading the engine process's outputs failed")
            self._dead = EngineDead(f"the engine process's outputs could not be read: {e!r}")
        self._proc.join(2)
        if self._dead is None:
            self._dead = (EngineDead("the engine process stopped") if self._stopping else
                          EngineDead(f"the engine process exited (code {self._proc.exitcode})"))
        if not self._stopping:
            logger.error("%s; failing %d requests", self._dead, len(self._routes))
        self._fail_queued_adds()

    def _dispatch(self, batch: list[tuple[str, int, _Delta | BaseException]]) -> None:
        now = time.monotonic()
        items: list[tuple[RequestStream, Any]] = []
        for rid, serial, payload in batch:
            stream = self._routes.get(rid)
            if stream is None or stream.serial != serial:
                continue  # released, or an earlier request of the same id
            if isinstance(payload, BaseException):
                self._routes.pop(rid, None)
                items.append((stream, payload))
                continue
            out = stream.rebuild(payload)
            if out.finished:
                self._routes.pop(rid, None)
            if self.metrics is not None:
                self.metrics.observe_output(stream, out, now)
            items.append((stream, out))
        hand_off_to_loops(items)
