"""Weights into L2 ahead of their GEMM, while the memory system idles (Hopper and later).

At small batches a decoder layer's attention block leaves HBM nearly idle: after the qkv
GEMM come q/k-norm + RoPE, the paged attention and its split combine, ~15-20 us of
latency-bound kernels that read a few MB of K/V. The next GEMM, o_proj, then streams its
weight (33.5 MB for Qwen3-8B, which fits the H100's and H200's 50 MB L2) from HBM at 70-80%
of the copy rate, with few enough tiles that it never reaches full bandwidth (docs/perf.md,
run 44 / 45). `ahead(weight)` issues bulk L2 prefetches of that weight on a side stream as
soon as the qkv GEMM is queued, so the attention kernels and the prefetch share the window,
and `join` puts the side stream back into the main one after o_proj (a captured graph must
rejoin its forks; the GEMM itself never waits for the prefetch, which is only a hint:
correctness never depends on it).

Where it would be on (`PREFETCH`, off by default until measured): None: in the capture of a
decode graph within `MAX_BUCKET` requests (kernels/capture_scope.py), where the attention
window is latency-bound; True / False: everywhere / nowhere on a capable GPU (bench_step's A/B switch:
`--ab dflash_engine.kernels.l2_prefetch.PREFETCH`). Never on the interpreter or below sm_90
(`cp.async.bulk.prefetch.L2` is a Hopper instruction). tests/test_kernel_l2_prefetch.py
compiles the kernel for sm_90 on the CPU and reads the PTX.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import capture_scope, pdl

__all__ = ["MAX_BUCKET", "PREFETCH", "active", "ahead", "join"]

# None: decode graphs of at most MAX_BUCKET requests; True / False: everywhere / nowhere.
# False until a device run has timed it (bench_step --ab) and run its GPU test.
PREFETCH: bool | None = False
MAX_BUCKET = 4
# Bytes one bulk prefetch asks for (the asm below spells it): a multiple of 16.
CHUNK = 4096
# Prefetches one program issues (its threads take them in turn): 64 programs for o_proj.
PER_PROGRAM = 128
# The most a layer prefetches: beyond about half the L2 the prefetched lines would evict
# each other (and the K/V the attention reads) before their GEMM runs.
MAX_BYTES = 40 << 20


@triton.jit(do_not_specialize=["base", "last"])
def _prefetch_kernel(base, last, CHUNK_BYTES: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """Bulk-prefetch bytes [base, base + last + CHUNK_BYTES) into L2: chunk i starts at
    min(i * CHUNK_BYTES, last), so every chunk lies inside the tensor."""
    i = tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
    addr = base + tl.minimum(i.to(tl.int64) * CHUNK_BYTES, last)
    tl.inline_asm_elementwise(
        "{ .reg .u64 g; cvta.to.global.u64 g, $1; cp.async.bulk.prefetch.L2.global [g], 4096; mov.u32 $0, 0; }",
        "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1,
    )


_streams: dict[int, torch.cuda.Stream] = {}


def active(device: torch.device) -> bool:
    """Whether `ahead` would prefetch on `device` now."""
    on = capture_scope.within(MAX_BUCKET) if PREFETCH is None else PREFETCH
    return on and pdl.hopper_or_later(device)


def ahead(weight: Tensor) -> torch.cuda.Stream | None:
    """Start prefetching `weight` (contiguous, on a capable GPU) into L2 on a side stream that
    follows everything queued so far; -> that stream, for `join`, or None (nothing started)."""
    if not active(weight.device) or not weight.is_contiguous():
        return None
    nbytes = min(weight.numel() * weight.element_size(), MAX_BYTES)
    if nbytes < CHUNK or nbytes % 16:
        return None
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    side = _streams.get(index)
    if side is None:
        side = _streams[index] = torch.cuda.Stream(weight.device)
    main = torch.cuda.current_stream(weight.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        chunks = triton.cdiv(nbytes, CHUNK)
        _prefetch_kernel[(triton.cdiv(chunks, PER_PROGRAM),)](
            weight.data_ptr(), nbytes - CHUNK, CHUNK_BYTES=CHUNK, PER_PROGRAM=PER_PROGRAM, num_warps=1,
        )
    return side


def join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for `side` (from `ahead`) from here on."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
