"""Context splits of the paged attention (kernels/attention.py): how many, which of them a
packed row reads, and the kernel that combines their partials.

Split rules: by count (``num_splits`` programs share a query block's key tiles; the count
comes from `choose_num_splits`) and fixed-size (split ``s`` covers key tiles
``[s * SPLIT_TILES, (s + 1) * SPLIT_TILES)`` whatever the grid: the exact mode's rule, and
the default mode's for decode and verify calls with a size from the batch alone,
`decode_split_keys`). With
a sliding window a fixed-size split's program axis starts at the query block's first split
(the one holding its first row's window start), so splits wholly before every row's window
are neither launched nor given partial memory; partial ``j`` of a block is split
``block first split + j``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .pdl import wait_then_signal

__all__ = ["MAX_SPLITS", "choose_num_splits", "decode_split_keys"]

# Most context splits per call: bounds the fp32 partial buffers (and gains nothing beyond).
MAX_SPLITS = 32
# The smallest split of both rules, in keys, whatever the key tile: run 46 (H100, Qwen3-8B
# verify at c = 1, context 1024) timed 128-key splits at 13.0 us, 64-key ones (what 32-key
# tiles gave with a two-tile floor) at 15.0 and 256-key ones at 13.8.
MIN_SPLIT_KEYS = 128
# The decode rule's program target: ~one wave over the SMs, not two (False: two, the rule
# before run 46; a switch for bench_step --ab). Run 46 (H100, Qwen3-8B, K = 15, context
# 1024), step ms one / two waves: spec on c = 4 8.717 / 8.924, c = 8 9.172 / 9.340, c = 16
# 11.208 / 11.417; decode c = 4 / 8 / 16 -1.7 / -1.0 / -1.0%; c = 1 and c >= 32 split alike.
# Kernel alone at c = 16: one split 35.1 us, two (the two-wave rule) 42.1.
ONE_WAVE_DECODE_SPLITS = True
# The same for the count rule (choose_num_splits: the draft's non-causal calls, windows,
# prefill chunks), off until measured at step level (bench_step --ab). Run 46's kernel
# alone, the draft's non-causal call: c = 4 17.6 us (8 splits) vs 16.1 (256-key splits),
# c = 16 37.7 (2) vs 34.6 (none), c = 8 24.5 (4) vs 24.6 (512-key splits).
ONE_WAVE_COUNT_SPLITS = False


def _least_split_tiles(block_n: int) -> int:
    """Key tiles in the smallest split either rule makes: two, and MIN_SPLIT_KEYS keys."""
    return max(2, -(-MIN_SPLIT_KEYS // block_n))


def choose_num_splits(
    num_requests: int, n_kv: int, num_q_blocks: int, max_pages: int, page_size: int,
    block_n: int = 64, num_sms: int = 132,
) -> int:
    """Context splits for flash-decoding: a pure function of Python ints (so a captured
    graph and every replay agree). Aims at ~2 waves of programs over `num_sms` (one with
    ONE_WAVE_COUNT_SPLITS), keeps at least two key tiles and MIN_SPLIT_KEYS keys per split
    for a context filling the whole block table (one-tile and 64-key splits lose more to the
    fp32 partials and the reduce than they gain), and does not split once the (request,
    query block, KV head) programs already fill that target.

    Measured on the H200 (Qwen3-8B: 8 KV heads, 16-row verify, context 1024, 64-page table):
    the best split counts were 8 / 4 / 4 / 2 / 1 at batch 1 / 4 / 8 / 16 / 32; this picks
    8 / 8 / 4 / 2 / 1. A table much wider than the contexts in it (a graph bucket sized for
    the model's maximum length) makes it over-split small batches: size tables to need.

    The count depends on the batch, so a row's reduction order moves with the step it runs
    in. The batch-independent alternative is `paged_attention(split_keys=...)`: fixed-size
    splits, a row's count a function of its own context (what the exact mode uses). Its
    cost against this rule is what bench/attention_split_rule.py measures on the device:
    fewer splits than this picks for a lone short decode, partials this would not write at
    batch >= 32 (a 16-row verify block at GQA group 4 writes 64 / split_keys of its K/V
    bytes as fp32 partials), and a combine launch."""
    programs = max(1, num_requests * n_kv * num_q_blocks)
    target = (1 if ONE_WAVE_COUNT_SPLITS else 2) * num_sms
    useful = max(1, -(-(max_pages * page_size) // block_n) // _least_split_tiles(block_n))
    return max(1, min(target // programs, useful, MAX_SPLITS))


# The decode rule's split size assumes contexts of about this many keys (decode_split_keys).
DECODE_SPLIT_CONTEXT = 1024
# Key tiles per split that decode_split_keys returns for tables up to its grid cap (2 ..
# DECODE_SPLIT_CONTEXT / 32; the warmed variants). Wider tables can need larger splits: those
# variants compile when the decode graphs are captured at startup.
_DECODE_SPLIT_TILES = (2, 4, 8, 16)
# The decode rule's grid: at most this many (request, split) pairs, so that its float32
# partials stay bounded for long tables (Qwen3.5-27B at 32k, c = 32: 201 MB a call, not 805).
DECODE_GRID_REQUEST_SPLITS = 512


def decode_split_keys(num_requests: int, n_kv: int, num_q_blocks: int, block_n: int,
                      num_sms: int = 132, table_tiles: int = 0) -> tuple[int | None, int | None]:
    """The default mode's context splits for causal calls of at most DECODE_TILE_ROWS (attention.py)
    query rows (decode steps and verify blocks): (split_keys, None), fixed-size splits, or (None, 1),
    none. A function of the batch (requests x KV heads x query blocks: the same for a decode
    call and a verify call of one bucket) and never of a row's context, the block's length or
    the page-table width, so a token decoded alone and the same token inside a verify block
    meet the same split boundaries (and, with every tile on the masked path, the same code):
    the same bits. `choose_num_splits`' count rule put a block's boundaries at
    cdiv(its tiles, count), which moved when a verify block's last row crossed a key tile,
    and took its count from the table's width (run 35's trace: the attention was the first
    op whose row differed between spec off and spec on, in every differing prompt).
    As many splits of a context of DECODE_SPLIT_CONTEXT keys as make ~1 wave of programs
    over the SMs (2 without ONE_WAVE_DECODE_SPLITS; at most MAX_SPLITS), each at
    least two key tiles and MIN_SPLIT_KEYS keys, and a power of two of tiles; a longer
    context gets more splits of the same size (programs past a block's keys exit at once).

    `table_tiles` (the page table's key tiles) bounds the grid: the splits grow (powers of
    two) until the table needs at most DECODE_GRID_REQUEST_SPLITS / requests of them, counted
    on the table rounded down to a power of two of tiles, so that the spec-on and spec-off
    tables of one model (a page apart: the verify block's reserve) get the same size. A
    captured graph's table is fixed, so there the rule stays a function of the batch; eager
    decode calls (`--enforce-eager`) with tables wide enough to hit the cap (contexts past
    ~DECODE_GRID_REQUEST_SPLITS / requests splits) can meet other sizes from step to step."""
    waves = 1 if ONE_WAVE_DECODE_SPLITS else 2
    count = min(waves * num_sms // max(1, num_requests * n_kv * num_q_blocks), MAX_SPLITS)
    if count < 2:
        return None, 1
    # A power of two of tiles: SPLIT_TILES is a compile-time constant (few variants to warm).
    tiles = triton.next_power_of_2(triton.cdiv(DECODE_SPLIT_CONTEXT // block_n, count))
    tiles = max(_least_split_tiles(block_n), tiles)
    if table_tiles > 0:
        grid_cap = max(2, DECODE_GRID_REQUEST_SPLITS // max(1, num_requests))
        table_pow2 = 1 << (table_tiles.bit_length() - 1)  # rounded down: a page more or less changes nothing
        tiles = max(tiles, triton.next_power_of_2(triton.cdiv(table_pow2, grid_cap)))
    return block_n * tiles, None


@triton.jit
def _window_lo(pos, window):
    """The first key a query at `pos` reads under `window` (the no-window sentinel: 0)."""
    return tl.maximum(pos - window + 1, 0)


@triton.jit
def _row_splits(seq_len, q_len, row, row_ok, max_pages, window, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                SPLIT_TILES: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """(first split, number of splits) of the fixed-size splits that a packed row's own
    visible keys span: a function of its position, seq_len and window only (count 0 for
    rows not computed). Every split of the range holds at least one of the row's keys."""
    pos = seq_len - q_len + row
    if CAUSAL:
        row_end = pos + 1  # a row sees keys <= its position
    elif WINDOWED:
        row_end = tl.minimum(pos + window, seq_len)  # and < pos + window without causality
    else:
        row_end = row * 0 + seq_len
    row_end = tl.minimum(row_end, max_pages * PAGE)
    first = row * 0
    if WINDOWED:
        first = _window_lo(pos, window) // (BLOCK_N * SPLIT_TILES)
    return first, tl.where(row_ok, tl.cdiv(tl.cdiv(row_end, BLOCK_N), SPLIT_TILES) - first, 0)


@triton.jit(do_not_specialize=["num_q_blocks", "num_splits", "part_rows", "max_pages", "window"])
def _combine_splits_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr,
    num_q_blocks, num_splits, part_rows, max_pages, window,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
    SPLIT_TILES: tl.constexpr, SUB_M: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out = sum_s w_s * o_s with w_s = 2^(lse_s - max lse) / sum of those (per packed row).
    SPLIT_TILES > 0 (fixed-size splits): a row sums only the splits its own visible keys
    span, in ascending order, so its result does not depend on its query block's extent.
    By count, a split that saw none of a row's keys (before its window, after its causal
    end) holds lse = -inf and weighs 0.

    Grid (request x query block, KV head x SUB_M-row slice of the tile, BLOCK_D-wide slice of
    head_dim): each output element's sum over splits runs in the same order whatever the
    slicing, so the slices change no bit; they keep the fp32 accumulator small (a whole
    128 x 256 tile spills) and give a lone request's few (KV head) tiles many programs."""
    wait_then_signal(PDL)  # (kernels/pdl.py: before any read)
    pid_rq = tl.program_id(0)
    n_sub: tl.constexpr = BLOCK_M // SUB_M
    kv_head = tl.program_id(1) // n_sub
    sub = tl.program_id(1) % n_sub
    n_kv = tl.num_programs(1) // n_sub
    req = pid_rq // num_q_blocks
    row0 = (pid_rq % num_q_blocks) * BLOCK_Q
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    # Nothing to do past the request's rows or the tile's packed rows.
    if (row0 + (sub * SUB_M) // GROUP >= q_len) | (sub * SUB_M >= BLOCK_Q * GROUP):
        return
    offs_m = sub * SUB_M + tl.arange(0, SUB_M)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = row0 + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (row < q_len)  # the rows the main kernel wrote
    tok = (q_start + row).to(tl.int64)
    pidx0 = tok * (n_kv * GROUP) + head  # the block's first partial of each packed row
    split_stride = part_rows.to(tl.int64) * (n_kv * GROUP)
    if SPLIT_TILES > 0:
        seq_len = tl.load(seq_lens_ptr + req)
        first, row_splits = _row_splits(seq_len, q_len, row, row_ok, max_pages, window,
                                        PAGE, BLOCK_N, SPLIT_TILES, CAUSAL, WINDOWED)
        row_splits = tl.where(row_splits > 1, row_splits, 0)  # one split: the main kernel wrote it
        n_loop = tl.max(row_splits, 0)
        if WINDOWED:  # the row's first partial, counted from the block's first split (its first row's)
            pidx0 += (first - _window_lo(seq_len - q_len + row0, window) // (BLOCK_N * SPLIT_TILES)) * split_stride
    else:
        row_splits = tl.where(row_ok, num_splits, 0)
        n_loop = num_splits

    lse_max = tl.full([SUB_M], float("-inf"), dtype=tl.float32)
    for s in range(n_loop):
        lse = tl.load(part_lse_ptr + s * split_stride + pidx0, mask=s < row_splits, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    lse_base = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros([SUB_M], dtype=tl.float32)
    acc = tl.zeros([SUB_M, BLOCK_D], dtype=tl.float32)
    for s in range(n_loop):
        use = s < row_splits
        pidx = s * split_stride + pidx0
        lse = tl.load(part_lse_ptr + pidx, mask=use, other=float("-inf"))
        w = tl.math.exp2(lse - lse_base)  # 0 for empty splits (lse = -inf)
        o = tl.load(part_o_ptr + pidx[:, None] * HEAD_DIM + offs_d[None, :], mask=use[:, None], other=0.0)
        # Splits past a row's own are skipped, not added as zeros: no -0.0 + 0.0 sign flips.
        total = tl.where(use, total + w, total)
        acc = tl.where(use[:, None], acc + w[:, None] * o, acc)
    o = acc / tl.where(total > 0.0, total, 1.0)[:, None]

    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
        o.to(out_ptr.dtype.element_ty), mask=(row_splits > 0)[:, None],
    )
