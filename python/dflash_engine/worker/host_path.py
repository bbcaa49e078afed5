"""Host time on the critical path between two engine steps, by phase (issue 22, item 4).

The device waits for the host from the moment a step's results are back (the runner's wait
returns: the device has finished, the host has them) to the next step's first device launch.
The step timer (step_timer.py) measures that gap on the device's clock; this splits the
host's side of it into what the host does there, in order:

    commit           the results unpacked, the core's commit
    return           the rest of LLMEngine.step() after the commit (in the synchronous step
                     also the outputs: detokenising, request state)
    between_steps    step() returned -> the next step() call: the caller's work (the server's
                     EngineLoop: new requests, aborts, the stats snapshot)
    schedule         the core's schedule
    sampling_arrays  the per-row sampling parameters of the plan
    stage            the runner's launch up to the first device launch (graph choice, packing
                     the plan into the pinned buffers)

The overlapped step waits for its step at the start of the next call, so "return" and
"between_steps" run while the device works: they count only in the synchronous step, or
when something between two calls landed the step in flight (an abort: engine.py).

The device-side idle minus the sum of these is what the host does not see: the wake-up after
the device finished (event synchronisation), the launch latency, and host work overlapped with
a step that outlasted it. That last one is `overlapped`: the seconds the overlapped step spends
on the previous step's outputs (detokenising, handing them to the server) while the device
runs; more than a step's busy time there and the device waits for it too.

Invariant (the same as the step timer's idle): only a gap between two steps with work in
between is counted. `start()` opens a gap when results come back; `finish()` closes it at
the next first launch; `cancel()` (the engine is idle, a step failed) drops an open gap,
so time spent waiting for requests never counts. Each mark costs one clock read.
"""
from __future__ import annotations

import time

PHASES = ("commit", "return", "between_steps", "schedule", "sampling_arrays", "stage")


class HostPath:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.gaps = 0  # gaps closed (each a `start()` .. `finish()`)
        self.overlapped = 0.0  # host seconds on outputs between a launch and its wait
        self._last: float | None = None  # the open gap's latest mark; None: no gap open

    def start(self) -> None:
        """A step's results are back on the host: the device is waiting from now."""
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The open gap's time since its last mark was spent in `phase` (no gap open: nothing)."""
        if self._last is not None:
            now = time.perf_counter()
            self.seconds[phase] += now - self._last
            self._last = now

    def finish(self) -> None:
        """The next step's first device launch: the gap closes (its last part is "stage")."""
        if self._last is not None:
            self.mark("stage")
            self.gaps += 1
            self._last = None

    def cancel(self) -> None:
        self._last = None

    def totals(self) -> dict[str, float]:
        """A copy of the seconds per phase (the engine thread keeps adding to its own)."""
        return dict(self.seconds)
