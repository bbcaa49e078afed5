"""Rendezvous and process groups of the tensor-parallel ranks.

The driver hosts a `torch.distributed.TCPStore` on 127.0.0.1 at a port the OS picks (no
race between choosing a port and binding it) and passes the port to the workers it spawns.
Every rank then builds the same three process groups, in the same order, over prefixes of
that store (standalone groups, not the process-global default group: one process may hold
several engines, one after another or at once):

    setup     gloo: setup agreements (rank.py: every rank loaded; the KV pool's size)
    control   gloo, CPU tensors: each step's message (step_message.py)
    device    the models' collectives (models/parallel.py): gloo on CPU, NCCL on CUDA

A group's timeout bounds every wait of its rank in it (a gloo broadcast's root waits until
every receiver takes the message): `setup` by the setup timeout (loading a shard may take
minutes), the driver's `control` and every rank's `device` by the step timeout; a worker's
`control` waits as long as the engine is idle (the next step may come hours later) and ends
when the driver goes.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import envs

HOST = "127.0.0.1"
# A worker waits on `control` for its next step as long as the engine is idle.
IDLE = timedelta(days=3650)


@dataclass
class Groups:
    store: dist.Store
    setup: dist.ProcessGroup  # gloo: setup agreements
    control: dist.ProcessGroup  # gloo: the per-step message (CPU tensors)
    device: dist.ProcessGroup  # the models' collectives: gloo on CPU, NCCL on CUDA
    backend: str  # the device group's

    def shutdown(self) -> None:
        """Stop the groups' own threads now, on a clean stop (every rank done with them):
        left to interpreter finalization, a gloo group's worker threads can be torn down with
        the interpreter and abort the process after its work is done ("terminate called
        without an active exception", exit -6: seen once in CI on a torchrun rank 0; a known
        torch issue, pytorch/pytorch#179291)."""
        for group in (self.setup, self.control, self.device):
            stop = getattr(group, "shutdown", None)
            if stop is not None:
                try:
                    stop()
                except Exception:  # noqa: BLE001  (best effort: the process is stopping)
                    pass


def host_store(size: int, timeout: timedelta) -> dist.TCPStore:
    """The driver's store, on a free port of 127.0.0.1 (`.port`)."""
    return dist.TCPStore(HOST, 0, size, True, timeout=timeout, wait_for_workers=False)


def join_store(port: int, size: int, timeout: timedelta) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, size, False, timeout=timeout)


def launcher_env(size: int) -> tuple[int, str, int]:
    """(rank, master address, master port) of a torchrun-launched rank; a ValueError naming
    what is missing or inconsistent (distributed_executor_backend "external_launcher")."""
    env = envs.torchrun()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError("distributed_executor_backend 'external_launcher' runs under torchrun, which sets "
                         f"RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; missing: {', '.join(missing)}")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size {size} but torchrun started WORLD_SIZE={world} ranks: "
                         "they must be equal")
    return rank, env["MASTER_ADDR"], int(env["MASTER_PORT"])


def launcher_store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    """The store of torchrun-launched ranks, under the prefix "dflash/": torchrun's agent
    hosts one at MASTER_ADDR:MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True), else rank 0
    hosts it there."""
    _, addr, port = launcher_env(size)
    agent = envs.torchrun().get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(addr, port, size, rank == 0 and not agent, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore("dflash/", store)


def rank_device(device: torch.device, rank: int, local_rank: int | None = None) -> torch.device:
    """Rank r's device: the r-th GPU from the engine's (cuda:i -> cuda:i+r; under torchrun
    cuda:LOCAL_RANK), or the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", local_rank if local_rank is not None else (device.index or 0) + rank)
    return device


def connect(store: dist.Store, rank: int, size: int, device: torch.device, setup_timeout: timedelta,
            control_timeout: timedelta, device_timeout: timedelta) -> Groups:
    """Build this rank's groups (blocks until every rank builds them: a gloo group connects
    within the setup timeout, then takes its own for the waits of its collectives)."""
    def gloo(prefix: str, timeout: timedelta) -> dist.ProcessGroup:
        group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, setup_timeout)
        group.set_timeout(timeout)
        return group

    setup, control = gloo("setup/", setup_timeout), gloo("control/", control_timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = device_timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("device/", store), rank, size, opts)
        return Groups(store, setup, control, group, "nccl")
    return Groups(store, setup, control, gloo("device/", device_timeout), "gloo")
