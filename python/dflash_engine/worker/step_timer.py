"""Device busy and idle time per engine step (how long the GPU waits on the host between
steps is the host overhead the engine must keep small).

The model runner calls `begin()` right before a step's first device launch and `end()` right
after its last. busy = end - begin of each step; idle = begin of step N+1 - end of step N, the
time the device waits on the host (schedule, commit, detokenise, HTTP) while there is work.

On CUDA both marks are `torch.cuda.Event`s on the current stream, read lazily: a step's pair
is resolved once its end event has completed (checked with `query()`, never waited on), so
the timer adds no synchronisation. The engine resolves once a step (`LLMEngine._take_outputs`:
when overlapped, after the next step's launch, so the event queries and elapsed-time reads
stay off the critical path between steps); each step's begin event is made at the previous
step's end (after its last launch), so `begin()` only records it. On CPU the device is the
CPU itself and the marks are host clock readings; the same arithmetic holds, which keeps the
accounting testable.

Invariant: idle is only counted between two steps with work in between. The engine calls
`pause()` when a schedule finds nothing to run and when its last request leaves; the next
step then starts a new run of steps and its gap is not counted.
"""
from __future__ import annotations

import time

import torch

from .host_path import HostPath


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host = HostPath()  # the host's side of each idle gap, by phase (host_path.py)
        self.reset()

    def reset(self) -> None:
        """Forget every step so far (setup's profile and capture steps are no engine steps)."""
        self.busy_seconds = 0.0
        self.idle_seconds = 0.0
        self.steps = 0
        self._prev_end = None  # end mark of the latest step; None: paused (next gap not counted)
        self._start = None  # begin mark of the step in flight
        self._tag = None  # the step in flight's (batch bucket, K), or None (step_costs.LiveCosts)
        self._ready = None  # CUDA: the next begin mark's event, made at the last end()
        self._pending: list[tuple] = []  # (gap start or None, begin, end, tag), oldest first
        # tag -> [busy seconds, steps, idle seconds before those steps, gaps counted] (take_by_tag)
        self.by_tag: dict[tuple[int, int], list] = {}
        self.host.reset()

    def _mark(self, event=None):
        """A mark now: the host clock, or a recorded CUDA event (`event`: one made earlier)."""
        if not self.cuda:
            return time.perf_counter()
        if event is None:
            event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a

    def begin(self, tag: tuple[int, int] | None = None) -> None:
        """`tag`: a pure-decode step's (batch bucket, K), whose busy time also adds up per
        tag (the adaptive draft length's live costs); None for other steps."""
        self.host.finish()
        ready, self._ready = self._ready, None
        self._start, self._tag = self._mark(ready), tag

    def end(self) -> None:
        if self._start is None:
            return
        end = self._mark()
        self._pending.append((self._prev_end, self._start, end, self._tag))
        self._prev_end, self._start = end, None
        if self.cuda:  # the next step's begin event, made now (the device is busy) rather than in its gap
            self._ready = torch.cuda.Event(enable_timing=True)

    def pause(self) -> None:
        """The engine has no work (or a step failed midway): the next gap is not idle time."""
        self._prev_end = self._start = None
        self.host.cancel()

    def totals(self) -> tuple[float, float, int]:
        """(busy seconds, idle seconds, steps) of the steps resolved so far (a plain read)."""
        return self.busy_seconds, self.idle_seconds, self.steps

    def resolve(self) -> None:
        """Add up every step whose marks are complete; never waits (engine thread only)."""
        done = 0
        for gap_start, start, end, tag in self._pending:
            if self.cuda and not end.query():
                break  # events complete in stream order: the later ones are not done either
            busy = self._seconds(start, end)
            self.busy_seconds += busy
            gap = None if gap_start is None else self._seconds(gap_start, start)
            if gap is not None:
                self.idle_seconds += gap
            if tag is not None:
                cell = self.by_tag.setdefault(tag, [0.0, 0, 0.0, 0])
                cell[0] += busy
                cell[1] += 1
                if gap is not None:  # the host work before the step: its staging and the last commit
                    cell[2] += gap
                    cell[3] += 1
            self.steps += 1
            done += 1
        del self._pending[:done]

    def take_by_tag(self, min_steps: int = 1, measured=None) -> dict[tuple[int, int], tuple[float, int, float, int]]:
        """(busy seconds, steps, idle seconds before them, gaps counted) of each tag with at
        least `min_steps` steps since it was last taken (with `measured` given: a tag not in
        it, measured for the first time, needs one); those are cleared, the others keep
        adding up. A step's gap is the host time the device waited for it (its own staging,
        the previous step's commit): host work that grows with the step's K."""
        def ready(tag, steps):
            return steps >= min_steps or (measured is not None and tag not in measured)
        out = {tag: tuple(cell) for tag, cell in self.by_tag.items() if ready(tag, cell[1])}
        for tag in out:
            del self.by_tag[tag]
        return out
