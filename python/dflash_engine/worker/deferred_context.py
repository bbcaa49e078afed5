"""Deferred draft-context writes for plain steps (the CPU's fast mode).

Every target row's taps go into the draft's context K/V (step.verify_pass) so that a later
draft pass can attend to them. A step that drafts nothing (the adaptive policy's K = 0, most
steps of chat traffic on a CPU) has no use for its rows' context yet, and on the CPU writing
it row by row costs 3-4% of a plain step (docs/perf.md, issue 20's CPU cells). Here a plain
step's (taps, positions, slots) are kept instead and written in one batch, before the first
step that needs them or could invalidate them:

- before any step with a draft pass (it reads the context);
- before any step that lacks a request whose rows are kept (it finished, was aborted or
  preempted: the core may hand its pages to another request, or keep them as prefix-cache
  pages whose draft K/V must be complete; writing first and letting the new owner's rows
  overwrite later keeps the pool right);
- when more than MAX_ROWS rows are kept.

Invariants: rows are written in the order they were kept and, where two kept rows share a
slot (a position recomputed after a cancelled step), only the later one is written, so the
pool ends as if every step had written its own rows. Nothing is kept while the pool is not
the engine's (the startup probes swap in a 2-page cache: the runner enables this after them).
The target's outputs never read the draft context: deferral cannot change a sampled token,
only (through numerics of the batched write) which drafts a later draft pass proposes.
"""
from __future__ import annotations

import torch
from torch import Tensor


class DeferredContext:
    MAX_ROWS = 4096

    def __init__(self, draft: torch.nn.Module, kv_of):
        """`kv_of`: returns the pool to write into (the runner's current KV cache)."""
        self.draft, self.kv_of = draft, kv_of
        self.rows: list[tuple[Tensor, Tensor, Tensor]] = []
        self.handles: set[int] = set()
        self.num_rows = 0
        self.flushes = 0

    def before_step(self, handles, drafts: bool) -> bool:
        """Call before a step runs: writes what is kept if the step needs it (see the module
        doc). Returns whether this step's own rows may be kept (it drafts nothing)."""
        if self.rows and (drafts or self.num_rows > self.MAX_ROWS or not self.handles <= set(handles)):
            self.flush()
        if not drafts:
            self.handles.update(handles)
        return not drafts

    def keep(self, taps: Tensor, positions: Tensor, slots: Tensor) -> None:
        self.rows.append((taps, positions, slots))
        self.num_rows += taps.shape[0]

    def flush(self) -> None:
        if not self.rows:
            return
        taps, positions, slots = (torch.cat(parts) for parts in zip(*self.rows))
        self.rows.clear()
        self.handles.clear()
        self.num_rows = 0
        self.flushes += 1
        uniq, inverse = torch.unique(slots, return_inverse=True)
        if uniq.shape[0] != slots.shape[0]:  # a slot kept twice: its later row only
            order = torch.arange(slots.shape[0], device=slots.device)
            last = torch.full((uniq.shape[0],), -1, dtype=order.dtype, device=slots.device)
            last = last.scatter_reduce(0, inverse, order, reduce="amax").sort().values
            taps, positions, slots = taps[last], positions[last], slots[last]
        self.draft.write_context(taps, positions, slots, self.kv_of())
