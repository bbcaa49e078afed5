"""Which kernel each few-row GEMM runs: cuBLAS, or the skinny Triton GEMM where it measured
faster on this device (issue 22, item 1).

At M <= 64 rows a projection's cost is reading its weight once, and which kernel reads it
fastest depends on the GPU, the shape and the row count: cuBLAS reads Qwen3-8B's gate_up at
the copy rate but its qkv and o_proj at 71-75% (run 44's profile). So, like PyTorch's
TunableOp, the choice is measured, not guessed:

1. `recording()`: while the step runs eagerly once per captured shape (before the graphs are
   captured), `pick` notes every eligible call: the key (device, N, K, dtype, M) and the
   weights it read (the model's own layers, not copies).
2. `tune(seen)`: for each key, cuBLAS and every candidate configuration are timed over those
   weights, in a CUDA graph (a step's launches, without their launch cost), the median of
   several replays. The skinny kernel is picked only where it beats cuBLAS by `MARGIN`.
3. `pick(x, weight)` (from `ops.dispatch.linear`): the picked configuration, or None
   (cuBLAS) for anything not tuned: other row counts, eager steps, other devices.

Opt-in (`EngineConfig.tune_gemms`, `--tune-gemms`): on an H100 (run 45, docs/perf.md) no
spec-on shape of Qwen3-8B ran faster on the skinny kernel, and the tuning added 25-40 s to
startup. While nothing is tuned or recording, `pick` returns at its first line.

Invariant: a pick never changes which function is computed, only the summation order of a
default-mode (not batch-invariant) GEMM; the exact mode never comes here. The picks live for
the process (one table, like TunableOp's), keyed by device index, so a second engine on the
same GPU reuses them.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from ..kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_matmul  # (imported on the kernel path only)

logger = logging.getLogger(__name__)

# The configurations timed against cuBLAS (tiles, split of K, pipeline stages). Kept short:
# each tile shape compiles once per row bucket at startup (the split's count is a runtime
# argument of the main kernel; its reduce compiles once per count).
CANDIDATES: tuple[SkinnyConfig, ...] = (
    SkinnyConfig(block_n=64, block_k=128, split_k=1, num_stages=4),
    SkinnyConfig(block_n=64, block_k=128, split_k=2, num_stages=4),
    SkinnyConfig(block_n=64, block_k=128, split_k=2, num_stages=4, fold_reduce=True),
    SkinnyConfig(block_n=64, block_k=128, split_k=4, num_stages=4),
    SkinnyConfig(block_n=64, block_k=128, split_k=4, num_stages=4, fold_reduce=True),
    SkinnyConfig(block_n=64, block_k=128, split_k=8, num_stages=4, fold_reduce=True),
    SkinnyConfig(block_n=128, block_k=128, split_k=1, num_stages=4),
    SkinnyConfig(block_n=128, block_k=128, split_k=2, num_stages=4, fold_reduce=True),
    SkinnyConfig(block_n=64, block_k=256, split_k=2, num_stages=3, fold_reduce=True),
    # At 64 rows every 4-warp tile above spills registers (bench/kernel_regs.py with the
    # device's Triton 3.6: 1.4-9 KB); these two do not (197 and 250 registers). Run 51 (H100,
    # bench_skinny_gemm --rows 64): 8 warps beat the 4-warp tiles 2-3x but not cuBLAS (x0.85-0.86
    # on qkv and o_proj), so the tuning keeps cuBLAS there; kept for shapes where they may win.
    SkinnyConfig(block_n=64, block_k=128, split_k=2, num_warps=8, num_stages=4, fold_reduce=True),
    SkinnyConfig(block_n=128, block_k=128, split_k=2, num_warps=8, num_stages=4, fold_reduce=True),
)
MARGIN = 0.97  # the skinny kernel must take <= 97% of cuBLAS's time (timing noise is ~1-2%)
MAX_WEIGHTS = 64  # weights of one key timed in a row (a step's layers: enough to leave L2)


class Key(NamedTuple):
    device: int
    n: int
    k: int
    dtype: torch.dtype
    m: int


_picks: dict[Key, SkinnyConfig | None] = {}
_seen: dict[Key, dict[int, Tensor]] | None = None  # while recording: key -> {id(weight): weight}


def _key(x: Tensor, weight: Tensor) -> Key | None:
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0
            or x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        return None
    return Key(x.device.index if x.is_cuda else -1, weight.shape[0], weight.shape[1], x.dtype, x.shape[0])


def pick(x: Tensor, weight: Tensor) -> SkinnyConfig | None:
    """The skinny configuration tuned for this call's shape, or None (cuBLAS)."""
    if _seen is None and not _picks:  # nothing tuned (the default): no key to build per call
        return None
    key = _key(x, weight)
    if key is None:
        return None
    if _seen is not None:
        _seen.setdefault(key, {}).setdefault(id(weight), weight)
    return _picks.get(key)


@contextlib.contextmanager
def recording() -> Iterator[dict[Key, dict[int, Tensor]]]:
    """Note every eligible GEMM that runs inside (key -> the weights it read)."""
    global _seen
    outer, _seen = _seen, {}
    try:
        yield _seen
    finally:
        _seen = outer


def picks() -> dict[Key, SkinnyConfig | None]:
    """A copy of the table (for reports and tests)."""
    return dict(_picks)


def clear() -> None:
    _picks.clear()


Timer = Callable[[Callable[[int], object], int, torch.device], float]


def time_graph_us(fn_for: Callable[[int], object], copies: int, device: torch.device, passes: int = 4,
                  replays: int = 5) -> float:
    """Median us per call of fn_for(i), i over `copies` weights, captured `passes` x `copies`
    times in one CUDA graph (so launch costs, which a replayed step does not pay, are not
    timed); on CPU, one eager pass."""
    for i in range(copies):
        fn_for(i)  # compile / warm up outside the capture
    if device.type != "cuda":
        t0 = time.perf_counter()
        for i in range(copies):
            fn_for(i)
        return (time.perf_counter() - t0) / copies * 1e6
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(passes):
            for i in range(copies):
                fn_for(i)
    torch.cuda.current_stream(device).wait_stream(s)
    g.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize(device)
        times.append(a.elapsed_time(b) * 1e3 / (passes * copies))
    del g
    return statistics.median(times)


@torch.inference_mode()
def tune(seen: dict[Key, dict[int, Tensor]], timer: Timer = time_graph_us,
         candidates: tuple[SkinnyConfig, ...] = CANDIDATES) -> dict[Key, SkinnyConfig | None]:
    """Time cuBLAS and each candidate for every key in `seen` not yet tuned; record and return
    the picks. A candidate that fails (does not compile, does not fit) is skipped."""
    import torch.nn.functional as F

    t0 = time.perf_counter()
    new: dict[Key, SkinnyConfig | None] = {}
    for key, by_id in seen.items():
        if key in _picks:
            continue
        weights = list(by_id.values())[:MAX_WEIGHTS]
        device = weights[0].device
        x = torch.randn(key.m, key.k, device=device, dtype=torch.float32).to(key.dtype)
        best_us, best = timer(lambda i: F.linear(x, weights[i]), len(weights), device), None
        cublas_us = best_us
        for cfg in candidates:
            try:
                us = timer(lambda i, cfg=cfg: skinny_matmul(x, weights[i], None, cfg), len(weights), device)
            except Exception as e:  # noqa: BLE001  (a configuration this device cannot run: skip it)
                logger.debug("skinny GEMM %s on %s failed: %s", cfg.label(), key, e)
                continue
            if us < best_us and us <= MARGIN * cublas_us:
                best_us, best = us, cfg
        new[key] = _picks[key] = best
        logger.debug("GEMM N=%d K=%d M=%d: cuBLAS %.1f us, %s", key.n, key.k, key.m, cublas_us,
                     f"skinny {best.label()} {best_us:.1f} us" if best else "kept")
    if new:
        won = sum(cfg is not None for cfg in new.values())
        logger.info("tuned %d few-row GEMM shapes in %.1f s: the skinny kernel for %d, cuBLAS for %d",
                    len(new), time.perf_counter() - t0, won, len(new) - won)
    return new
