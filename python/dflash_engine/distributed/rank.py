"""What a ModelRunner holds under tensor parallelism: this rank's place and groups.

    tp.shard            models/parallel.py TPShard: the loaders build and slice by it
    tp.barrier()        every rank has loaded its shard (before the first collective of a step)
    tp.agree_min(n)     every rank's value -> the smallest (the KV pool: pages every rank fits)
    tp.launch(...)      the step hook: a worker just runs the step; the driver's (executor.py
                        DriverRank) first broadcasts it to the workers
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..models.parallel import TPShard
from ..worker.sampling_batch import SamplingBatch
from .groups import Groups


class TPRank:
    def __init__(self, rank: int, size: int, groups: Groups):
        self.rank, self.size, self.groups = rank, size, groups
        self.shard = TPShard(rank, size, groups.device)

    def barrier(self) -> None:
        """Every rank got here (a setup point, bounded by the setup timeout, so a slow rank's
        loading never runs into a step collective's timeout)."""
        self.agree_min(0)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (a setup-time agreement, on the setup group)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.groups.setup)
        return int(t.item())

    def launch(self, plan, st: SamplingBatch, all_greedy: bool, run: Callable):
        """Run the step (`run`: the runner's eager launch) on this rank's shard."""
        return run(plan, st, all_greedy)
