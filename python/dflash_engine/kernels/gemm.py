"""Batch-invariant GEMM (Triton): the exact mode's Linear layers and logits on the GPU.

Twin: `dflash_engine.ops.gemm.matmul`.

Why a GEMM of our own: cuBLAS picks its kernel (tile shape, split-K, stream-K) from the
problem size, M included, so a row of x gets different bits when it is multiplied alone
(decode: one row per request) and inside a bigger M (verify: B rows per request, or other
requests beside it). Here every call runs the same compiled kernel whatever M:

- one fixed tile (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages); M only sets the grid;
- no split-K: one program owns an output tile and walks K in ascending BLOCK_K steps,
  accumulating in float32, so an output element's sum order is a function of K alone;
- rows beyond M are masked loads (zeros) that no real row reads;
- `M` is not specialised by Triton (a value of 1 or a multiple of 16 would otherwise compile
  a separate variant, with no promise that it rounds the same).

A row's result is therefore bit-identical whatever M and whatever rows share its tile. Bias
is added to the float32 accumulator, then one rounding to the output dtype: the input's, or
float32 for the logits (the sampler reads float32 logits; rounding them to bf16 first would
make ties and near-ties depend on that rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["matmul", "TILE"]

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). One tile for every shape: changing it
# per call (by M) is exactly what would break invariance. A tile chosen from the weight's
# shape (N, K) alone would keep it; 64-wide N keeps a decode GEMM (M <= 64: one row of
# tiles) spread over N/64 programs, enough to stream a Qwen3-8B weight over most SMs.
TILE = (64, 64, 64, 4, 3)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # N tiles on axis 0: consecutive programs share an x tile and read neighbouring weight rows.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = (k0 * BLOCK_K + offs_k) < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :],
    )


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype | None = None
           ) -> Tensor:
    """x ``[..., K]`` @ weight.T (weight ``[N, K]``, nn.Linear's layout) (+ bias ``[N]``) ->
    ``[..., N]`` in `out_dtype` (default: x's dtype). x and weight share a dtype (bf16, fp16 or
    fp32); products accumulate in float32. Each row's bits are independent of how many rows
    x has. Capturable: the grid depends on shapes only."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply")
    if x.dtype != weight.dtype:
        raise ValueError(f"x dtype {x.dtype} != weight dtype {weight.dtype}")
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:  # an empty sum: the bias alone
        out.zero_()
        return (out if bias is None else out.add_(bias)).view(*lead, n)
    block_m, block_n, block_k, num_warps, num_stages = TILE
    # fp32 (tests, the interpreter, fp32 models): exact fp32 products, as cuBLAS without TF32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, out,
        m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    return out.view(*lead, n)
