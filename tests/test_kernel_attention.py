"""Triton paged attention / KV store against their torch twins in dflash_engine.ops.attention.

Runs on the GPU when there is one, else on CPU tensors under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 when nvidia-smi is absent): float32 and small
shapes there, plus bf16/fp16 and Qwen3-8B-like shapes on CUDA.
"""
from __future__ import annotations

import math

import pytest
import torch

from dflash_engine.kernels.attention import MAX_SPLITS, choose_num_splits, paged_attention, store_kv
from dflash_engine.ops.attention import AttentionMetadata
from dflash_engine.ops.attention import paged_attention as ref_paged_attention
from dflash_engine.ops.attention import write_kv as ref_write_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if ON_GPU else [])
# Relative error ||out - ref|| / ||ref|| allowed per dtype (the reference computes in fp32
# from the same low-precision inputs; the kernel rounds p to the input dtype for p @ v).
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
PAD_ROWS = 3  # rows after the last request's rows: no request owns them, nothing may write them


def _pages_for(seq_len: int, page_size: int) -> int:
    return -(-seq_len // page_size)


def make_case(query_lens, seq_lens, *, n_kv, group, head_dim, page_size, dtype, causal,
              seed=0, spare_pages=3, table_slack=2):
    """Random q and paged K/V for requests whose rows are the last query_lens[r] of their
    seq_lens[r] context. Pages are shuffled; the null page 0, the spare pages and every slot
    past a request's seq_len hold NaN, so any read outside the context poisons the result."""
    gen = torch.Generator().manual_seed(seed)
    need = [_pages_for(s, page_size) for s in seq_lens]
    num_pages = 1 + sum(need) + spare_pages
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    width = max(max(need, default=0) + table_slack, 1)
    page_tables = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    for r, t in enumerate(tables):
        page_tables[r, : len(t)] = torch.tensor(t, dtype=torch.int32)

    shape = (num_pages, page_size, n_kv, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for t, s in zip(tables, seq_lens):
        for j, page in enumerate(t):
            used = min(page_size, s - j * page_size)
            k_cache[page, :used] = torch.randn(used, n_kv, head_dim, generator=gen)
            v_cache[page, :used] = torch.randn(used, n_kv, head_dim, generator=gen)

    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1] + PAD_ROWS, n_kv * group, head_dim, generator=gen)
    meta = make_meta(
        torch.zeros(qsl[-1], dtype=torch.int64, device=DEVICE),  # slot_mapping: unused here
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(list(seq_lens), dtype=torch.int32, device=DEVICE),
        page_tables.to(DEVICE),
        causal,
    )
    to = dict(device=DEVICE, dtype=dtype)
    return q.to(**to), k_cache.to(**to), v_cache.to(**to), meta


def make_meta(slot_mapping, query_start_loc, seq_lens, tables, causal) -> AttentionMetadata:
    """The reference's metadata, built field by field."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    return AttentionMetadata(
        slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
        page_tables=tables, causal=causal,
        max_query_len=max((b - a for a, b in zip(qsl, qsl[1:])), default=0),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens,
    )


def table_of(meta: AttentionMetadata) -> torch.Tensor:
    return meta.page_tables


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def run_and_check(query_lens, seq_lens, *, causal, num_splits, dtype=torch.float32, n_kv=2,
                  group=4, head_dim=32, page_size=8, seed=0, q_view=False):
    q, k_cache, v_cache, meta = make_case(
        query_lens, seq_lens, n_kv=n_kv, group=group, head_dim=head_dim,
        page_size=page_size, dtype=dtype, causal=causal, seed=seed,
    )
    if q_view:  # q as a strided view into a wider (fused qkv-like) buffer
        wide = torch.randn(q.shape[0], q.shape[1] + 5, q.shape[2] * 2, device=DEVICE).to(dtype)
        wide[:, 2:2 + q.shape[1], : q.shape[2]] = q
        q = wide[:, 2:2 + q.shape[1], : q.shape[2]]
    scale = 1.0 / math.sqrt(head_dim)
    n_rows = meta.query_start_loc_cpu[-1]
    out = torch.full_like(q, float("nan"))
    result = paged_attention(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, table_of(meta),
        scale, causal, max(query_lens), out=out, num_splits=num_splits,
    )
    assert result is out
    ref = ref_paged_attention(q[:n_rows], k_cache, v_cache, meta, scale)
    # Every row of every request written with finite values; the unowned tail untouched.
    assert torch.isfinite(out[:n_rows].float()).all(), "rows left unwritten or NaN leaked in"
    assert torch.isnan(out[n_rows:].float()).all(), "wrote rows no request owns"
    err = rel_err(out[:n_rows], ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e} ({dtype})"
    return out[:n_rows], ref


# (query_lens, seq_lens): each shape family the engine launches, on small CPU-sized shapes.
CASES = {
    # decode: one row per request; padding requests (q_len 0, seq_len 0 or small) between.
    "decode": ([1, 1, 0, 1, 1, 0], [37, 1, 0, 90, 64, 5]),
    # verify / draft: B=8 rows per request, one padding request.
    "verify": ([8, 8, 0, 8], [8, 75, 3, 140]),
    # prefill chunks: a fresh prompt (q_len == seq_len) and a chunk after a cached prefix.
    "prefill": ([70, 0, 45], [70, 0, 100]),
    # a mixed batch: prefill chunk, decode row, verify block, padding.
    "mixed": ([40, 1, 8, 0], [57, 33, 20, 0]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3], ids=lambda s: f"splits{s}")  # None: tests below
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, causal, num_splits, dtype):
    query_lens, seq_lens = CASES[case]
    run_and_check(query_lens, seq_lens, causal=causal, num_splits=num_splits, dtype=dtype,
                  seed=list(CASES).index(case))


@pytest.mark.parametrize("group", [1, 2, 4, 3])
def test_paged_attention_gqa_groups(group):
    """GQA groups (3 exercises a group that is not a power of two) on verify + prefill rows,
    with q a strided view into a wider buffer."""
    run_and_check([8, 0, 20], [30, 2, 20], causal=True, num_splits=None, group=group, n_kv=2,
                  seed=group, q_view=True)


@pytest.mark.parametrize("head_dim,page_size", [(16, 4), (64, 16), (32, 1)])
def test_paged_attention_head_dims_and_page_sizes(head_dim, page_size):
    run_and_check([5, 1, 16], [21, 50, 16], causal=True, num_splits=2, head_dim=head_dim,
                  page_size=page_size, n_kv=1, group=2, seed=head_dim)


def test_combine_slices_a_wide_tile_qwen3_5_27b_geometry():
    """GQA group 6 x head_dim 256 (Qwen3.5-27B): a 16-row verify tile holds 96 packed rows;
    the split combine works in 32-row x 64-dim slices (a decode row's tile: one slice of
    rows). Both equal the reference."""
    run_and_check([16, 1, 0], [40, 23, 0], causal=True, num_splits=3, n_kv=1, group=6, head_dim=256,
                  page_size=16)


def test_paged_attention_strided_q_and_default_out():
    q, k_cache, v_cache, meta = make_case([3, 6], [10, 40], n_kv=2, group=2, head_dim=32,
                                          page_size=8, dtype=torch.float32, causal=True)
    wide = torch.zeros(q.shape[0], 7, 64, device=DEVICE)
    wide[:, 1:5, :32] = q
    view = wide[:, 1:5, :32]
    out = paged_attention(view, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                          table_of(meta), 0.2, True, 6)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    ref = ref_paged_attention(q[:9], k_cache, v_cache, meta, 0.2)
    assert rel_err(out[:9], ref) < 1e-5


def test_paged_attention_long_prefill_many_query_blocks():
    """Enough rows for several query blocks per request, causal tiles skipped and split."""
    run_and_check([150, 1], [180, 200], causal=True, num_splits=2, n_kv=1, group=4, seed=7)
    run_and_check([150, 1], [180, 200], causal=False, num_splits=1, n_kv=1, group=4, seed=8)


def test_num_splits_choice():
    # Qwen3-8B shape, context 1024 in 16-token pages (64-page table): the split counts that
    # measured fastest on the H200 at batch 1, 8, 16, 32 (two 64-key tiles per split at most).
    assert [choose_num_splits(r, 8, 1, 64, 16) for r in (1, 8, 16, 32)] == [8, 4, 2, 1]
    # Never more splits than useful or allowed; monotone in the number of programs.
    assert choose_num_splits(1, 1, 1, 1, 16) == 1
    assert choose_num_splits(1, 1, 1, 10_000, 16) == MAX_SPLITS
    last = MAX_SPLITS
    for r in range(1, 70):
        s = choose_num_splits(r, 8, 1, 2560, 16)
        assert 1 <= s <= last
        last = s
    assert choose_num_splits(4, 8, 64, 128, 16) == 1  # prefill: programs already fill the GPU


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_write_kv(dtype):
    gen = torch.Generator().manual_seed(3)
    num_pages, page_size, n_kv, head_dim, num_tokens = 9, 4, 3, 32, 13
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding rows of a graph bucket
    # k, v as strided views of one fused buffer (as the qkv projection gives them)
    fused = torch.randn(num_tokens, 2, n_kv, head_dim * 2, generator=gen)
    k, v = fused[:, 0, :, :head_dim], fused[:, 1, :, head_dim:]
    init_k = torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen)
    init_v = torch.randn(num_pages, page_size, n_kv, head_dim, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    k_cache, v_cache = init_k.to(**to), init_v.to(**to)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    ref_write_kv(ref_k, ref_v, k[keep].to(DEVICE), v[keep].to(DEVICE), slots[keep].to(DEVICE))
    # float32 rows into a low-precision cache: the kernel casts like the twin does.
    store_kv(k_cache, v_cache, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_store_then_attend_roundtrip():
    """K/V written through store_kv (slot_mapping from AttentionMetadata's convention)
    read back by paged_attention as the reference reads them through write_kv."""
    gen = torch.Generator().manual_seed(11)
    page_size, n_kv, head_dim = 4, 2, 16
    seq_lens, tables = [6, 11], [[3, 1], [5, 2, 4]]
    k_cache = torch.zeros(6, page_size, n_kv, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = [t[p // page_size] * page_size + p % page_size
             for s, t in zip(seq_lens, tables) for p in range(s)]
    k = torch.randn(len(slots), n_kv, head_dim, generator=gen).to(DEVICE)
    v = torch.randn(len(slots), n_kv, head_dim, generator=gen).to(DEVICE)
    store_kv(k_cache, v_cache, k, v, torch.tensor(slots, device=DEVICE))
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    ref_write_kv(ref_k, ref_v, k, v, torch.tensor(slots, device=DEVICE))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# ------------------------------------------------------------------------------ GPU only


QWEN3_8B = dict(n_kv=8, group=4, head_dim=128, page_size=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ["decode", "verify", "draft", "prefill"])
def test_paged_attention_qwen3_shapes(shape, dtype):
    """Qwen3-8B attention shapes (8 KV heads x group 4, head_dim 128, 16-token pages) on the
    GPU; under the interpreter the same head geometry on one KV head and short contexts."""
    geometry = dict(QWEN3_8B, n_kv=8 if ON_GPU else 1)
    gen = torch.Generator().manual_seed(5)
    batch, ctx_lo, ctx_hi, rows = (8, 900, 1100, 16) if ON_GPU else (2, 20, 90, 4)
    ctx = torch.randint(ctx_lo, ctx_hi, (batch,), generator=gen).tolist()
    if shape == "decode":
        qlens = [1] * batch
    elif shape in ("verify", "draft"):
        qlens = [rows] * batch
    else:
        qlens, ctx = ([512, 1024, 0, 64], [512, 2048, 0, 100]) if ON_GPU else ([40, 0, 9], [40, 0, 30])
    for splits in (None, 1):
        run_and_check(qlens, ctx, causal=shape != "draft", num_splits=splits, dtype=dtype, **geometry)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay():
    """One captured bucket (4 requests x 16 rows, padded table) replayed with new metadata
    gives what eager calls give on the same inputs, for store_kv + both attention passes."""
    torch.manual_seed(0)
    n_kv, group, head_dim, page_size = 8, 4, 128, 16
    reqs, rows, max_pages, num_pages = 4, 16, 96, 512
    dtype = torch.bfloat16
    num_tokens = reqs * rows
    k_cache = torch.randn(num_pages, page_size, n_kv, head_dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.empty(num_tokens, n_kv * group, head_dim, device="cuda", dtype=dtype)
    k_new = torch.empty(num_tokens, n_kv, head_dim, device="cuda", dtype=dtype)
    v_new = torch.empty_like(k_new)
    qsl = torch.empty(reqs + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.empty(reqs, dtype=torch.int32, device="cuda")
    page_tables = torch.empty(reqs, max_pages, dtype=torch.int32, device="cuda")
    slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device="cuda")
    out_causal = torch.empty_like(q)
    out_full = torch.empty_like(q)

    def fill(lens, qlens, seed):
        g = torch.Generator().manual_seed(seed)
        perm = (torch.randperm(num_pages - 1, generator=g) + 1).int()
        table = torch.zeros(reqs, max_pages, dtype=torch.int32)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64)
        starts, used = [0], 0
        for r, (s, ql) in enumerate(zip(lens, qlens)):
            n = _pages_for(s, page_size)
            table[r, :n] = perm[used:used + n]
            used += n
            for i, pos in enumerate(range(s - ql, s)):
                slots[starts[-1] + i] = int(table[r, pos // page_size]) * page_size + pos % page_size
            starts.append(starts[-1] + ql)
        qsl.copy_(torch.tensor(starts, dtype=torch.int32))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        page_tables.copy_(table)
        slot_mapping.copy_(slots)
        q.copy_(torch.randn(q.shape, generator=g))
        k_new.copy_(torch.randn(k_new.shape, generator=g))
        v_new.copy_(torch.randn(v_new.shape, generator=g))

    def step():
        store_kv(k_cache, v_cache, k_new, v_new, slot_mapping)
        paged_attention(q, k_cache, v_cache, qsl, seq_lens, page_tables, 0.088, True, rows, out=out_causal)
        paged_attention(q, k_cache, v_cache, qsl, seq_lens, page_tables, 0.088, False, rows, out=out_full)

    fill([300, 1000, 16, 700], [16] * 4, seed=1)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    replays = [(2, [1500, 17, 0, 640], [16, 16, 0, 16]), (3, [33, 1400, 1200, 5], [16, 1, 16, 5])]
    for seed, lens, qlens in replays:
        fill(lens, qlens, seed)
        kc0, vc0 = k_cache.clone(), v_cache.clone()
        out_causal.fill_(float("nan"))
        out_full.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = sum(qlens)
        got = (out_causal[:n].clone(), out_full[:n].clone(), k_cache.clone(), v_cache.clone())
        k_cache.copy_(kc0)
        v_cache.copy_(vc0)
        step()
        torch.cuda.synchronize()
        assert torch.equal(got[0], out_causal[:n]) and torch.equal(got[1], out_full[:n])
        assert torch.equal(got[2], k_cache) and torch.equal(got[3], v_cache)
        meta = make_meta(slot_mapping, qsl, seq_lens, page_tables, True)
        assert rel_err(got[0], ref_paged_attention(q[:n], k_cache, v_cache, meta, 0.088)) < 1e-2
        meta = make_meta(slot_mapping, qsl, seq_lens, page_tables, False)
        assert rel_err(got[1], ref_paged_attention(q[:n], k_cache, v_cache, meta, 0.088)) < 1e-2


def test_warmup_launches_every_block_size_causal_and_split_variant(monkeypatch):
    """warmup() (run at GPU start-up) covers each BLOCK_Q that tile_geometry can choose, x
    causal / not, x split / not: the variants a serving step can meet."""
    from dflash_engine.kernels import attention as ka

    seen = set()
    real = ka.paged_attention

    def spy(q, *a, num_splits=None, split_keys=None, **k):
        causal = a[6]
        geometry = ka.tile_geometry(q.shape[0], q.shape[1] // a[0].shape[2], q.shape[2], False)
        if split_keys is None:
            seen.add((geometry[0], causal, num_splits > 1))
        else:
            seen.add(("decode rule", split_keys // geometry[2]))
        return real(q, *a, num_splits=num_splits, split_keys=split_keys, **k)

    monkeypatch.setattr(ka, "paged_attention", spy)
    n = ka.warmup(8, 2, 32, 16, torch.float32, torch.device(DEVICE))
    block_qs = {ka.tile_geometry(q, 4, 32, False)[0] for q in range(1, 512)}
    rule = {ka.decode_split_keys(r, kv, 1, bn)[0] // bn for r in range(1, 300) for kv in (1, 2, 3, 4, 8)
            for bn in (32, 64) if ka.decode_split_keys(r, kv, 1, bn)[0] is not None}
    assert rule <= set(ka._DECODE_SPLIT_TILES)
    assert seen == ({(b, c, s) for b in block_qs for c in (True, False) for s in (True, False)}
                    | {("decode rule", t) for t in ka._DECODE_SPLIT_TILES})
    assert n == len(seen)


def test_default_mode_decode_row_shares_the_verify_blocks_geometry_and_bits():
    """The default mode floors the tile at DECODE_TILE_ROWS query rows: a decode call (1 row per
    request) and a verify call (B <= 16 rows) run one geometry, and a token decoded alone gets
    the bits it gets as row i of a 16-row verify block (same batch, same split count)."""
    from dflash_engine.kernels import attention as ka

    for group, head_dim in ((3, 64), (4, 128), (8, 128), (1, 256)):
        want = ka.tile_geometry(16, group, head_dim, False)
        assert all(ka.tile_geometry(q, group, head_dim, False) == want for q in (1, 2, 4, 8, 16))
    torch.manual_seed(0)
    page, n_kv, heads, d, ctx = 16, 2, 6, 32, 200  # 16 verify rows at positions 184..199: 4 key tiles each
    k_cache = torch.randn(20, page, n_kv, d, device=DEVICE)
    v_cache = torch.randn(20, page, n_kv, d, device=DEVICE)
    table = torch.arange(1, 14, dtype=torch.int32, device=DEVICE)[None]
    block = torch.randn(16, heads, d, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 16], **i32)
    verify = ka.paged_attention(block, k_cache, v_cache, qsl, torch.tensor([ctx], **i32), table, 0.2, True, 16)
    one = torch.tensor([0, 1], **i32)
    for i in range(16):
        alone = ka.paged_attention(block[i:i + 1].contiguous(), k_cache, v_cache, one,
                                   torch.tensor([ctx - 15 + i], **i32), table, 0.2, True, 1)
        assert torch.equal(alone[0], verify[i]), i


@pytest.mark.parametrize("others", [0, 2])
def test_default_mode_decode_row_equals_its_verify_row_across_tile_and_split_boundaries(others):
    """A token decoded alone gets the bits it gets inside a 16-row verify block, at the same
    batch, wherever the block sits: blocks that straddle a key tile (64 keys) or a split
    boundary, page tables as wide as each call needs (eager) or one wide table (a graph
    bucket). Before the decode rule (decode_split_keys + every tile masked), the count rule's
    boundaries moved with the block's last row and the first rows of a straddling block took
    the masked path where the lone row took the fast one (run 35's trace on the H200)."""
    from dflash_engine.kernels import attention as ka

    torch.manual_seed(1)
    page, n_kv, heads, d = 16, 2, 6, 32
    other_ctx = [97, 301][:others]
    for ctx in (70, 130, 260):
        lens = [ctx, *other_ctx]
        need = [_pages_for(n, page) for n in lens]
        i32 = dict(dtype=torch.int32, device=DEVICE)
        k_cache = torch.randn(1 + sum(need), page, n_kv, d, device=DEVICE)
        v_cache = torch.randn_like(k_cache)
        starts = [1 + sum(need[:r]) for r in range(len(lens))]
        wide = torch.zeros(len(lens), 24, **i32)
        for r, (s0, n) in enumerate(zip(starts, need)):
            wide[r, :n] = torch.arange(s0, s0 + n, **i32)
        q_block = torch.randn(16, heads, d, device=DEVICE)
        q_others = torch.randn(others, heads, d, device=DEVICE)
        # verify: the block (16 rows) and each other request's one decode row; tables sized to need
        qsl = torch.tensor([0, 16, *range(17, 17 + others)], **i32)
        verify = ka.paged_attention(torch.cat([q_block, q_others]), k_cache, v_cache, qsl,
                                    torch.tensor(lens, **i32), wide[:, :max(need)].contiguous(), 0.2, True, 16)
        one = torch.arange(0, 2 + others, **i32)
        for i in (0, 5, 6, 7, 14, 15):
            alone = ka.paged_attention(torch.cat([q_block[i:i + 1], q_others]), k_cache, v_cache, one,
                                       torch.tensor([ctx - 15 + i, *other_ctx], **i32), wide, 0.2, True, 1)
            assert torch.equal(alone[0], verify[i]), (ctx, i)
            assert torch.equal(alone[1:], verify[16:])


def test_decode_split_keys_is_a_function_of_the_batch_only():
    from dflash_engine.kernels import attention as ka

    assert ka.decode_split_keys(32, 8, 1, 64) == (None, 1)  # 256 programs fill two waves: no split
    keys, count = ka.decode_split_keys(1, 8, 1, 64)
    assert count is None and keys == 128  # a lone request: two-tile splits (8 over 1,024 keys)
    for r in range(1, 64):
        keys, count = ka.decode_split_keys(r, 3, 1, 64)
        assert (keys is None) == (count == 1)
        if keys is not None:
            assert keys % 128 == 0 and (keys // 64) & (keys // 64 - 1) == 0


def test_splits_keep_at_least_the_minimum_keys_whatever_the_key_tile(monkeypatch):
    """Neither split rule cuts a context into runs of fewer than MIN_SPLIT_KEYS keys, for
    32- and 64-key tiles alike (run 46: 32-key tiles had halved a lone request's splits to 64
    keys, 15.0 us against 13.0 at 128); one wave never splits more than two."""
    from dflash_engine.kernels import attention as ka
    from dflash_engine.kernels import attention_splits as sp

    for block_n in (32, 64):
        assert ka.decode_split_keys(1, 8, 1, block_n) == (sp.MIN_SPLIT_KEYS, None)
        for r in range(1, 40):
            for n_kv in (1, 2, 8):
                two = ka.decode_split_keys(r, n_kv, 1, block_n)
                assert two[0] is None or two[0] >= sp.MIN_SPLIT_KEYS
                monkeypatch.setattr(sp, "ONE_WAVE_DECODE_SPLITS", True)
                one = ka.decode_split_keys(r, n_kv, 1, block_n)
                monkeypatch.setattr(sp, "ONE_WAVE_DECODE_SPLITS", False)
                assert one[0] is None or (two[0] is not None and one[0] >= two[0])
        for pages in (8, 64, 65, 513):
            for r in (1, 2, 4, 8):
                n = ka.choose_num_splits(r, 8, 1, pages, 16, block_n)
                assert n == 1 or pages * 16 // n >= sp.MIN_SPLIT_KEYS
                monkeypatch.setattr(sp, "ONE_WAVE_COUNT_SPLITS", not sp.ONE_WAVE_COUNT_SPLITS)
                other = ka.choose_num_splits(r, 8, 1, pages, 16, block_n)
                monkeypatch.setattr(sp, "ONE_WAVE_COUNT_SPLITS", not sp.ONE_WAVE_COUNT_SPLITS)
                one, two = (n, other) if sp.ONE_WAVE_COUNT_SPLITS else (other, n)
                assert one <= two  # one wave never splits more than two
    assert ka.choose_num_splits(1, 8, 1, 64, 16, 32) == ka.choose_num_splits(1, 8, 1, 64, 16, 64) == 8


def test_decode_split_keys_bounds_the_grid_of_wide_tables():
    """A wide page table (long max_model_len) gets larger splits, so that requests x splits
    stays near DECODE_GRID_REQUEST_SPLITS (bounded fp32 partials); tables a page apart (the
    spec-on engine reserves the verify block's rows) get the same size; the Qwen3-8B shape at
    8,192 keys (128 tiles, the measured configuration) keeps the table-free rule."""
    from dflash_engine.kernels import attention as ka
    from dflash_engine.kernels.attention_splits import DECODE_GRID_REQUEST_SPLITS

    for r in (1, 2, 4, 8, 16):
        assert ka.decode_split_keys(r, 8, 1, 64, 132, 128) == ka.decode_split_keys(r, 8, 1, 64)
    for n_kv, block_n in ((4, 32), (3, 64), (8, 64)):
        for table in (64, 200, 1024, 4096, 20000):
            for r in (1, 3, 8, 16, 24):
                keys, count = ka.decode_split_keys(r, n_kv, 1, block_n, 132, table)
                if keys is None:
                    continue
                assert keys >= ka.decode_split_keys(r, n_kv, 1, block_n)[0]
                assert r * -(-table // (keys // block_n)) <= 2 * DECODE_GRID_REQUEST_SPLITS
                assert ka.decode_split_keys(r, n_kv, 1, block_n, 132, table + 1) == (keys, count) or \
                    (table + 1) & table == 0  # only crossing a power of two of tiles may change it
