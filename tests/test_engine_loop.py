"""EngineLoop (server/async_engine.py): commands that arrive while a step runs. New requests
are admitted during the step (the engine's output sink runs while the device computes), so
the gap between steps does not pay for them; aborts and the stop wait for the step boundary,
and every command after them waits too: commands apply in the order they came."""
from __future__ import annotations

from dataclasses import dataclass

from dflash_engine.sampling_params import SamplingParams
from dflash_engine.server.async_engine import _STOP, EngineLoop, _Abort, _Add


@dataclass(eq=False)
class Stream:
    request_id: str
    client_request_id: str | None = None

    def put(self, item) -> None:
        pass


class FakeEngine:
    """Records what the loop does to it; each step runs the output sink mid-step, as the
    overlapped step does between its launch and its wait, and runs `during_step` first."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.live: set[str] = set()
        self.output_sink = None
        self.during_step = None
        self.steps = 0

    def stats(self):
        self.events.append("stats")
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def add_request(self, rid, prompt_token_ids, params, prompt=None) -> None:
        self.events.append(f"add {rid}")
        self.live.add(rid)

    def abort_request(self, rid) -> None:
        self.events.append(f"abort {rid}")
        self.live.discard(rid)

    def step(self):
        self.steps += 1
        self.events.append(f"step {self.steps} launched")
        if self.during_step is not None:
            self.during_step()
            self.during_step = None
        self.output_sink([])
        self.events.append(f"step {self.steps} landed")
        if self.steps >= 3:
            self.live.clear()
        return []


def add(loop: EngineLoop, rid: str) -> Stream:
    s = Stream(rid)
    loop._commands.put(_Add(s, [1, 2, 3], SamplingParams(max_tokens=4), None))
    return s


def test_adds_during_a_step_are_admitted_in_it_aborts_and_what_follows_them_wait_for_the_boundary():
    engine = FakeEngine()
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    a = add(loop, "a")

    def arrivals():  # while step 1 runs: an add, an abort of a, another add
        add(loop, "b")
        loop._commands.put(_Abort(a))
        add(loop, "c")

    engine.during_step = arrivals
    engine.events.clear()  # (the loop's first snapshot, at construction)
    loop._apply_commands(block=False)  # a, at the boundary before step 1
    loop._step()
    # The stats snapshot and b's admission happen while the device runs step 1.
    assert engine.events == ["add a", "step 1 launched", "stats", "add b", "step 1 landed"]
    assert loop._held is not None  # the abort, held for the boundary; c stays queued behind it
    assert loop._apply_commands(block=False)
    assert engine.events[5:] == ["abort a", "add c"]
    assert loop._held is None and loop._commands.empty()


def test_the_stop_waits_for_the_boundary_and_ends_the_loop():
    engine = FakeEngine()
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    add(loop, "a")

    def stop_then_add():
        loop._commands.put(_STOP)
        add(loop, "late")

    engine.during_step = stop_then_add
    engine.events.clear()
    loop._run()  # returns once the stop applies, at the boundary after step 1
    assert engine.events == ["add a", "step 1 launched", "stats", "step 1 landed"]
    assert engine.steps == 1 and "add late" not in engine.events
