"""Which step graph is being captured: the decode bucket (decoding requests) and target rows
of the graph the graph runner is capturing, or None (eager launches, mixed-step graphs).

Launch-time choices that pay only for small batches read it: programmatic dependent launch
(kernels/pdl.py). One place sets it (GraphRunner._capture_one), so a graph's
choices are fixed when it is captured and every replay runs them.
"""
from __future__ import annotations

import contextlib

__all__ = ["decode_bucket", "for_bucket", "within"]

_bucket: tuple[int, int] | None = None


@contextlib.contextmanager
def for_bucket(bs: int, rows: int, mixed: bool = False):
    """Launches inside belong to the capture of decode bucket `bs` with `rows` target rows
    (`mixed`: a mixed step's graph, which counts as no decode bucket)."""
    global _bucket
    was, _bucket = _bucket, None if mixed else (bs, rows)
    try:
        yield
    finally:
        _bucket = was


def decode_bucket() -> tuple[int, int] | None:
    """(decoding requests, target rows) of the decode graph being captured, or None."""
    return _bucket


def within(max_bucket: int, max_rows: int | None = None) -> bool:
    """Whether a decode graph of at most `max_bucket` requests (and `max_rows` target rows) is
    being captured: the rule the small-batch launch choices share."""
    if _bucket is None:
        return False
    return _bucket[0] <= max_bucket and (max_rows is None or _bucket[1] <= max_rows)
