"""Skinny GEMM (Triton): x [M, K] @ weight.T for few rows (M <= 64), the decode and
small-batch verify shape, where the step is a stream of weight bytes (issue 22, item 1).

The engine uses it only where it measured faster than cuBLAS on the device it runs on:
`ops/gemm_tuning.py` times both for every (weight shape, M bucket) the step calls, before the
graphs are captured, and `ops.dispatch.linear` follows those picks. (Run 41 measured an
earlier version whose loads Triton could neither vectorise nor pipeline, slower than cuBLAS
at every Qwen3-8B shape; fixed since: see the K loop.)

Twin: `torch.nn.functional.linear` (cuBLAS on the GPU).

At small M a GEMM's cost is reading the weight once: Qwen3-8B's projections are 32-192 MB
of bf16 per layer, and the output is a few rows. Two choices decide how close to the copy
bandwidth a kernel gets:
- enough programs in flight on every SM: N / BLOCK_N output tiles alone are too few for the
  4096-wide outputs (64 tiles of 64 columns for 132 SMs), so the K dimension is split
  (`split_k` programs per output tile, each walking K / split_k) and the float32 partials
  summed in ascending split order, by a second launch or (`fold_reduce`) by the tile's last
  split to finish (a ticket counter per tile);
- the weight as the MMA's wide operand (`swap_ab`): acc[BLOCK_N, BLOCK_M] = w_tile @ x_tile.T,
  so that the tensor-core instruction's M dimension (64 rows on Hopper's wgmma) is filled
  with weight rows and the few activation rows sit in its narrow N dimension, instead of
  padding x's rows up to the instruction's M.

Every configuration is a function of (N, K) and the M bucket only: a row's bits do not
depend on what other rows share the call within one bucket. `bench/bench_skinny_gemm.py`
sweeps the configurations against cuBLAS on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["SkinnyConfig", "skinny_matmul", "bucket_rows", "MAX_ROWS"]

MAX_ROWS = 64  # the kernel's M: one tile of rows (BLOCK_M >= M)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1  # programs per output tile along K (1: no partials, one launch)
    swap_ab: bool = True
    num_warps: int = 4
    num_stages: int = 4
    # With a split: the last split of each output tile to finish sums the partials (one launch
    # a call); False: a second launch sums them. The same bits either way.
    fold_reduce: bool = False

    def label(self) -> str:
        return (f"n{self.block_n}k{self.block_k}s{self.split_k}{'f' if self.fold_reduce and self.split_k > 1 else ''}"
                f"{'T' if self.swap_ab else 'N'}w{self.num_warps}p{self.num_stages}")


@triton.jit
def _sum_splits(part_ptr, offs, mask, n_split, split_stride, CACHE: tl.constexpr):
    """sum over s of part[s * split_stride + offs], in split order from zero (float32): the one
    order of the reduce kernel and of the folded reduce, so the two give the same bits."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for s in range(n_split):
        total += tl.load(part_ptr + s * split_stride + offs, mask=mask, other=0.0, cache_modifier=CACHE)
    return total


@triton.jit
def _finish(acc, b_ptr, out_ptrs, offs_n, n_ok, mask, HAS_BIAS: tl.constexpr):
    """out = acc (+ bias over the columns offs_n), rounded once to the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "k_per_split"])
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FOLD: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # k_per_split is a multiple of BLOCK_K: telling the compiler so keeps the loads 16-byte
    # vectors (unknown alignment made them 2-byte scalar loads, which Triton cannot pipeline).
    k_lo = tl.multiple_of(pid_s * k_per_split, BLOCK_K)
    k_hi = tl.minimum(k_lo + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :] * stride_wk
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # Whole K blocks first, masked by row only (a mask constant along K keeps the weight's
    # copies asynchronous and pipelined), then a ragged last block, if any, masked along K.
    n_full = tl.maximum(k_hi - k_lo, 0) // BLOCK_K
    for _ in range(n_full):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if k_lo + n_full * BLOCK_K < k_hi:
        k_ok = (k_lo + n_full * BLOCK_K + offs_k) < k_hi
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if SPLIT:
        # Partials [split, BLOCK_M, N] in float32; the reduce adds them in split order.
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_s.to(tl.int64) * BLOCK_M * N + tile, acc, mask=mask)
        if FOLD:
            # The reduce folded in: the last split of this output tile to finish (a ticket from
            # the tile's counter, which it zeroes again for the next launch) sums the partials,
            # in split order from zero as `_reduce_kernel` does: the same bits.
            tl.debug_barrier()  # every thread's partial stores issued before the release
            if tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
                tl.store(count_ptr + pid_n, 0)
                total = _sum_splits(part_ptr, tile, mask, tl.num_programs(1), BLOCK_M * N, ".cg")
                _finish(total, b_ptr, out_ptrs, offs_n, n_ok, mask, HAS_BIAS)
    else:
        _finish(acc, b_ptr, out_ptrs, offs_n, n_ok, mask, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def _reduce_kernel(
    part_ptr, b_ptr, out_ptr, M, N, stride_om, stride_on,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = _sum_splits(part_ptr + row * N, offs, ok, SPLIT_K, BLOCK_M * N, "")
    _finish(acc, b_ptr, out_ptr + row * stride_om + offs * stride_on, offs, ok, ok, HAS_BIAS)


# Ticket counters of the folded reduce: one per output tile of a call, zero between launches
# (each tile's last split zeroes its own). A call with more tiles, or a first fold during a
# graph capture (the buffer is allocated outside captures), launches the reduce instead.
_FOLD_COUNTERS = 1 << 14
_fold_counter_buffers: dict[torch.device, Tensor] = {}


def _fold_counters(device: torch.device, needed: int) -> Tensor | None:
    buf = _fold_counter_buffers.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _fold_counter_buffers[device] = torch.zeros(_FOLD_COUNTERS, dtype=torch.int32, device=device)
    return buf if needed <= buf.numel() else None


def bucket_rows(m: int) -> int:
    """The kernel's row tile for M rows (its M bucket): the power of two >= max(M, 16)."""
    return max(16, triton.next_power_of_2(m))


def skinny_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, cfg: SkinnyConfig | None = None,
                  out: Tensor | None = None) -> Tensor:
    """x ``[M, K]`` (M <= MAX_ROWS) @ weight.T (weight ``[N, K]``, nn.Linear's layout) (+ bias)
    -> ``[M, N]`` in x's dtype, float32 accumulation. `cfg` (default SkinnyConfig()) picks the
    tiles and the split of K. Capturable: the grid and the partial buffer depend on shapes only."""
    cfg = cfg or SkinnyConfig()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if x.dtype != weight.dtype:
        raise ValueError(f"x dtype {x.dtype} != weight dtype {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {m}")
    if cfg.split_k < 1 or cfg.block_k < 16 or cfg.block_n < 16:
        raise ValueError(f"bad config {cfg}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)
    block_m = bucket_rows(m)
    # Each split walks a whole number of BLOCK_K steps; trailing splits may be empty (they
    # write zero partials, which the reduce adds like any other).
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cfg.split_k > 1
    part = torch.empty((cfg.split_k, block_m, n), dtype=torch.float32, device=x.device) if split else out
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    tiles = triton.cdiv(n, cfg.block_n)
    counters = _fold_counters(x.device, tiles) if split and cfg.fold_reduce else None
    _skinny_kernel[(tiles, cfg.split_k)](
        x, weight, bias if bias is not None else weight, out, part, out if counters is None else counters,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, SPLIT=split, FOLD=counters is not None, SWAP_AB=cfg.swap_ab,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split and counters is None:
        block = 1024
        _reduce_kernel[(triton.cdiv(n, block), m)](
            part, bias if bias is not None else part, out, m, n, out.stride(0), out.stride(1),
            SPLIT_K=cfg.split_k, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK=block,
        )
    return out
