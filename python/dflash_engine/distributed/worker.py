"""A worker rank's process (ranks 1..N-1; spawned by executor.py, or started by torchrun:
`serve_steps` is the same loop for both).

    join the driver's store -> build the groups (groups.py) -> ModelRunner(rc, tp) on this
    rank's device: its shard, its KV pool, the same setup steps as every rank (collectives
    line up) -> loop: receive a step (step_message.py), run it, drop its results

It exits on the driver's STOP, when the driver process is gone (a thread waits on the
parent's sentinel), or on any error: the error's last lines go to the store for the driver's
message and the traceback to stderr, then the process exits with code 1 (the driver sees the
exit through its sentinel and fails the engine).
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import threading
import traceback
from datetime import timedelta

import torch

from ..runtime_config import RuntimeConfig
from ..worker.model_runner import ModelRunner
from .groups import IDLE, connect, join_store, rank_device
from .rank import TPRank
from .step_message import receive_step


def _exit_with_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the driver process is gone
        os._exit(1)

    threading.Thread(target=watch, name="dflash-tp-parent", daemon=True).start()


def serve_steps(rc: RuntimeConfig, rank: int, size: int, store, local_rank: int | None = None) -> None:
    """A worker rank's life after it reached the store: groups, its ModelRunner, then every
    step the driver sends until STOP (returns) or an error (raises)."""
    device = rank_device(rc.device, rank, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rc = dataclasses.replace(rc, device=device)
    store.set(f"rank{rank}/joined", "1")
    groups = connect(store, rank, size, device, timedelta(seconds=rc.tp_setup_timeout_s), IDLE,
                     timedelta(seconds=rc.tp_timeout_s))
    runner = ModelRunner(rc, tp=TPRank(rank, size, groups))
    seq = 1
    while (step := receive_step(groups.control, seq)) is not None:
        runner.wait(runner.launch(step.plan, step.st, step.all_greedy))
        runner.step_timer.resolve()  # (the driver's engine resolves its own; nothing here reads it)
        seq += 1
    groups.shutdown()  # STOP: every rank is done with the groups


def report_error(store, rank: int, e: BaseException) -> None:
    """The traceback to stderr, the error's last line to the store (the driver's message)."""
    traceback.print_exc(file=sys.stderr)
    sys.stderr.flush()
    if store is not None:
        try:
            store.set(f"rank{rank}/error", f"{type(e).__name__}: {e}"[-2000:])
        except Exception:  # noqa: BLE001
            pass


def run_worker(rc: RuntimeConfig, rank: int, size: int, port: int, threads: int) -> None:
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle: it stops the workers
    torch.set_num_threads(threads)
    store = None
    try:
        store = join_store(port, size, timedelta(seconds=rc.tp_setup_timeout_s))
        serve_steps(rc, rank, size, store)
    except BaseException as e:  # noqa: BLE001  (report, then exit: the driver fails the engine)
        report_error(store, rank, e)
        os._exit(1)
    os._exit(0)
