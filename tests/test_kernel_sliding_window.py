"""Sliding-window attention in the Triton paged-attention kernel against the torch reference
(ops/attention.py: a query at p reads keys kv with p - W < kv, and kv < p + W without
causality), and the exact mode's batch invariance with a window.

Runs on the GPU when there is one, else on CPU tensors under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 when nvidia-smi is absent), on tiny shapes.
Every K/V slot no row may read (before the request's first row's window start, past its
seq_len, the null page, spare pages) holds NaN, so a read of one poisons the result.
"""
from __future__ import annotations

import pytest
import torch

from dflash_engine.kernels.attention import paged_attention
from dflash_engine.ops.attention import AttentionMetadata, window_start
from dflash_engine.ops.attention import paged_attention as ref_paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 16
PAD_ROWS = 2


def make_case(q_lens, seq_lens, window, *, causal, page_size, n_kv=1, group=2, seed=0, table_slack=2,
              dtype=torch.float32):
    """Random q and paged K/V on shuffled pages; NaN wherever no row of the step may read."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // page_size) for s in seq_lens]
    num_pages = 1 + sum(need) + 2
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(need, default=0) + table_slack, dtype=torch.int32)
    shape = (num_pages, page_size, n_kv, HEAD_DIM)
    k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    at = 0
    for r, (q_len, s) in enumerate(zip(q_lens, seq_lens)):
        pages = perm[at:at + need[r]]
        at += need[r]
        table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        first = window_start(s - q_len, window) if q_len else s  # what this step's rows may read
        for pos in range(first, s):
            page, off = pages[pos // page_size], pos % page_size
            k_cache[page, off] = torch.randn(n_kv, HEAD_DIM, generator=gen)
            v_cache[page, off] = torch.randn(n_kv, HEAD_DIM, generator=gen)
    qsl = [0]
    for q_len in q_lens:
        qsl.append(qsl[-1] + q_len)
    q = torch.randn(qsl[-1] + PAD_ROWS, n_kv * group, HEAD_DIM, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=DEVICE),
        page_tables=table.to(DEVICE), causal=causal, max_query_len=max(q_lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
    )
    to = dict(device=DEVICE, dtype=dtype)
    return q.to(**to), k_cache.to(**to), v_cache.to(**to), meta


def kernel(q, k_cache, v_cache, meta, window, **mode):
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.page_tables,
                          HEAD_DIM ** -0.5, meta.causal, meta.max_query_len, out=out, window=window, **mode)
    assert got is out
    return out


# (q_lens, seq_lens, causal, page_size, GQA group): contexts shorter and longer than the
# windows, padding requests (q_len 0) among real ones.
CASES = {
    "decode": ([1, 1, 0, 1], [1, 90, 0, 37], True, 4, 2),
    "verify": ([16, 0, 16, 16], [16, 3, 100, 41], True, 1, 2),
    "draft": ([16, 16, 0, 16], [20, 130, 5, 16], False, 16, 3),  # the DFlash block pass: non-causal
    "prefill": ([70, 0, 1, 8], [100, 0, 33, 8], True, 8, 2),  # 70 rows: two query blocks
    "prefill_noncausal": ([70, 1], [70, 9], False, 8, 2),
}
MODES = {
    "auto": {},  # splits chosen by choose_num_splits (from the window's span)
    "splits1": dict(num_splits=1),
    "splits3": dict(num_splits=3),
    "fixed64": dict(split_keys=64),  # fixed-size splits on the default geometry
    "exact": dict(exact=True, split_keys=64),
}


# Every mode at windows 1 and 40; windows 3 and 8 in the modes that differ most (time).
WINDOW_MODES = [(w, m) for w in (1, 40) for m in MODES] + [(w, m) for w in (3, 8) for m in ("auto", "splits3", "exact")]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window,mode", WINDOW_MODES)
def test_windowed_kernel_matches_reference(window, case, mode):
    q_lens, seq_lens, causal, page_size, group = CASES[case]
    q, k_cache, v_cache, meta = make_case(q_lens, seq_lens, window, causal=causal, page_size=page_size,
                                          group=group, seed=window)
    out = kernel(q, k_cache, v_cache, meta, window, **MODES[mode])
    n = meta.query_start_loc_cpu[-1]
    ref = ref_paged_attention(q[:n], k_cache, v_cache, meta, HEAD_DIM ** -0.5, window)
    assert torch.isfinite(out[:n]).all(), "rows left unwritten, or a key outside the window was read"
    assert torch.isnan(out[n:]).all(), "wrote rows no request owns"
    torch.testing.assert_close(out[:n], ref, rtol=1e-4, atol=1e-5)


# Windows wider than a key tile plus a query block: tiles inside every row's window take the
# unmasked fast path, those at the window's edges the masked one.
WIDE_CASES = {
    "decode": ([1, 1], [300, 60], True, 16, 2),
    "verify": ([16, 16], [300, 16], True, 8, 2),
    "draft": ([16, 16], [300, 90], False, 8, 3),
    "prefill": ([130, 1], [200, 40], True, 8, 2),
    "prefill_noncausal": ([130], [130], False, 8, 2),
}


@pytest.mark.parametrize("mode", ["auto", "splits1"])
@pytest.mark.parametrize("case", list(WIDE_CASES))
def test_wide_window_fast_tiles_match_reference(case, mode):
    q_lens, seq_lens, causal, page_size, group = WIDE_CASES[case]
    window = 100
    q, k_cache, v_cache, meta = make_case(q_lens, seq_lens, window, causal=causal, page_size=page_size, group=group)
    out = kernel(q, k_cache, v_cache, meta, window, **MODES[mode])
    n = meta.query_start_loc_cpu[-1]
    torch.testing.assert_close(out[:n], ref_paged_attention(q[:n], k_cache, v_cache, meta, HEAD_DIM ** -0.5, window),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 0])
def test_no_window_is_full_attention(window):
    q, k_cache, v_cache, meta = make_case([16, 1], [40, 90], None, causal=False, page_size=8)
    n = meta.query_start_loc_cpu[-1]
    out = kernel(q, k_cache, v_cache, meta, window, num_splits=2)
    assert torch.equal(out[:n], kernel(q, k_cache, v_cache, meta, None, num_splits=2)[:n])
    torch.testing.assert_close(out[:n], ref_paged_attention(q[:n], k_cache, v_cache, meta, HEAD_DIM ** -0.5),
                               rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------ exact mode: batch invariance

PAGE = 16
SUBJECT_CTX = 230  # several 64-key splits: windows 40 and 100 start past split 0


class Pool:
    """Paged K/V shared by every batch of a test: the subject's pages (NaN before `dead`,
    which no row of any batch may read) and its neighbours' fresh random pages."""

    def __init__(self, dtype, split_keys, seed=0, pages=160):
        self.g = torch.Generator().manual_seed(seed)
        self.k = torch.full((pages, PAGE, 1, HEAD_DIM), float("nan"))  # GQA group 4
        self.v = torch.full_like(self.k, float("nan"))
        self.free = (torch.randperm(pages - 1, generator=self.g) + 1).tolist()
        self.dtype, self.split_keys = dtype, split_keys

    def table(self, keys: int, dead: int = 0) -> list[int]:
        n = -(-keys // PAGE)
        pages, self.free = self.free[:n], self.free[n:]
        for pos in range(dead, keys):
            self.k[pages[pos // PAGE], pos % PAGE] = torch.randn(1, HEAD_DIM, generator=self.g)
            self.v[pages[pos // PAGE], pos % PAGE] = torch.randn(1, HEAD_DIM, generator=self.g)
        return pages

    def rows(self, n: int) -> torch.Tensor:
        return torch.randn(n, 4, HEAD_DIM, generator=self.g)

    def attend(self, requests, causal, window, table_pages):
        """requests: (q rows, seq_len, pages). Returns out and the row offsets; checks the
        reference too."""
        q_lens = [q.shape[0] for q, _, _ in requests]
        table = torch.zeros(len(requests), table_pages, dtype=torch.int32)
        for r, (_, _, pages) in enumerate(requests):
            table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        qsl = [0]
        for n in q_lens:
            qsl.append(qsl[-1] + n)
        lens = [s for _, s, _ in requests]
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device=DEVICE),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE), page_tables=table.to(DEVICE),
            causal=causal, max_query_len=max(q_lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
        q = torch.cat([q for q, _, _ in requests]).to(DEVICE, self.dtype)
        k, v = self.k.to(DEVICE, self.dtype), self.v.to(DEVICE, self.dtype)
        out = kernel(q, k, v, meta, window, exact=True)
        ref = ref_paged_attention(q, k, v, meta, HEAD_DIM ** -0.5, window)
        tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[self.dtype]
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        return out, qsl

    def neighbours(self, n: int, max_q: int, window: int):
        reqs = []
        for _ in range(n):
            q_len = int(torch.randint(0, max_q + 1, (1,), generator=self.g))
            ctx = int(torch.randint(max(q_len, 1), 150, (1,), generator=self.g))
            reqs.append((self.rows(q_len), ctx, self.table(ctx, window_start(ctx - q_len, window))))
        return reqs


# The interpreter's dot is wrong for bf16: float16 takes the same low-precision path there.
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# (window, dtype, split_keys). Window 30 with 128-key splits: the verify block's first row
# starts its window in tile 2, its last row in tile 3, both in split 1 (the batch visits a
# tile of that split that the row alone does not).
EXACT_CASES = [(3, torch.float32, 64), (30, torch.float32, 128), (100, torch.float32, 64), (100, LOW, 64)]


@pytest.mark.parametrize("window,dtype,split_keys", EXACT_CASES, ids=str)
def test_exact_decode_row_alone_equals_the_row_in_a_batch_of_5(window, dtype, split_keys):
    """Causal: the subject's row at position p decoded alone (q_len 1) == the same row inside
    a 16-row verify block beside 4 other requests (one block straddling split boundaries
    and window starts), and inside a prefill chunk of two query blocks, bit for bit."""
    pool = Pool(dtype, split_keys, seed=window)
    block = pool.rows(16)  # rows at positions SUBJECT_CTX - 16 .. SUBJECT_CTX - 1
    p0 = SUBJECT_CTX - 16
    chunk_rows = 80  # the chunk's first row reads from the earliest window start of all
    pages = pool.table(SUBJECT_CTX, window_start(SUBJECT_CTX - chunk_rows, window))
    chunk = torch.cat([pool.rows(chunk_rows - 16), block])
    others = pool.neighbours(4, 16, window)
    for i in (0, 15):  # the block's first row (its window start is the block's) and its last
        alone, _ = pool.attend([(block[i:i + 1], p0 + i + 1, pages)], True, window, table_pages=16)
        out, qsl = pool.attend(others[:2] + [(block, SUBJECT_CTX, pages)] + others[2:], True, window,
                               table_pages=20)
        assert torch.equal(out[qsl[2] + i], alone[0]), i
        out, _ = pool.attend([(chunk[:chunk_rows - 16 + i + 1], p0 + i + 1, pages)], True, window, table_pages=15)
        assert torch.equal(out[chunk_rows - 16 + i], alone[0]), i


@pytest.mark.parametrize("window,dtype,split_keys", EXACT_CASES, ids=str)
def test_exact_draft_block_alone_equals_the_block_in_a_batch_of_5(window, dtype, split_keys):
    """Non-causal (the DFlash block pass): a 16-row block alone == the same block beside 4
    other requests under a wider table, bit for bit."""
    pool = Pool(dtype, split_keys, seed=10 + window)
    subject = (pool.rows(16), SUBJECT_CTX, pool.table(SUBJECT_CTX, window_start(SUBJECT_CTX - 16, window)))
    alone, _ = pool.attend([subject], False, window, table_pages=16)
    others = pool.neighbours(4, 16, window)
    out, qsl = pool.attend(others[:3] + [subject] + others[3:], False, window, table_pages=24)
    assert torch.equal(out[qsl[3]:qsl[4]], alone)


def test_warmup_covers_the_windowed_variants(monkeypatch):
    """warmup(windowed=True) launches every variant of warmup() with and without a window
    (the kernels specialise on a window being set); the default leaves them out. The decode
    rule's fixed-size splits (decode_split_keys) apply without a window only: once."""
    from dflash_engine.kernels import attention as ka

    seen = []
    real = ka.paged_attention

    def spy(q, *a, window=None, **k):
        seen.append((q.shape[0], a[6], k.get("num_splits"), k.get("split_keys"), k.get("exact"), bool(window)))
        return real(q, *a, window=window, **k)

    monkeypatch.setattr(ka, "paged_attention", spy)
    for exact in (False, True):
        seen.clear()
        plain = ka.warmup(8, 1, 16, 16, torch.float32, torch.device(DEVICE), exact=exact)
        assert not any(w for *_, w in seen)
        base = {v[:-1] for v in seen}
        seen.clear()
        n = ka.warmup(8, 1, 16, 16, torch.float32, torch.device(DEVICE), exact=exact, windowed=True)
        rule = sum(1 for v in base if v[3] is not None)
        assert rule == (0 if exact else len(ka._DECODE_SPLIT_TILES))
        assert n == 2 * plain - rule == len(seen)
        assert set(seen) == {v + (w,) for v in base for w in ((False, True) if v[3] is None else (False,))}
