"""The fast CPU backend's GEMM weights (`cpu_weights`, docs/perf.md "CPU weight formats").

A CPU decode step is bound by the weight GEMMs, and a float32 GEMV of one row reads 4 bytes per
weight. Two packed forms, each a copy made once at install beside the model's parameter (which
stays the source of truth: the exact mode never sees the packed copies):

- bf16: the weight in bfloat16, reordered once by oneDNN into its blocked GEMM layout
  (`mkldnn._reorder_linear_weight`; AVX512-BF16 where the CPU has it). Used for every GEMM of
  a packed layer that the int4 form does not take. Lossless for a bf16 checkpoint.
- int4: for weights that lie exactly on a 4-bit affine grid in groups of 32 along the input
  dimension -- what a Q4_0/Q4_1 GGUF dequantises to (the embedded SmolLM2's layers are Q4_1) --
  the 4-bit codes plus a bf16 scale and zero per group (`_weight_int4pack_mm_for_cpu`). A weight
  not on such a grid (checked element by element) gets no int4 form. Used for GEMMs of at most
  `INT4_MAX_ROWS` rows (a decode step, a short verify block): there it reads 1/8 of float32's
  bytes; past that oneDNN's bf16 GEMM is faster.

Either way the GEMM's input is rounded to bfloat16 and its output (bf16) is returned in the
input's dtype: activations, norms, attention and the KV cache keep the model's dtype. Format
"none" packs nothing: the weight is stored column-major and run by `fast_linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

GROUP = 32  # int4 group size along the input dimension (GGUF's Q4_0/Q4_1 block)
INT4_MAX_ROWS = 6  # rows up to which the int4 GEMM beats oneDNN's bf16 one (2-core Zen4, docs/perf.md)
_BF16_PACK_ROWS = 16  # the row count oneDNN's weight reorder is tuned for (fast from 1 to 16 rows)
FORMATS = ("auto", "none", "bf16", "int4")  # what `cpu_weights` may ask for ("auto": resolve_format)


def _mkldnn_bf16() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int4_available() -> bool:
    return hasattr(torch, "_convert_weight_to_int4pack_for_cpu") and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def int4_grid(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor] | None:
    """(codes [N, K] int32 in 0..15, scale [N, K/group], min [N, K/group]) with
    weight == codes * scale + min (to a thousandth of a step) for every element, or None when
    `weight` is not on such a grid. The grid of each group is its min and (max - min) / 15: a
    Q4_1 block's extremes are codes 0 and 15 (llama.cpp quantises to the block's own range)."""
    n, k = weight.shape
    if k % group or weight.dtype != torch.float32:
        return None
    w = weight.detach().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((w - lo[..., None]) / safe[..., None]).round_().clamp_(0, 15)
    err = (codes * scale[..., None] + lo[..., None] - w).abs()
    if bool((err > 1e-3 * safe[..., None] + 1e-12).any()):
        return None
    return codes.reshape(n, k).to(torch.int32), scale, lo


def int4_round(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor] | None:
    """`int4_grid`'s (codes, scale, min) for any weight: each group of `group` inputs rounded to
    the nearest of 16 steps spanning its own range (lossy: at most half a step, (max - min) / 30,
    per element). None when the input dimension is not whole groups."""
    n, k = weight.shape
    if k % group:
        return None
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((w - lo[..., None]) / safe[..., None]).round_().clamp_(0, 15)
    return codes.reshape(n, k).to(torch.int32), scale, lo


class PackedWeight:
    """A [N, K] weight's packed forms; `__call__(x [M, K])` -> x @ weight.T in x's dtype.

    int4=True packs an int4 form where the weight lies on a 4-bit grid (exact); `rounded=True`
    packs one for any weight, rounded to the grid (`int4_round`: lossy, for GEMMs whose result is
    only a guess: a draft's). bf16=False packs no bf16 form (every row count then runs int4)."""

    def __init__(self, weight: Tensor, int4: bool, rounded: bool = False, bf16: bool = True):
        self.shape = tuple(weight.shape)
        self.mkldnn = _mkldnn_bf16()
        self.int4: tuple[Tensor, Tensor] | None = None
        # The int4 packing takes N in multiples of 16 (and K in whole groups: int4_grid).
        packable = (int4 or rounded) and int4_available() and weight.shape[0] % 16 == 0
        grid = (int4_round(weight) if rounded else int4_grid(weight)) if packable else None
        if grid is not None:
            codes, scale, lo = grid
            # The kernel computes (code - 8) * scale + zero: zero = min + 8 * scale.
            zeros = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
            self.int4 = (torch._convert_weight_to_int4pack_for_cpu(codes, 2), zeros)
        self.int4_only = self.int4 is not None and not bf16
        self.bf16 = None
        if not self.int4_only:
            w16 = weight.detach().to(torch.bfloat16).contiguous()
            self.bf16 = torch.ops.mkldnn._reorder_linear_weight(w16, _BF16_PACK_ROWS) if self.mkldnn else w16

    @property
    def format(self) -> str:
        return "int4" if self.int4 is not None else "bf16"

    def __call__(self, x: Tensor) -> Tensor:
        xb = x.to(torch.bfloat16)
        if self.int4 is not None and (xb.shape[0] <= INT4_MAX_ROWS or self.int4_only):
            out = torch._weight_int4pack_mm_for_cpu(xb, self.int4[0], GROUP, self.int4[1])
        elif self.mkldnn:
            out = torch.ops.mkldnn._linear_pointwise(xb, self.bf16, None, "none", [None], "")
        else:
            out = F.linear(xb, self.bf16)
        return out.to(x.dtype)


_SPLIT_MAX_ROWS = 4  # fast_linear splits the weight across threads up to this many rows


def column_major(weight: Tensor) -> Tensor:
    """The same [out, in] matrix over transposed memory: a one-row GEMM then streams the weight
    as a plain [in, out] matrix, ~1.7x the bandwidth BLAS reaches on the row-major one."""
    return weight if weight.stride(0) == 1 else weight.t().contiguous().t()


def fast_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear for an unpacked weight. A GEMM of a few rows (a decode step) is bound by reading
    the weight, and BLAS runs it on one thread. With a column-major weight (`column_major`) and T
    threads, the input dimension is cut into T contiguous slabs of the weight, run as one batched
    GEMM (parallel over the slabs, each thread streaming its own contiguous part of the weight)
    and summed: ~1.6x the single-thread bandwidth on the 2-core dev VM."""
    threads = torch.get_num_threads()
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if (threads > 1 and 0 < m <= _SPLIT_MAX_ROWS and x.device.type == "cpu" and weight.stride(0) == 1
            and k % threads == 0 and weight.numel() >= (1 << 16) * threads):
        slabs = weight.t().view(threads, k // threads, weight.shape[0])  # [T, K/T, N], a view
        parts = torch.bmm(x.reshape(m, threads, k // threads).transpose(0, 1), slabs)  # [T, M, N]
        out = parts[0]
        for i in range(1, threads):
            out = out.add_(parts[i])
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


class Gemm:
    """One GEMM of the fast path, x [M, K] -> x @ weight.T (+ bias): through the weight's packed
    form when it has one, else `fast_linear` over the (column-major) weight itself. A plain
    object (no nn.Module call overhead: the decode step makes ~5 of these calls per layer)."""

    __slots__ = ("packed", "weight", "bias")

    def __init__(self, weight: Tensor, bias: Tensor | None, packed: PackedWeight | None):
        self.weight, self.bias, self.packed = weight, bias, packed

    @property
    def format(self) -> str:
        """"int4", "bf16", or "none" (the weight in the model's dtype)."""
        return "none" if self.packed is None else self.packed.format

    def __call__(self, x: Tensor) -> Tensor:
        packed = self.packed
        if packed is None:
            return fast_linear(x, self.weight, self.bias)
        out = packed(x)
        return out if self.bias is None else out.add_(self.bias)


def make_gemm(weight: Tensor, bias: Tensor | None, fmt: str, rounded: bool = False) -> Gemm:
    """The fast path's GEMM of one weight in format `fmt` ("none", "bf16", "int4": int4 where the
    weight is on a 4-bit grid, every weight rounded to one with `rounded`). "none" expects the
    weight already column-major (`column_major`: the caller swaps the parameter's storage)."""
    if fmt == "none":
        return Gemm(weight, bias, None)
    if fmt not in ("bf16", "int4"):
        raise ValueError(f"cannot pack CPU weights as {fmt!r}")
    with torch.no_grad():
        packed = PackedWeight(weight, int4=fmt == "int4", rounded=rounded and fmt == "int4")
    return Gemm(weight, bias, packed)
