"""CUDA-graph-capturable sampling and acceptance; references: `dflash_engine.ops.sampling`.

`sample` returns, for the same inputs, the tokens of `sampler.sample`: greedy rows take
the argmax (first index of the maximum); random rows scale by temperature, keep the
prefix of the stably sorted (value descending, index ascending) vocabulary that top-k,
top-p and min-p leave, and invert that prefix's CDF at ONE uniform per row drawn from
`uniform_from(seed, position)` (the same 32-bit hash, reproduced bit-exactly inside the
Triton kernel). Tokens can differ from the reference only at near-ties (a float sum
landing within rounding of a top-p boundary or of the drawn point).

No host synchronisation, no data-dependent shapes: every launch has a static grid, and a
row's work inside the kernel ends early where its filters end, so a step can be captured
in a `torch.cuda.CUDAGraph` and replayed with the same tokens as in eager mode. A row's
token depends only on its own logits and parameters, never on the rest of the batch.

Strategy (the choice is the caller's, from what the host already knows; each is one
captured-graph variant):
  * `all_greedy=True`: nothing samples in this step -> one torch.argmax, nothing else.
  * `max_top_k=K` (K < vocab), when every random row has top_k <= K: the exact top-K of the
    stable order (`stable_topk`: torch.topk, a Triton pass fixing the boundary tie group,
    a sort of the K candidates), then the sampling kernel over those K. No full sort.
  * otherwise: a full stable sort of the scaled logits (torch.sort, as the reference does),
    then the same kernel, which reads one pass for the softmax normaliser, one for the kept
    mass (stopping where top-p / min-p provably drop everything after) and the prefix up
    to the drawn point.
A random row with top_k > max_top_k is treated as top_k = max_top_k (the caller's
contract is to pass a bound that holds).

Measured on the H200 (V = 151,936, CUDA-graph replay): at N = 512 rows greedy 96 us,
top-k path 1.5 ms (torch.topk alone 0.97 ms), sort path 5.9-6.6 ms (torch.sort alone
5.5 ms), the eager reference sampler.sample 9.5 ms; at N = 16: 12 us, 0.22 ms, 0.28-0.41 ms.
torch's topk/sort dominate: the next step is a Triton selection (radix select over the
float bits) producing a capped candidate prefix, with an in-kernel exact fallback for the
rare row whose kept set or drawn point lies past the cap.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096  # sampling kernel tile (ranks per iteration), at most
_SCAN_BLOCK = 4096  # tie-fix scan tile
_TOP_P_MARGIN = 1e-6  # stop scanning once the running mass passed top_p by more than this
# Rows per program off the GPU (Triton's interpreter pays per operation, not per element).
# Fixed, so that a row's arithmetic never depends on the batch around it.
_INTERPRETER_ROWS = 128


@triton.jit
def _mix32(x):
    """sampler._mix32 on non-negative int64 values below 2^32: products split into 16-bit
    halves as there (no overflow), low 32 bits as x - ((x >> 32) << 32) (no literal of
    2^31 or more, so no unsigned typing anywhere)."""
    x = x ^ (x >> 16)
    lo = x * (0x7FEB352D & 0xFFFF)
    hi = ((x * (0x7FEB352D >> 16)) & 0xFFFF) << 16
    x = lo + hi
    x = x - ((x >> 32) << 32)
    x = x ^ (x >> 15)
    lo = x * (0x846CA68B & 0xFFFF)
    hi = ((x * (0x846CA68B >> 16)) & 0xFFFF) << 16
    x = lo + hi
    x = x - ((x >> 32) << 32)
    return x ^ (x >> 16)


@triton.jit
def _uniform(seed, position):
    """sampler.uniform_from, bit for bit: float64 in [0, 1) with 53 random bits."""
    seed_lo = seed - ((seed >> 32) << 32)
    seed_hi = seed >> 32  # seed < 2^63
    a = position + 0x4F1BBCDC + 0x4F1BBCDD  # + 0x9E3779B9
    a = _mix32(a - ((a >> 32) << 32))
    b = _mix32(a ^ seed_lo)
    c = _mix32(b ^ seed_hi)
    d = _mix32(c ^ 0x68E31DA4)
    return ((c << 21) + (d >> 11)).to(tl.float64) / 9007199254740992.0  # 2^53


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    seed = tl.load(seed_ptr + offs, mask=mask, other=0)
    pos = tl.load(pos_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, _uniform(seed, pos), mask=mask)


@triton.jit
def _tile(vrow, start, kk, live, s0, z, top_p, min_thr, carry_p, BLOCK: tl.constexpr):
    """One [ROWS, BLOCK] tile of the sorted rows: the reference's math per rank r.

    p = softmax over the top-k ranks; dropped if (cum_r - p_r) >= top_p or p_r < min_p * p_0
    (rank 0 always kept). Returns the offsets, the valid mask, the kept p (float64, 0 where
    dropped), the running mass at the tile's end and the tile's last p. Each row's numbers
    depend only on that row.
    """
    offs = start + tl.arange(0, BLOCK)
    m = (offs[None, :] < kk[:, None]) & live[:, None]
    s = tl.load(vrow[:, None] + offs[None, :], mask=m, other=float("-inf"))
    p = tl.where(m, tl.exp(s - s0[:, None]) / z[:, None], 0.0)
    cum = carry_p[:, None] + tl.cumsum(p, 1)
    drop = (((cum - p) >= top_p[:, None]) | (p < min_thr[:, None])) & (offs[None, :] > 0)
    q = tl.where(drop, 0.0, p).to(tl.float64)
    is_last = offs[None, :] == (tl.minimum(start + BLOCK, kk) - 1)[:, None]
    new_p = tl.where(live, tl.sum(tl.where(is_last, cum, 0.0), 1), carry_p)
    p_last = tl.sum(tl.where(is_last, p, 0.0), 1)
    return offs, m, q, new_p, p_last


@triton.jit
def _sample_sorted_kernel(
    vals_ptr, idx_ptr, stride_v, stride_i, n_rows, K,
    greedy_ptr, top_k_ptr, top_p_ptr, min_p_ptr, u_ptr, out_ptr,
    TOP_P_MARGIN: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """ROWS rows per program (1 on the GPU). vals/idx: each row's scaled logits in stable
    descending order and their vocabulary ids, K per row (the vocabulary or the top-K)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    vrow = vals_ptr + rows.to(tl.int64) * stride_v
    irow = idx_ptr + rows.to(tl.int64) * stride_i
    tok = tl.load(irow, mask=rmask, other=0)  # rank 0: the argmax, first index among equal maxima
    active = rmask & (tl.load(greedy_ptr + rows, mask=rmask, other=1) == 0)
    if tl.max(active.to(tl.int32), 0) > 0:
        top_k = tl.load(top_k_ptr + rows, mask=active, other=1)
        kk = tl.where(active, tl.maximum(tl.minimum(top_k, K), 1), 0).to(tl.int32)
        top_p = tl.load(top_p_ptr + rows, mask=active, other=1.0)
        min_p = tl.load(min_p_ptr + rows, mask=active, other=0.0)
        s0 = tl.load(vrow, mask=active, other=0.0).to(tl.float32)
        # pass 1: the softmax normaliser over the top-k ranks
        zacc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for start in range(0, tl.max(kk, 0), BLOCK):
            offs = start + tl.arange(0, BLOCK)
            s = tl.load(vrow[:, None] + offs[None, :], mask=offs[None, :] < kk[:, None], other=float("-inf"))
            zacc += tl.exp(s - s0[:, None])
        z = tl.where(active, tl.sum(zacc, 1), 1.0)
        min_thr = min_p * (1.0 / z)  # min_p * p_0
        # pass 2: each row's total kept mass; a row stops where every later rank is
        # provably dropped (past top_p by the margin, or below the min-p threshold)
        carry_p = tl.zeros([ROWS], dtype=tl.float32)
        mass = tl.zeros([ROWS], dtype=tl.float64)
        kend = tl.zeros([ROWS], dtype=tl.int32)
        going = active
        start = 0
        while tl.max(going.to(tl.int32), 0) > 0:
            offs, m, q, carry_p, p_last = _tile(vrow, start, kk, going, s0, z, top_p, min_thr, carry_p, BLOCK)
            mass += tl.sum(q, 1)
            start += BLOCK
            kend = tl.where(going, tl.minimum(start, kk), kend)
            going = going & (start < kk) & (carry_p < top_p + TOP_P_MARGIN) & (p_last >= min_thr)
        target = tl.load(u_ptr + rows, mask=active, other=0.0) * mass
        # pass 3: the first rank whose CDF (float64 running sum of the kept p) passes the
        # drawn point; the same tile math as pass 2, so the same kept set
        carry_p = tl.zeros([ROWS], dtype=tl.float32)
        carry_c = tl.zeros([ROWS], dtype=tl.float64)
        rank = tl.full([ROWS], -1, dtype=tl.int32)
        last_kept = tl.zeros([ROWS], dtype=tl.int32)
        searching = active
        start = 0
        while tl.max(searching.to(tl.int32), 0) > 0:
            offs, m, q, carry_p, p_last = _tile(vrow, start, kk, searching, s0, z, top_p, min_thr, carry_p, BLOCK)
            cdf = carry_c[:, None] + tl.cumsum(q, 1)
            carry_c += tl.sum(q, 1)
            first = tl.min(tl.where((cdf > target[:, None]) & m, offs[None, :], 2147483647), 1)
            rank = tl.where(searching & (first < 2147483647), first, rank)
            last_kept = tl.maximum(last_kept, tl.max(tl.where((q > 0) & m, offs[None, :], 0), 1))
            start += BLOCK
            searching = searching & (rank < 0) & (start < kend)
        # no crossing only when rounding put the drawn point at the very end: the last kept rank
        rank = tl.where(rank >= 0, rank, last_kept)
        tok = tl.where(active, tl.load(irow + rank, mask=active, other=0), tok)
    tl.store(out_ptr + rows, tok, mask=rmask)


def uniform(seed: Tensor, position: Tensor) -> Tensor:
    """sampler.uniform_from on the device, in one launch: float64 [N]."""
    n = seed.numel()
    out = torch.empty(n, dtype=torch.float64, device=seed.device)
    if n:
        _uniform_kernel[(triton.cdiv(n, 256),)](
            seed.contiguous(), position.contiguous(), out, n, BLOCK=256, num_warps=1)
    return out


@triton.jit
def _topk_ties_kernel(
    lg_ptr, stride_l, V, cand_v_ptr, cand_i_ptr, stride_c, out_ptr, stride_o, K,
    BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
):
    """torch.topk's K candidates -> the first K of the stable order, as a set.

    Entries above the K-th value are right whatever topk did; of those equal to it, the
    stable order takes the lowest indices: scan the row in index order for them.
    """
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < K
    cv = tl.load(cand_v_ptr + row * stride_c + offs_k, mask=mk, other=float("inf"))
    thr = tl.min(cv, 0)
    gt = mk & (cv > thr)
    ci = tl.load(cand_i_ptr + row * stride_c + offs_k, mask=gt, other=0)
    out_row = out_ptr + row * stride_o
    tl.store(out_row + tl.cumsum(gt.to(tl.int32), 0) - 1, ci, mask=gt)
    c_gt = tl.sum(gt.to(tl.int32), 0)
    need = K - c_gt
    found = c_gt * 0
    start = 0
    while (found < need) & (start < V):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(lg_ptr + row * stride_l + offs, mask=m, other=0.0)
        eq = m & (x == thr)
        r = found + tl.cumsum(eq.to(tl.int32), 0) - 1
        tl.store(out_row + c_gt + r, offs.to(tl.int64), mask=eq & (r < need))
        found += tl.sum(eq.to(tl.int32), 0)
        start += BLOCK


def _order_key(values: Tensor, indices: Tensor) -> Tensor:
    """A unique int64 key, larger = earlier in lg.sort(descending=True, stable=True):
    the float's bits made order-preserving as a signed integer (high 32 bits) and the
    reversed index (low 32 bits), so that equal values rank by ascending index."""
    bits = (values + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 becomes +0.0
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negatives: order reversed
    return key * (1 << 32) + (0xFFFFFFFF - indices)


def stable_topk(lg: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The first k entries of lg.sort(-1, descending=True, stable=True): (values, indices).

    torch.topk alone picks and orders ties arbitrarily: take its k candidates, let a Triton
    pass put the right members of the boundary tie group in (the lowest indices), then
    sort the k candidates by their unique key. (A topk over a unique int64 key of every
    entry is simpler, but measured 3x slower at 512 x 151,936.)
    """
    n, vocab = lg.shape
    cand_v, cand_i = torch.topk(lg, k, dim=-1, largest=True, sorted=False)
    exact = torch.empty_like(cand_i)
    if n:
        _topk_ties_kernel[(n,)](
            lg, lg.stride(0), vocab, cand_v, cand_i, cand_v.stride(0), exact, exact.stride(0), k,
            BLOCK_K=triton.next_power_of_2(k), BLOCK=_SCAN_BLOCK, num_warps=8,
        )
    vals = lg.gather(-1, exact)
    perm = _order_key(vals, exact).argsort(dim=-1, descending=True)
    return vals.gather(-1, perm), exact.gather(-1, perm)


def sample(
    logits: Tensor,
    greedy: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seed: Tensor,
    position: Tensor,
    *,
    all_greedy: bool = False,
    max_top_k: int | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """logits [N, V] (float32, or bf16/fp16: greedy rows take the argmax as they are, random
    rows are widened to float32 first) -> tokens [N] int64 (`out`: an int64 [N] buffer to fill).

    greedy [N] bool; temperature, top_p, min_p [N] float32; top_k [N] int64 (V when off);
    seed [N] int64 (non-negative); position [N] int64 (the position being sampled).
    all_greedy / max_top_k: static choices of the host (module docstring).
    """
    n, vocab = logits.shape
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    if all_greedy:
        return torch.argmax(logits, dim=-1, out=out)
    if logits.dtype != torch.float32:
        logits = logits.float()
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    lg = logits / temp[:, None]
    if max_top_k is not None and max_top_k < vocab:
        vals, idx = stable_topk(lg, max(1, int(max_top_k)))
    else:
        vals, idx = lg.sort(dim=-1, descending=True, stable=True)
    u = uniform(seed, position)
    k = vals.shape[1]
    block = min(_BLOCK, triton.next_power_of_2(k))
    rows = 1 if logits.is_cuda else _INTERPRETER_ROWS
    _sample_sorted_kernel[(triton.cdiv(n, rows),)](
        vals, idx, vals.stride(0), idx.stride(0), n, k,
        greedy.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous(), u, out,
        TOP_P_MARGIN=_TOP_P_MARGIN, BLOCK=block, ROWS=rows, num_warps=8 if block >= 2048 else 4 if block >= 512 else 1,
    )
    return out


def accept(draft_tokens: Tensor, target_tokens: Tensor, out: Tensor | None = None) -> Tensor:
    """draft [n, B-1], target [n, B] int64 -> accepted [n] int64: the number of leading i
    with draft[:, i] == target[:, i]. Compare, cumulative product, sum: capturable."""
    n, drafts = draft_tokens.shape
    if target_tokens.shape != (n, drafts + 1):
        raise ValueError(f"target_tokens {tuple(target_tokens.shape)} must be [{n}, {drafts + 1}]")
    match = (draft_tokens == target_tokens[:, :drafts]).to(torch.int64)
    if out is None:
        return match.cumprod(dim=1).sum(dim=1)
    return torch.sum(match.cumprod(dim=1), dim=1, out=out)
