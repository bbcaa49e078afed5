"""The driver side of tensor parallelism: start ranks 1..N-1, feed them every step, watch them.

`start_executor(rc)` (engine.py) returns None at TP = 1. Otherwise it hosts the rendezvous
store, spawns one worker process per rank (multiprocessing "spawn": a fresh interpreter, no
forked torch state), waits for them to join, builds this process's groups (rank 0) and hands
the ModelRunner `executor.driver`, whose `launch` broadcasts each step to the workers before
running it on rank 0's shard.

Failure: a worker that dies is seen at once by a watchdog thread waiting on the workers'
process sentinels, which marks the executor failed (`failure`, a TensorParallelError naming
the rank, its exit code and the error it reported), stops the other workers and, with NCCL,
aborts the device group so no collective waits on the dead rank. On gloo, a collective with a
dead peer fails within milliseconds anyway; a hung (not dead) peer is bounded by the group
timeouts (groups.py: the step timeout DFLASH_TP_TIMEOUT_S once setup is done). Any exception
once a step was broadcast is fatal too: the ranks are out of step. The engine then raises the
failure from every step (engine.py `fatal_error`).

Shutdown: `shutdown()` (LLMEngine.close), the executor's garbage collection, and interpreter
exit (weakref.finalize's atexit hook) all run the same idempotent stop: a STOP message, a
join with a timeout, then terminate/kill for any straggler. Workers are daemonic and also
exit when the driver process is gone (worker.py), so no rank outlives its engine.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import wait as wait_any

import torch

from ..runtime_config import RuntimeConfig
from ..worker.sampling_batch import SamplingBatch
from .groups import Groups, connect, host_store
from .rank import TPRank
from .step_message import send_step, send_stop
from .worker import run_worker

logger = logging.getLogger(__name__)

_JOIN_SECONDS = 5.0  # a stopped worker's time to exit before it is terminated
_DEATH_GRACE_SECONDS = 1.0  # a failed collective may precede the dead rank's exit status by a moment


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, or a step failed once it was broadcast: the engine cannot
    serve any more (every later step raises this)."""


def start_executor(rc: RuntimeConfig) -> Executor | None:
    """None at tensor_parallel_size 1 (today's path: no process, no communication), except
    under torchrun: `torchrun --nproc-per-node 1 ... --distributed-executor-backend
    external_launcher` runs one rank through the distributed path (its groups, the step
    broadcast, NCCL collectives inside the decode graphs): what one GPU can check of it.
    With torchrun's ranks, ranks >= 1 never return from here: they serve rank 0's steps,
    then exit the process (`LauncherExecutor`)."""
    if rc.tensor_parallel_size == 1 and rc.tp_launcher != "external_launcher":
        return None
    if rc.tp_launcher == "external_launcher":
        return LauncherExecutor(rc)
    return Executor(rc)


class _Ranks:
    """The worker processes and the failure state, shared by the executor, its driver rank and
    the watchdog (none of them holds the executor, so its finalizer can run)."""

    def __init__(self, procs: list, store):
        self.procs = procs  # rank r = procs[r - 1]
        self.store = store
        self.groups: Groups | None = None
        self.failure: TensorParallelError | None = None
        self.closed = False
        self.lock = threading.Lock()

    def dead(self) -> list[int]:
        return [r for r, p in enumerate(self.procs, 1) if p.exitcode is not None]

    def describe(self, rank: int) -> str:
        p = self.procs[rank - 1]
        what = f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        try:
            key = f"rank{rank}/error"
            if self.store.check([key]):
                what += ": " + self.store.get(key).decode(errors="replace").strip().splitlines()[-1]
        except Exception:  # noqa: BLE001  (the message is best effort)
            pass
        return what

    def fail(self, cause: BaseException | None) -> TensorParallelError:
        """Mark the engine failed (once), stop every worker; returns the failure."""
        with self.lock:
            if self.failure is not None:
                return self.failure
            deadline = time.monotonic() + _DEATH_GRACE_SECONDS
            while not self.dead() and time.monotonic() < deadline:
                time.sleep(0.01)
            dead = self.dead()
            if dead:
                msg = "tensor-parallel " + "; ".join(self.describe(r) for r in dead)
            else:
                msg = (f"a tensor-parallel step failed after it was sent to the workers ({cause!r}; a rank that "
                       "does not answer within DFLASH_TP_TIMEOUT_S counts as failed); the ranks are out of step")
            self.failure = TensorParallelError(msg + ": the engine cannot serve any more")
        logger.error("%s", self.failure)
        if self.groups is not None and self.groups.backend == "nccl":
            try:  # unblock this rank's collectives waiting on the dead one
                self.groups.device.abort()
            except Exception:  # noqa: BLE001
                logger.exception("aborting the NCCL group failed")
        self.stop_workers(0.0, kill=True)  # out of step or hung: nothing to wait for
        return self.failure

    def stop_workers(self, join_seconds: float, kill: bool = False) -> None:
        """Join the workers for up to `join_seconds`, then terminate (or kill) the rest."""
        deadline = time.monotonic() + join_seconds
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.exitcode is None:
                p.kill() if kill else p.terminate()
        for p in self.procs:
            p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)


def _watch(ranks: _Ranks, stop) -> None:
    """The watchdog thread: wait for any worker to exit (or for shutdown)."""
    ready = wait_any([p.sentinel for p in ranks.procs] + [stop])
    if stop in ready or ranks.closed:
        return
    for p in ranks.procs:
        if p.sentinel in ready:
            p.join(_DEATH_GRACE_SECONDS)  # its exit status (the sentinel may fire a moment before)
    ranks.fail(None)


def _shutdown(ranks: _Ranks, stop_w) -> None:
    """Stop the workers (idempotent): the executor's finalizer."""
    with ranks.lock:
        if ranks.closed:
            return
        ranks.closed = True
    try:
        stop_w.send(None)  # the watchdog returns
    except Exception:  # noqa: BLE001
        pass
    clean = ranks.failure is None and ranks.groups is not None and not ranks.dead()
    if clean:
        try:
            send_stop(ranks.groups.control, -1)
        except Exception:  # noqa: BLE001  (a worker gone meanwhile: it is killed below)
            clean = False
    ranks.stop_workers(_JOIN_SECONDS)
    if clean:  # (after a failure a group's thread may sit in a collective: left to exit)
        ranks.groups.shutdown()


class DriverRank(TPRank):
    """Rank 0 in the engine process: each step goes to the workers, then runs here."""

    def __init__(self, size: int, groups: Groups, ranks: _Ranks):
        super().__init__(0, size, groups)
        self._ranks = ranks
        self._seq = 0

    def launch(self, plan, st: SamplingBatch, all_greedy: bool, run):
        ranks = self._ranks
        if ranks.failure is not None:
            raise ranks.failure
        if ranks.closed:
            raise TensorParallelError("the engine's tensor-parallel workers were shut down")
        try:
            self._seq += 1
            send_step(self.groups.control, self._seq, plan, st, all_greedy)
            flight = run(plan, st, all_greedy)
        except Exception as e:
            raise ranks.fail(e) from e
        return _CheckedFlight(flight, ranks)


class _CheckedFlight:
    """The driver's in-flight step: a failure while waiting for it is the engine's too."""

    def __init__(self, flight, ranks: _Ranks):
        self._flight, self._ranks = flight, ranks

    def wait(self):
        try:
            return self._flight.wait()
        except Exception as e:
            raise self._ranks.fail(e) from e


class Executor:
    def __init__(self, rc: RuntimeConfig):
        size = rc.tensor_parallel_size
        setup = timedelta(seconds=rc.tp_setup_timeout_s)
        store = host_store(size, setup)
        ctx = mp.get_context("spawn")
        threads = max(1, torch.get_num_threads() // size)
        procs = [ctx.Process(target=run_worker, args=(rc, r, size, store.port, threads), daemon=True,
                             name=f"dflash-tp-rank{r}") for r in range(1, size)]
        stop_r = self._drive(rc, store, procs)
        threading.Thread(target=_watch, args=(self._ranks, stop_r), name="dflash-tp-watchdog", daemon=True).start()
        logger.info("tensor parallelism: %d ranks (%s), workers %s", size, self._ranks.groups.backend, self.pids)

    def _drive(self, rc: RuntimeConfig, store, procs: list):
        """Rank 0's side, whoever starts ranks 1..N-1 (`procs`: the processes to start, none
        under torchrun): the shared failure state and its finalizer, the wait for every worker
        in the store, the groups, the driver. Returns the watchdog's end of the stop pipe."""
        size = rc.tensor_parallel_size
        self._ranks = ranks = _Ranks(procs, store)
        stop_r, stop_w = mp.Pipe(duplex=False)
        self._finalizer = weakref.finalize(self, _shutdown, ranks, stop_w)
        try:
            for p in procs:
                p.start()
            self._wait_for_workers(rc.tp_setup_timeout_s, size - 1)
            setup, step = timedelta(seconds=rc.tp_setup_timeout_s), timedelta(seconds=rc.tp_timeout_s)
            ranks.groups = connect(store, 0, size, rc.device, setup, step, step)
        except BaseException:
            self._finalizer()
            raise
        self.driver = DriverRank(size, ranks.groups, ranks)
        return stop_r

    def _wait_for_workers(self, timeout: float, workers: int) -> None:
        """Until every worker has joined the store; a worker that exits first is an error."""
        ranks = self._ranks
        keys = [f"rank{r}/joined" for r in range(1, workers + 1)]
        deadline = time.monotonic() + timeout
        while not ranks.store.check(keys):
            dead = ranks.dead()
            if dead:
                raise TensorParallelError("tensor-parallel worker failed to start: "
                                          + "; ".join(ranks.describe(r) for r in dead))
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {timeout:g} s "
                                          "(DFLASH_TP_SETUP_TIMEOUT_S)")
            time.sleep(0.01)

    def build_runner(self, factory, rc: RuntimeConfig):
        """`factory(rc, tp=self.driver)`: rank 0's ModelRunner, set up beside the workers' own.
        If it raises, the workers are stopped; a collective that failed because a worker died
        during setup is reported as that worker's failure (its exit code and error)."""
        try:
            return factory(rc, tp=self.driver)
        except BaseException as e:
            ranks, err = self._ranks, None
            if isinstance(e, RuntimeError) and not isinstance(e, TensorParallelError):
                deadline = time.monotonic() + _DEATH_GRACE_SECONDS
                while not ranks.dead() and time.monotonic() < deadline:
                    time.sleep(0.01)
                if ranks.dead():
                    err = TensorParallelError("tensor-parallel setup failed: "
                                              + "; ".join(ranks.describe(r) for r in ranks.dead()))
            self.shutdown()
            if err is not None:
                raise err from e
            raise

    @property
    def failure(self) -> TensorParallelError | None:
        """Set once a rank died or a step failed midway (the engine cannot serve)."""
        return self._ranks.failure

    @property
    def processes(self) -> list:
        return list(self._ranks.procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._ranks.procs]

    def shutdown(self) -> None:
        """Stop the workers (idempotent; also on garbage collection and at interpreter exit)."""
        self._finalizer()


class LauncherExecutor(Executor):
    """Ranks started by torchrun (`--distributed-executor-backend external_launcher`): the
    store is torchrun's (groups.launcher_store), nothing is spawned. Rank 0 is the driver
    as with spawned workers; every other rank turns into a worker here (worker.serve_steps)
    and exits the process when rank 0 stops it (code 0) or on an error (code 1, reported
    to rank 0 through the store). No watchdog of process sentinels: a dead rank fails the
    next collective (gloo at once; NCCL within the step timeout), and torchrun stops the
    job's other ranks when one exits with an error."""

    def __init__(self, rc: RuntimeConfig):
        from .. import envs
        from .groups import launcher_env, launcher_store
        from .worker import report_error, serve_steps

        size = rc.tensor_parallel_size
        rank, _, _ = launcher_env(size)
        setup = timedelta(seconds=rc.tp_setup_timeout_s)
        local_rank = envs.torchrun().get("LOCAL_RANK")
        local = int(local_rank) if local_rank is not None else None
        store = launcher_store(rank, size, setup)
        if rank != 0:
            try:
                serve_steps(rc, rank, size, store, local)
            except BaseException as e:  # noqa: BLE001  (report, then exit like a spawned worker)
                report_error(store, rank, e)
                raise SystemExit(1) from e
            logger.info("tensor-parallel rank %d: rank 0 stopped the engine; exiting", rank)
            raise SystemExit(0)
        self._drive(rc, store, [])
        logger.info("tensor parallelism: %d ranks started by torchrun (%s)", size, self._ranks.groups.backend)
