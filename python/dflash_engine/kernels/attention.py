"""Paged attention in Triton: twins of `dflash_engine.ops.attention` (K/V writes: kernels/kv_store.py).

Layout
------
- K/V caches: ``[num_pages, page_size, n_kv, head_dim]``; token slot ``s`` lives at
  ``page = s // page_size``, ``offset = s % page_size``. Any ``page_size`` (a hybrid target's
  pages are multiples of the asked size, e.g. 48: worker/state_pool.py); ``head_dim`` a power of two.
- ``q`` / ``out``: ``[T, n_heads, head_dim]`` with ``n_heads = group * n_kv`` (GQA: query
  head ``h`` reads KV head ``h // group``). Any strides are accepted (``q`` may be a view
  into a fused qkv buffer).
- ``query_start_loc`` ``[R+1]`` int32: rows of request ``r`` are ``[qsl[r], qsl[r+1])``.
  ``seq_lens`` ``[R]`` int32: context length *including* this step's rows, so row ``i`` of
  request ``r`` sits at position ``seq_len - q_len + i``. ``page_tables`` ``[R, max_pages]``
  int32, padded with page 0 (the null page).

Invariants the kernels rely on (and keep)
-----------------------------------------
- CUDA-graph capturable: every grid is a function of Python ints only (R, n_kv,
  ``max_query_len``, ``num_splits``, table width, T); per-request lengths are read inside
  the kernels, and programs past a request's real length exit or mask. No host syncs.
- ``max_query_len`` must be >= every request's ``q_len`` (rows beyond it are not computed).
- Requests with ``q_len == 0`` (padding entries of a graph bucket) produce nothing; only the
  output rows of real requests are written.
- K/V are read only at positions ``< seq_len`` (and inside the block table) and, with a
  window, at or after the query block's first window start, so stale or garbage contents of
  the null page, of a page's unused tail or of pages before the window never reach the result.
- Softmax is computed online in float32 (base-2 exponent, scale folded in); results are
  cast to ``q.dtype`` once at the end.

Work decomposition
------------------
One program owns a tile of ``BLOCK_M`` packed query rows for one (request, query block,
KV head): packed row ``m`` is query row ``m // group`` of the block and query head
``kv_head * group + m % group``. Decode/verify (q_len 1..16) therefore fits a request's
rows x the whole GQA group into one tile, so each KV page is read once per KV head;
prefill chunks are tiled by ``BLOCK_Q`` query rows. Keys are visited in tiles of
``BLOCK_N`` positions gathered through the block table (any page size works). Tiles that
causality masks entirely are never visited, and tiles entirely visible to every row run
without masks. With ``num_splits > 1`` (flash-decoding, for batches too small to fill the
GPU) each program handles a contiguous share of the key tiles and writes a partial
(normalized output, log-sum-exp) in float32 per (split, token, head); a second small kernel
combines them (kernels/attention_splits.py). Folding the combine into each tile's last split
program was measured slower (run 42: one program combining a whole tile takes longer than
the launch it saves; code in 91fc357).
Each key tile's block-table entries are loaded one iteration ahead, so that Triton's
pipeliner overlaps a tile's K/V copies with the previous tile's math.

Sliding windows
---------------
``window`` W (ops/attention.py's semantics): a row at position p sees keys kv with
``p - W < kv``, and ``kv < p + W`` when not causal. The kernels specialise on whether a
window is set (``WINDOWED``: full attention compiles to the code without windows), not on
its value; ``warmup(windowed=True)`` builds those variants. A query block's keys start at
its first row's window start: tiles before it are never visited (a long context costs the window, not its length),
tiles at the window's edges take the masked path, and the splits share only those keys
(``choose_num_splits`` is given the window's span). A split that sees none of a row's keys
writes lse = -inf for it and weighs nothing in the combine.

The exact (batch-invariant) mode
--------------------------------
By default the tile shape comes from the longest query, floored at ``DECODE_TILE_ROWS``
query rows: a decode row (1 row per request) and the same row inside a verify block of up to
16 rows run the same tile geometry (the same dot instructions; run 27). Such calls (causal,
no window) also take their splits from the batch alone (`decode_split_keys`: fixed-size
splits, their size from requests x KV heads, never from a row's context, the block's length
or the table's width) and put every tile on the masked path, so at the same batch a token
decoded alone and the same token in a verify block agree bit for bit: speculation does not
change a greedy output at c = 1. Longer queries (prefill chunks, mixed steps) split by count
(`choose_num_splits`, boundaries at cdiv(the block's tiles, count)) with the fast path for
fully visible tiles, so a decode row inside a mixed step can still differ. ``exact=True``
makes a row's result a function of its own context only:

- splits of a fixed size in keys (``split_keys``): split ``s`` always covers key tiles
  ``[s * SPLIT_TILES, (s + 1) * SPLIT_TILES)``, whatever the grid. A row has one partial
  per split its own visible keys span (from the split holding its window start, else split
  0), and the combine reads exactly those, in ascending order. Tiles a query block visits
  beyond a row's causal (or window) end add exact zeros to that row (p = 0, alpha = 1), and
  tiles before the row's window start leave its state as it began (m = -inf, l = 0, acc =
  0), so a verify block's or prefill chunk's extra tiles change nothing. With a window the
  grid's split axis counts from the query block's first split and spans the window's
  splits, not the table's; where a partial sits in memory does not change its bits;
- one tile geometry (BLOCK_Q / BLOCK_M / BLOCK_N, warps, stages) whatever ``max_query_len``,
  so every launch runs the same compiled dot instructions;
- every tile through the masked path (no fast-path/masked-path split that moves with the
  block's first row), and always the split variant of the kernel: a row whose keys fit in
  one split is written by it directly, any other through partials and the combine -- by
  its own context, whatever the grid.

Cost: decode rows use a 128-row tile (memory-bound: the keys dominate), and the fp32
partials take ``cdiv(table keys, split_keys) * T * n_heads * head_dim * 4`` bytes (with a
window: ``cdiv(window span, split_keys) + 1`` splits at most, the span being
``W + BLOCK_Q`` causal, ``2 W + BLOCK_Q`` not).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .attention_splits import (
    _DECODE_SPLIT_TILES,
    MAX_SPLITS,
    _combine_splits_kernel,
    _row_splits,
    _window_lo,
    choose_num_splits,
    decode_split_keys,
)
from .kv_store import store_kv  # (the K/V writes: a file of their own; re-exported here)
from .pdl import launch_options, wait_then_signal

__all__ = ["store_kv", "paged_attention", "choose_num_splits", "MAX_SPLITS"]

_LOG2E = 1.4426950408889634
# Keys per split of the exact mode. Fixed (never from the batch or the table width, which
# vary with the step and its graph bucket). Smaller: more parallelism for a lone long decode;
# larger: fewer partial bytes for wide verify batches (a 16-row verify block writes
# 64 / split_keys of its K/V bytes again as fp32 partials at GQA group 4). Tune on the device.
EXACT_SPLIT_KEYS = 512


# ----------------------------------------------------------------------- paged attention


@triton.jit
def _tile_of(i, skip_lo, n_skip, SKIP: tl.constexpr):
    """The key tile a loop index visits: with SKIP, indices from skip_lo on jump n_skip tiles."""
    if SKIP:
        return tl.where(i < skip_lo, i, i + n_skip)
    return i


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q, q_pos,
    tile_lo, tile_hi, skip_lo, skip_hi, kv_lo, kv_end, window,
    k_base, v_base, bt_row_ptr,
    stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
    qk_scale,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi), ascending. MASKED=False is the fast
    path for tiles whose every key is visible to every row (no bounds, causal or window
    masks). MASKED=True masks keys outside [kv_lo, kv_end) and each row's own causal (and,
    WINDOWED, window) bounds; WINDOWED, it skips the tiles [skip_lo, skip_hi) (the fast
    path's, which windows put between masked ones)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_skip = 0
    if WINDOWED and MASKED:
        n_skip = skip_hi - skip_lo
    # The block-table entries of a tile are loaded one iteration ahead and carried: a K/V
    # address that depends on a load in its own iteration makes Triton's pipeliner wait for
    # every copy in flight at the top of each iteration below 5 stages (no overlap of a
    # tile's K/V read with the previous tile's math). Any page beyond kv_end reads as 0.
    skip: tl.constexpr = WINDOWED and MASKED
    pos_next = _tile_of(tile_lo, skip_lo, n_skip, skip) * BLOCK_N + offs_n
    next_page = tl.load(bt_row_ptr + pos_next // PAGE, mask=pos_next < kv_end, other=0)
    for i in range(tile_lo, tile_hi - n_skip):
        k_pos = pos_next
        page = next_page.to(tl.int64)
        pos_next = _tile_of(i + 1, skip_lo, n_skip, skip) * BLOCK_N + offs_n
        next_page = tl.load(bt_row_ptr + pos_next // PAGE, mask=pos_next < kv_end, other=0)
        if MASKED:
            in_range = k_pos < kv_end
            if WINDOWED:
                in_range = in_range & (k_pos >= kv_lo)
        off = (k_pos % PAGE).to(tl.int64)
        k_ptrs = k_base + page[:, None] * stride_kp + off[:, None] * stride_ks + offs_d[None, :] * stride_kd
        v_ptrs = v_base + page[:, None] * stride_vp + off[:, None] * stride_vs + offs_d[None, :] * stride_vd
        if MASKED:
            # other=0 keeps NaN/inf garbage (beyond seq_len, before the window) out of p @ v.
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
        if MASKED:
            visible = in_range[None, :]
            if WINDOWED:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            if CAUSAL:
                visible = visible & (k_pos[None, :] <= q_pos[:, None])
            elif WINDOWED:
                visible = visible & (k_pos[None, :] < q_pos[:, None] + window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible so far keeps m = -inf; subtract 0 instead so that
        # exp2(-inf - -inf) never produces NaN (its p and alpha are then exactly 0).
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_base)
        p = tl.math.exp2(s - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Integer arguments that vary from step to step (grid sizes, page-table widths) are not
# specialised (Triton would compile a new variant when one becomes 1 or a multiple of 16: a
# compile stall of seconds in the middle of serving).
@triton.jit(do_not_specialize=["num_q_blocks", "max_pages", "stride_bt", "part_rows", "window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr,
    qk_scale, num_q_blocks, max_pages, part_rows, window,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
    SPLIT: tl.constexpr, SPLIT_TILES: tl.constexpr, ALL_MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_then_signal(PDL)  # (kernels/pdl.py: before any read)
    pid_rq = tl.program_id(0)  # request * num_q_blocks + query block
    kv_head = tl.program_id(1)
    part = tl.program_id(2)  # which split (fixed-size: counted from the block's first)
    num_splits = tl.num_programs(2)
    req = pid_rq // num_q_blocks
    row0 = (pid_rq % num_q_blocks) * BLOCK_Q
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    if row0 >= q_len:  # past this request's rows (includes q_len == 0 padding requests)
        return
    seq_len = tl.load(seq_lens_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row = row0 + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (row < q_len)
    tok = (q_start + row).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None], other=0.0,
    ).to(k_cache_ptr.dtype.element_ty)  # both dot operands in the cache's dtype
    q_pos = seq_len - q_len + row

    # Keys this query block can see: [kv_lo, kv_end) (kv_lo: its first row's window start).
    # [full_lo, full_end) bounds the keys visible to every row of the block.
    p_first = seq_len - q_len + row0
    p_last = seq_len - q_len + tl.minimum(q_len, row0 + BLOCK_Q) - 1
    kv_lo = 0
    full_lo = 0
    if WINDOWED:
        kv_lo = _window_lo(p_first, window)
        full_lo = _window_lo(p_last, window)
    if CAUSAL:
        kv_end = p_last + 1
        full_end = p_first + 1
    elif WINDOWED:  # keys after a row are capped at its position + window - 1
        kv_end = tl.minimum(seq_len, p_last + window)
        full_end = tl.minimum(seq_len, p_first + window)
    else:
        kv_end = seq_len
        full_end = seq_len
    kv_end = tl.minimum(kv_end, max_pages * PAGE)  # never index past the block-table row
    full_end = tl.minimum(full_end, kv_end)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    lo_tile = kv_lo // BLOCK_N  # tiles before it: outside every row's window, never visited
    split = part
    if not SPLIT:
        tile_lo = lo_tile
        tile_hi = num_tiles
    elif SPLIT_TILES > 0:
        # Fixed-size splits: the boundaries sit at the same keys whatever the grid.
        split = lo_tile // SPLIT_TILES + part
        tile_lo = split * SPLIT_TILES
        if tile_lo >= num_tiles:  # past this block's keys: the combine never reads it
            return
        tile_hi = tl.minimum(tile_lo + SPLIT_TILES, num_tiles)
        tile_lo = tl.maximum(tile_lo, lo_tile)
    else:
        per_split = tl.cdiv(tl.maximum(num_tiles - lo_tile, 0), num_splits)
        tile_lo = tl.minimum(lo_tile + part * per_split, num_tiles)
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    if ALL_MASKED:
        fast_lo = tile_lo
        fast_hi = tile_lo
    elif WINDOWED:
        fast_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), tile_lo), tile_hi)
        fast_hi = tl.minimum(tl.maximum(full_end // BLOCK_N, fast_lo), tile_hi)
    else:  # without a window the fast tiles come first
        fast_lo = tile_lo
        fast_hi = tl.maximum(tl.minimum(full_end // BLOCK_N, tile_hi), tile_lo)
    masked_lo = fast_hi
    if WINDOWED:  # the masked tiles lie on both sides of the fast ones
        masked_lo = tile_lo

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    bt_row_ptr = bt_ptr + req.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, fast_lo, fast_hi, fast_hi, fast_hi, kv_lo, kv_end, window,
        k_base, v_base, bt_row_ptr, stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
        qk_scale, False, CAUSAL, WINDOWED, PAGE, BLOCK_N, HEAD_DIM, DOT_PRECISION,
    )
    acc, l_i, m_i = _attend_tiles(  # the tiles around them: window edges, causal diagonal, tail
        acc, l_i, m_i, q, q_pos, masked_lo, tile_hi, fast_lo, fast_hi, kv_lo, kv_end, window,
        k_base, v_base, bt_row_ptr, stride_kp, stride_ks, stride_kd, stride_vp, stride_vs, stride_vd,
        qk_scale, True, CAUSAL, WINDOWED, PAGE, BLOCK_N, HEAD_DIM, DOT_PRECISION,
    )

    # l == 0 only for rows that saw nothing (padding rows, empty splits): emit 0, not NaN.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if not SPLIT:
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None],
        )
    else:
        # Partials are laid out by (split, token, head): [num_splits, part_rows, n_heads(, D)],
        # so packed padding rows of a tile cost no memory. Only real rows are written (and
        # read back); these fp32 partials cost as many bytes as the split's K/V tiles.
        part_ok = row_ok
        if SPLIT_TILES > 0:
            # A row whose visible keys fit in one split is final here (the combine skips it):
            # the same rows are final whatever the grid, and a table of one split needs no
            # combine launch at all. (Other splits of its query block saw nothing of it.)
            first, n_row = _row_splits(seq_len, q_len, row, row_ok, max_pages, window,
                                       PAGE, BLOCK_N, SPLIT_TILES, CAUSAL, WINDOWED)
            tl.store(
                out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                o.to(out_ptr.dtype.element_ty), mask=((n_row == 1) & (first == split))[:, None],
            )
            part_ok = (split >= first) & (split < first + n_row)  # only the splits the combine reads
        pidx = (part.to(tl.int64) * part_rows + tok) * (tl.num_programs(1) * GROUP) + head
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + pidx, lse, mask=part_ok)
        tl.store(part_o_ptr + pidx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=part_ok[:, None])


# Tiles hold at most this many packed (query row x GQA head) rows.
_MAX_BLOCK_M = 128
# The combine's slice of a tile: packed rows x head dims per program (attention_splits.py).
# Whole tiles (up to 128 x 256 fp32) spilled: the Qwen3.5-27B shape's combine took 327 us a
# launch at c = 1 on the H200 (run 30), 22% of the step.
COMBINE_SUB_M = 32
COMBINE_BLOCK_D = 64
# (Two cheaper combines were built and measured: folded into the last split, 4.8% slower at
# c = 1 in run 42 (one program combining a tile costs more than the launch it saves); the
# splits' loads 8 at a time instead of one round trip each, no faster in run 51 (step 0.999-
# 1.005x, kernel alone equal). Under PDL a profile's combine time includes its wait for the
# attention kernel: bench_attention times the pair at 12.4 us a layer at c = 1 (H100), not
# the profile's 8.8 + 10.6.)
# The default mode's smallest tile, in query rows: decode (1 row) and verify blocks (up to 16
# rows: K <= 15) share one geometry, so speculation does not change a decode row's bits.
DECODE_TILE_ROWS = 16


# Verify / decode tiles (<= 64 packed rows) walk the keys 32 at a time, prefill tiles 64: on
# an H100 (run 45, bench/bench_attention.py --sweep, Qwen3-8B shapes, context 1024) 32-key
# tiles at 4 warps / 3 stages took 4-7% less time than 64 at c = 8 and 32, verify and draft.
# A module switch, read at each call (bench/bench_step.py --ab).
NARROW_DECODE_KEY_TILES = True


def _pick_blocks(max_query_len: int, group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N): all of a decode/verify request's rows x its GQA group in
    one tile when they fit in _MAX_BLOCK_M packed rows, else as many query rows as fit."""
    block_q = 1
    while block_q * 2 * group <= _MAX_BLOCK_M and block_q < max_query_len:
        block_q *= 2
    block_m = max(16, triton.next_power_of_2(block_q * group))  # tl.dot needs M >= 16
    block_n = 64 if head_dim <= 128 and not (NARROW_DECODE_KEY_TILES and block_m <= 64) else 32
    return block_q, block_m, block_n


def tile_geometry(max_query_len: int, group: int, head_dim: int, exact: bool) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N) of a call: the exact mode's one geometry, else the longest
    query's, at least DECODE_TILE_ROWS rows."""
    if exact:
        return _exact_blocks(group, head_dim)
    return _pick_blocks(max(max_query_len, DECODE_TILE_ROWS), group, head_dim)


def _exact_blocks(group: int, head_dim: int) -> tuple[int, int, int]:
    """The exact mode's one geometry: the prefill tile (the widest `_pick_blocks` returns),
    whatever the step's query length, so decode, verify and prefill rows share one kernel."""
    return _pick_blocks(_MAX_BLOCK_M, group, head_dim)


def _launch_config(block_m: int, head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) for the main kernel. 8 warps suit 128-row prefill tiles (~245
    TFLOP/s on a causal 2048-row chunk, H200, measured before the K/V copies were pipelined).

    Stages decide the K/V buffers in shared memory, and so the CTAs per SM (228 KB an SM on
    Hopper). With the block table read one tile ahead, 3 stages keep one tile's copies in
    flight during the previous tile's math (2: none). Verify/decode tiles (<= 64 rows, 32 keys
    at head_dim 128: NARROW_DECODE_KEY_TILES) take 3 stages. A 128-row prefill tile (64 keys)
    keeps 2 (98 KB, 2 CTAs per SM): 3 stages would take 131 KB and 1 CTA per SM, and timed the
    same on an H100 (run 45: 139.1 vs 139.5 us for a causal 2048-row chunk). head_dim 256
    (Qwen3.5): 2 stages."""
    return (8 if block_m >= 128 else 4), (2 if head_dim > 128 or block_m >= 128 else 3)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter / CPU: plan as for the H200


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    page_tables: Tensor,
    scale: float,
    causal: bool,
    max_query_len: int,
    out: Tensor | None = None,
    num_splits: int | None = None,
    split_keys: int | None = None,
    exact: bool = False,
    window: int | None = None,
) -> Tensor:
    """Attention of q ``[T, n_heads, head_dim]`` over each request's paged context; returns
    ``out`` ``[T, n_heads, head_dim]`` in q's dtype (only rows of requests are written).

    causal=True: a row sees keys at positions <= its own; causal=False (the DFlash draft
    pass): every row sees the whole context [0, seq_len). `window` (None or 0: full
    attention): a sliding-window layer's, as in ops/attention.py: a row at position p sees
    only keys in (p - window, p + window); keys before its query block's first window are
    never read. `max_query_len` (a Python int,
    >= every request's q_len) and the tensor shapes fix the grid; `num_splits` (None: chosen
    by `choose_num_splits`) splits each context across programs, combined by a second
    launch. `split_keys` instead splits every context into fixed runs of that many keys (a
    multiple of the key tile: 64, or 32 for head_dim > 128). `exact=True` is the
    batch-invariant mode (module docstring): fixed-size splits (`split_keys`, default
    EXACT_SPLIT_KEYS), one tile geometry, so a row's bits depend on its own query, context
    and K/V only. Capturable in a CUDA graph: no host syncs, no value-dependent shapes."""
    num_tokens, n_heads, head_dim = q.shape
    num_pages, page_size, n_kv, kv_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape and kv_dim == head_dim
    assert n_heads % n_kv == 0, (n_heads, n_kv)
    assert head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256, head_dim
    group = n_heads // n_kv
    num_requests, max_pages = page_tables.shape
    assert query_start_loc.shape[0] == num_requests + 1 and seq_lens.shape[0] == num_requests
    if out is None:
        out = torch.empty((num_tokens, n_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape
    if num_tokens == 0 or num_requests == 0 or max_query_len <= 0:
        return out
    assert window is None or 0 <= window < 1 << 30, window  # position + window stays in int32
    windowed = bool(window)

    if exact:
        assert num_splits is None, "the exact mode's splits come from split_keys, not a count"
        split_keys = EXACT_SPLIT_KEYS if split_keys is None else split_keys
    else:
        assert num_splits is None or split_keys is None, "num_splits or split_keys, not both"
    block_q, block_m, block_n = tile_geometry(max_query_len, group, head_dim, exact)
    num_q_blocks = triton.cdiv(max_query_len, block_q)
    # Decode and verify calls (causal, <= DECODE_TILE_ROWS rows) of the default mode: every
    # tile on the masked path (which tiles take the fast path moves with the block's first
    # row), and the splits of `decode_split_keys` unless the caller chose them.
    decode_rule = not exact and causal and not window and max_query_len <= DECODE_TILE_ROWS
    if decode_rule and num_splits is None and split_keys is None:
        split_keys, num_splits = decode_split_keys(num_requests, n_kv, num_q_blocks, block_n, _num_sms(q.device),
                                                   triton.cdiv(max_pages * page_size, block_n))
    all_masked = bool(exact or decode_rule)
    # Keys one query block can span: the table's, or at most its rows' windows.
    span = max_pages * page_size
    if window:
        span = min(span, (window if causal else 2 * window) + block_q)
    split_tiles = 0  # 0: split by count
    if split_keys is not None:
        assert split_keys > 0 and split_keys % block_n == 0, (split_keys, block_n)
        split_tiles = split_keys // block_n
        # One program per run of split_keys keys the table can hold (with a window: that a
        # block's span can touch, counted from its first); runs past a query block's keys
        # exit at once. Not capped otherwise: a cap would move the boundaries.
        num_splits = triton.cdiv(triton.cdiv(max_pages * page_size, block_n), split_tiles)
        if window:
            num_splits = min(num_splits, triton.cdiv(span, split_keys) + 1)
    elif num_splits is None:
        num_splits = choose_num_splits(num_requests, n_kv, num_q_blocks, triton.cdiv(span, page_size),
                                       page_size, block_n, _num_sms(q.device))
    if split_tiles == 0:
        assert 1 <= num_splits <= MAX_SPLITS, num_splits
    # The exact mode always launches the split variant, so a row has one code path whether
    # its table holds one split or many (a row of one split is written by the main kernel).
    split = num_splits > 1 or exact
    grid = (num_requests * num_q_blocks, n_kv, num_splits)
    if split:
        rows = num_splits * num_tokens * n_heads
        part_o = torch.empty((rows, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows,), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused (SPLIT=False writes out directly)
    # fp32 inputs (tests, interpreter): exact fp32 products, not TF32.
    precision = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    num_warps, num_stages = _launch_config(block_m, head_dim)
    pdl = launch_options(q.device)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse,
        query_start_loc, seq_lens, page_tables,
        scale * _LOG2E, num_q_blocks, max_pages, num_tokens, window or 0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        page_tables.stride(0),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, PAGE=page_size, CAUSAL=bool(causal), WINDOWED=windowed,
        SPLIT=split, SPLIT_TILES=split_tiles, ALL_MASKED=all_masked, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages, **pdl,
    )
    if num_splits > 1:  # (with one split every row was final in the main kernel)
        sub_m, block_d = min(block_m, COMBINE_SUB_M), min(head_dim, COMBINE_BLOCK_D)
        _combine_splits_kernel[(grid[0], n_kv * (block_m // sub_m), head_dim // block_d)](
            out, part_o, part_lse, query_start_loc, seq_lens,
            num_q_blocks, num_splits, num_tokens, max_pages, window or 0, *out.stride(),
            GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
            PAGE=page_size, CAUSAL=bool(causal), WINDOWED=windowed, SPLIT_TILES=split_tiles,
            SUB_M=sub_m, BLOCK_D=block_d, num_warps=4, **pdl,
        )
    return out


def warmup(n_heads: int, n_kv: int, head_dim: int, page_size: int, dtype: torch.dtype,
           device: torch.device, exact: bool = False, windowed: bool = False) -> int:
    """Compile every variant of the attention kernels a step can meet (each query-block size
    `tile_geometry` can choose, causal and not, with and without split contexts) on tiny
    inputs, so that no request pays a Triton compile (seconds) in the middle of serving.
    `exact`: the exact mode's variants instead (one geometry: causal and not; a context of
    two splits, so the combine compiles too). `windowed`: the sliding-window variants as
    well (the window is specialised on being set, not on its value): pass it for a model
    with windowed layers. Returns the number of variants launched. Compiles are cached on
    disk by Triton, so only a machine's first start pays for them."""
    group = n_heads // n_kv
    q_lens, block_qs, q = [], set(), 1
    while q <= _MAX_BLOCK_M:  # one query length per BLOCK_Q that tile_geometry can return
        block_q = tile_geometry(q, group, head_dim, False)[0]
        if block_q not in block_qs:
            block_qs.add(block_q)
            q_lens.append(q)
        q *= 2
    pages = triton.cdiv(2 * EXACT_SPLIT_KEYS, page_size) if exact else 4
    kc = torch.zeros(pages, page_size, n_kv, head_dim, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    table = torch.arange(pages, dtype=torch.int32, device=device)[None]
    seq_len = pages * page_size
    n = 0
    for q_len in [1] if exact else q_lens:
        qt = torch.zeros(q_len, n_heads, head_dim, dtype=dtype, device=device)
        qsl = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        lens = torch.tensor([seq_len], dtype=torch.int32, device=device)
        for window in (None, seq_len - 1) if windowed else (None,):
            for causal in (True, False):
                for splits in [None] if exact else (1, 2):
                    paged_attention(qt, kc, vc, qsl, lens, table, 1.0, causal, q_len, num_splits=splits,
                                    exact=exact, window=window)
                    n += 1
    if not exact:  # the decode rule's fixed-size splits (decode_split_keys), two splits' context
        block_n = tile_geometry(1, group, head_dim, False)[2]
        for tiles in _DECODE_SPLIT_TILES:
            pages = triton.cdiv(2 * tiles * block_n, page_size)
            kc = torch.zeros(pages, page_size, n_kv, head_dim, dtype=dtype, device=device)
            table = torch.arange(pages, dtype=torch.int32, device=device)[None]
            lens = torch.tensor([pages * page_size], dtype=torch.int32, device=device)
            qt = torch.zeros(1, n_heads, head_dim, dtype=dtype, device=device)
            paged_attention(qt, kc, torch.zeros_like(kc), torch.tensor([0, 1], dtype=torch.int32, device=device),
                            lens, table, 1.0, True, 1, split_keys=tiles * block_n)
            n += 1
    return n
