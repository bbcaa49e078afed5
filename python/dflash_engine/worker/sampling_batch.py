"""A step's sampling parameters, kept one value per request.

Every sample row of a request shares its parameters, so the engine keeps them per request
(`RequestParams`, built when the batch changes and reused while it stays) and a step sees
them through `SamplingBatch`, a read-only mapping from a parameter's name to its per-row
array. The per-row arrays are made only where a reader asks (the eager step, its profile,
the tensor-parallel worker's eager step): the graph runner stages the per-request values
straight into its slots in one core call (`_core.stage_sampling`), so on the critical path
between two steps nothing is expanded row by row (issue 22, item 4: with requests arriving
and finishing, rebuilding six per-row arrays took ~40 us of a ~140 us host gap on the 2-core
CPU).

Invariant: `RequestParams.values[name][i]` is plan entry i's parameter and `sample_start` the
plan's offsets, so `rows(name)` is exactly what one array per sample row would hold.

The engine keeps every live request's parameters in a `SamplingTable` (a column per field, a
seat per request), so a new batch's RequestParams is one gather per column rather than a
tuple per request turned into six arrays (~14 us for 32 requests on the 2-core CPU, paid at
almost every step of a churning c = 32 ladder, where prefill chunks and arrivals change the
batch).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

FIELDS = ("greedy", "temperature", "top_k", "top_p", "min_p", "seed")
DTYPES = {"greedy": np.bool_, "temperature": np.float32, "top_k": np.int64, "top_p": np.float32,
          "min_p": np.float32, "seed": np.int64}


class RequestParams:
    """The sampling parameters of a batch's requests, one value each, and the rows each
    request samples (`sample_start`: R+1 offsets into the plan's sample rows)."""

    def __init__(self, values: Mapping[str, object], sample_start: np.ndarray):
        missing = [name for name in FIELDS if name not in values]
        if missing:
            raise ValueError(f"sampling parameters lack {missing}")
        self._set({name: np.ascontiguousarray(values[name], DTYPES[name]) for name in FIELDS}, sample_start)
        r = len(self.sample_start) - 1
        bad = [name for name, a in self.values.items() if a.shape != (r,)]
        if bad:
            raise ValueError(f"sampling parameters {bad} need one value for each of {r} requests")

    @classmethod
    def gathered(cls, values: dict[str, np.ndarray], sample_start: np.ndarray) -> RequestParams:
        """From columns already typed, contiguous and one value per request (SamplingTable:
        skips the checks, ~2 us of ~7 for 32 requests)."""
        self = cls.__new__(cls)
        self._set(values, sample_start)
        return self

    def _set(self, values: dict[str, np.ndarray], sample_start: np.ndarray) -> None:
        self.values = values
        self.sample_start = np.ascontiguousarray(sample_start, np.int64)
        self.greedy_i64 = values["greedy"].astype(np.int64)  # (the graph runner's int64 slots)
        self.all_greedy = bool(values["greedy"].all())
        self._rows: dict[str, np.ndarray] = {}

    def rows(self, name: str) -> np.ndarray:
        """Parameter `name` per sample row (made on first read, kept for the batch)."""
        a = self._rows.get(name)
        if a is None:
            a = self._rows[name] = np.repeat(self.values[name], np.diff(self.sample_start))
        return a


class SamplingTable:
    """Each live request's sampling parameters (FIELDS' order), by handle: column arrays with a
    seat per request, seats reused once freed (the table grows when every seat is taken).
    Invariant: `len(self)` is the requests added and not removed."""

    def __init__(self, capacity: int = 64):
        self._cols = {name: np.zeros(capacity, DTYPES[name]) for name in FIELDS}
        self._seat: dict[int, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._seat)

    def add(self, handle: int, row: tuple) -> None:
        if handle in self._seat:
            raise ValueError(f"request handle {handle} already has sampling parameters")
        if not self._free:
            n = len(self._cols["seed"])
            self._cols = {name: np.concatenate([c, np.zeros(n, c.dtype)]) for name, c in self._cols.items()}
            self._free = list(range(2 * n - 1, n - 1, -1))
        seat = self._seat[handle] = self._free.pop()
        for col, value in zip(self._cols.values(), row, strict=True):
            col[seat] = value

    def remove(self, handle: int) -> None:
        seat = self._seat.pop(handle, None)
        if seat is not None:
            self._free.append(seat)

    def params(self, handles: np.ndarray, sample_start: np.ndarray) -> RequestParams:
        """The RequestParams of a plan's requests (`handles`, in plan order) and sample rows."""
        seats = np.fromiter(map(self._seat.__getitem__, handles.tolist()), np.intp, len(handles))
        return RequestParams.gathered({name: col[seats] for name, col in self._cols.items()}, sample_start)


class SamplingBatch(Mapping):
    """One step's sampling arrays: name -> per sample row (FIELDS, and "position": each
    sample row's position + 1, the seeded sampler's counter). `params`: the per-request
    values the graph runner stages."""

    def __init__(self, params: RequestParams, plan):
        self.params = params
        self._plan = plan
        self._position: np.ndarray | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        if name == "position":
            if self._position is None:
                self._position = self._plan.positions[self._plan.sample_rows] + 1
            return self._position
        if name not in DTYPES:
            raise KeyError(name)
        return self.params.rows(name)

    def __iter__(self) -> Iterator[str]:
        return iter((*FIELDS, "position"))

    def __len__(self) -> int:
        return len(FIELDS) + 1
