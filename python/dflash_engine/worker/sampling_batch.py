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
        self.values = {name: np.ascontiguousarray(values[name], DTYPES[name]) for name in FIELDS}
        self.sample_start = np.ascontiguousarray(sample_start, np.int64)
        r = len(self.sample_start) - 1
        bad = [name for name, a in self.values.items() if a.shape != (r,)]
        if bad:
            raise ValueError(f"sampling parameters {bad} need one value for each of {r} requests")
        self.greedy_i64 = self.values["greedy"].astype(np.int64)  # (the graph runner's int64 slots)
        self.all_greedy = bool(self.values["greedy"].all())
        self._rows: dict[str, np.ndarray] = {}

    def rows(self, name: str) -> np.ndarray:
        """Parameter `name` per sample row (made on first read, kept for the batch)."""
        a = self._rows.get(name)
        if a is None:
            a = self._rows[name] = np.repeat(self.values[name], np.diff(self.sample_start))
        return a


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
