"""What crosses from the driver to the workers each step: the plan's arrays and the sampling
arrays, once, as two broadcasts on the control group (gloo, CPU tensors).

    header   int64[64]  kind (STEP / STOP), step sequence number, payload bytes, all_greedy,
                        the plan's ints (len, block_rows, num_decode, num_rows, draft_rows),
                        then each array's shape (rows, columns or -1)
    payload  uint8[n]   every array's bytes in FIELDS order, each padded to 8 bytes

The fields are exactly what a step reads of a plan (`StepInputs.from_plan`, ModelRunner's
eager launch) and the sampling parameters, one value per request (`RequestParams`; the
worker's step expands rows where it reads them); each has a fixed dtype, so
the header carries shapes only. A worker rebuilds a `WirePlan` (the same attributes as the
core's StepPlan) and runs the same step. Sequence numbers make a skipped or repeated step an
error on the worker, so the ranks never run different plans. Results never come back: every
rank computes the same tokens and the driver uses its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .. import _core
from ..worker.sampling_batch import DTYPES, RequestParams, SamplingBatch
from ..worker.sampling_batch import FIELDS as SAMPLING_FIELDS

STEP, STOP = 1, 2
HEADER = 64
PLAN_INTS = ("block_rows", "num_decode", "num_rows", "draft_rows")
PLAN_ARRAYS = (
    ("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
    ("query_start_loc", np.int32), ("seq_lens", np.int32), ("page_tables", np.int32),
    ("sample_rows", np.int64), ("sample_start", np.int64), ("verify_target_rows", np.int64),
    ("draft_input_ids", np.int64), ("draft_positions", np.int64), ("draft_slot_mapping", np.int64),
    ("draft_query_start_loc", np.int32), ("draft_seq_lens", np.int32), ("draft_page_tables", np.int32),
    ("draft_proposal_rows", np.int64), ("state_read", np.int64), ("state_write", np.int64),
)
# One value per request (RequestParams; the worker expands rows where its step reads them).
SAMPLING_ARRAYS = tuple((name, DTYPES[name]) for name in SAMPLING_FIELDS)
FIELDS = PLAN_ARRAYS + SAMPLING_ARRAYS
_INTS_AT = 4  # header[0:4] = kind, seq, payload bytes, all_greedy; then len(plan) and PLAN_INTS
_SHAPES_AT = _INTS_AT + 1 + len(PLAN_INTS)
assert _SHAPES_AT + 2 * len(FIELDS) <= HEADER


class WirePlan:
    """A worker's copy of the driver's plan: the attributes a step reads, and len()."""

    def __init__(self, num_entries: int, ints: dict[str, int], arrays: dict[str, np.ndarray]):
        self._len = num_entries
        self.__dict__.update(ints)
        self.__dict__.update(arrays)

    def __len__(self) -> int:
        return self._len

    @property
    def max_pages(self) -> int:
        """Columns of the page tables (the core StepPlan's attribute)."""
        return self.page_tables.shape[1]

    def stage_into(self, dst: np.ndarray, fields: list[tuple[str, int, int, int | None]],
                   pages: tuple[int, int, int, int] | None = None) -> None:
        """The core StepPlan's `stage_into` (the same core function, over these arrays): the
        graph runner stages a worker's copy of the plan the way the driver stages its own."""
        _core.stage_arrays(dst, [(name, getattr(self, name), at, total, pad) for name, at, total, pad in fields],
                           None if pages is None else (np.ascontiguousarray(self.page_tables, np.int32), *pages))


@dataclass
class Step:
    seq: int
    plan: WirePlan
    st: SamplingBatch
    all_greedy: bool


def _padded(n: int) -> int:
    return n + (-n) % 8


def pack(seq: int, plan, st: SamplingBatch, all_greedy: bool) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) of one step."""
    header = np.zeros(HEADER, np.int64)
    arrays = [np.ascontiguousarray(getattr(plan, name), dtype) for name, dtype in PLAN_ARRAYS]
    arrays += [np.ascontiguousarray(st.params.values[name], dtype) for name, dtype in SAMPLING_ARRAYS]
    payload = np.zeros(sum(_padded(a.nbytes) for a in arrays), np.uint8)
    off = 0
    for i, a in enumerate(arrays):
        if a.ndim not in (1, 2):
            raise ValueError(f"step field {FIELDS[i][0]} has {a.ndim} dims (1 or 2 cross)")
        header[_SHAPES_AT + 2 * i: _SHAPES_AT + 2 * i + 2] = a.shape if a.ndim == 2 else (a.shape[0], -1)
        payload[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        off += _padded(a.nbytes)
    header[:_SHAPES_AT] = [STEP, seq, payload.nbytes, int(all_greedy), len(plan),
                           *(int(getattr(plan, k)) for k in PLAN_INTS)]
    return header, payload


def unpack(header: np.ndarray, payload: np.ndarray) -> Step:
    arrays, off = {}, 0
    for i, (name, dtype) in enumerate(FIELDS):
        rows, cols = (int(x) for x in header[_SHAPES_AT + 2 * i: _SHAPES_AT + 2 * i + 2])
        shape = (rows,) if cols < 0 else (rows, cols)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        arrays[name] = payload[off:off + n].view(dtype).reshape(shape)
        off += _padded(n)
    ints = dict(zip(PLAN_INTS, (int(x) for x in header[_INTS_AT + 1:_SHAPES_AT])))
    plan = WirePlan(int(header[_INTS_AT]), ints, {k: arrays[k] for k, _ in PLAN_ARRAYS})
    params = RequestParams({k: arrays[k] for k, _ in SAMPLING_ARRAYS}, plan.sample_start)
    return Step(int(header[1]), plan, SamplingBatch(params, plan), bool(header[3]))


def _broadcast(t: torch.Tensor, group) -> None:
    dist.broadcast(t, group=group, group_src=0)


def send_step(group, seq: int, plan, st: SamplingBatch, all_greedy: bool) -> None:
    """The driver: broadcast one step to every worker."""
    header, payload = pack(seq, plan, st, all_greedy)
    _broadcast(torch.from_numpy(header), group)
    if payload.nbytes:
        _broadcast(torch.from_numpy(payload), group)


def send_stop(group, seq: int) -> None:
    """The driver: tell every worker to exit its loop."""
    header = np.zeros(HEADER, np.int64)
    header[:2] = [STOP, seq]
    _broadcast(torch.from_numpy(header), group)


def receive_step(group, expected_seq: int) -> Step | None:
    """A worker: the next step (None: stop). A step out of sequence is an error."""
    header = torch.empty(HEADER, dtype=torch.int64)
    _broadcast(header, group)
    h = header.numpy()
    if h[0] == STOP:
        return None
    if h[0] != STEP or h[1] != expected_seq:
        raise RuntimeError(f"tensor-parallel step message out of order: kind {h[0]}, step {h[1]}, "
                           f"expected step {expected_seq}")
    payload = torch.empty(int(h[2]), dtype=torch.uint8)
    if payload.numel():
        _broadcast(payload, group)
    return unpack(h, payload.numpy())
