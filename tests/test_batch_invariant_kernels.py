"""The exact mode on the kernel path: a row's bits never depend on the rows beside it.

DFlash is lossless only if the target's logits for a row are the same in a verify step (B
rows per request, other requests around it) as in a plain decode step (one row). On the
GPU that needs the exact mode's kernels: the fixed-tile GEMM (kernels/gemm.py) and the
attention with fixed-size context splits and one geometry (kernels/attention.py,
exact=True). Each test compares a row computed alone with the same row inside batches of
other sizes, compositions and paddings, bit for bit.

Runs on the GPU when there is one (bf16 too), else on CPU tensors under Triton's interpreter
(tests/conftest.py) in float32 and float16: the interpreter's dot is wrong for bf16, and
float16 takes the same low-precision-inputs, float32-accumulation path.
"""
from __future__ import annotations

import pytest
import torch
from attention_meta import meta_for_batch

from dflash_engine.kernels.attention import EXACT_SPLIT_KEYS, paged_attention
from dflash_engine.kernels.gemm import matmul
from dflash_engine.ops.attention import paged_attention as ref_paged_attention
from dflash_engine.ops.gemm import matmul as ref_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
LOW = torch.bfloat16 if ON_GPU else torch.float16
DTYPES = [torch.float32, LOW] + ([torch.float16] if ON_GPU else [])
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------- GEMM


def gemm_case(m, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g)
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), b.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32], ids=["out_in_dtype", "out_fp32"])
def test_gemm_row_alone_equals_row_in_batches_of_5_17_and_70(dtype, bias, out_dtype):
    """K and N are not multiples of the tile (masked tails); 70 rows span two M tiles, the
    subject landing in the second one."""
    k, n = 100, 150
    x, w, b = gemm_case(70, k, n, dtype, seed=1)
    b = b if bias else None
    subject = x[40:41]
    alone = matmul(subject, w, b, out_dtype)
    for rows, at in ((5, 2), (17, 16), (70, 69)):
        batch = x[:rows].clone()
        batch[at] = subject[0]
        got = matmul(batch, w, b, out_dtype)
        assert torch.equal(got[at], alone[0]), (rows, at)
        assert torch.equal(got[:at], matmul(batch[:at], w, b, out_dtype))  # prefixes too
    assert alone.dtype == (out_dtype or dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_matches_its_torch_twin(dtype):
    x, w, b = gemm_case(9, 72, 40, dtype, seed=2)
    x3 = x.view(3, 3, 72)  # leading dims are kept
    got = matmul(x3, w, b)
    assert got.shape == (3, 3, 40) and got.dtype == dtype
    assert rel_err(got, ref_matmul(x3, w, b)) < REL_TOL[dtype]
    logits = matmul(x, w, None, torch.float32)
    assert logits.dtype == torch.float32
    assert rel_err(logits, ref_matmul(x, w, None, torch.float32)) < (1e-5 if dtype == torch.float32 else 1e-3)
    assert matmul(x[:0], w, b).shape == (0, 40)
    with pytest.raises(ValueError):
        matmul(x, w.float() if dtype != torch.float32 else w.half())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (12288, 4096), (4096, 151936)])
def test_gemm_invariant_at_qwen3_8b_shapes_bf16(k, n):
    """qkv, o_proj, down_proj and lm_head of Qwen3-8B: decode-sized vs verify-sized M."""
    x, w, _ = gemm_case(512, k, n, torch.bfloat16, seed=3)
    for out_dtype in (None, torch.float32):
        full = matmul(x, w, None, out_dtype)
        for m in (1, 5, 16, 17, 64, 65, 128):
            assert torch.equal(matmul(x[:m], w, None, out_dtype), full[:m]), m
        assert rel_err(full, ref_matmul(x, w, None, out_dtype)) < 1e-2


# ------------------------------------------------------------------------------ attention

N_KV, GROUP, HEAD_DIM, PAGE = 2, 2, 16, 16
SUBJECT_CTX = 300  # the subject request's committed context (several 64-key tiles)


class Pool:
    """Paged K/V with a subject request (fixed pages and contents) and random neighbours.
    Unused slots hold NaN so a read outside any context would poison the result."""

    def __init__(self, dtype, pages=400, seed=0):
        g = torch.Generator().manual_seed(seed)
        shape = (pages, PAGE, N_KV, HEAD_DIM)
        self.k = torch.full(shape, float("nan"))
        self.v = torch.full(shape, float("nan"))
        perm = (torch.randperm(pages - 1, generator=g) + 1).tolist()
        self.free = perm
        self.g = g
        self.dtype = dtype

    def table(self, keys: int) -> list[int]:
        """Fresh pages filled with random K/V for `keys` positions."""
        n = -(-keys // PAGE)
        pages, self.free = self.free[:n], self.free[n:]
        for j, p in enumerate(pages):
            used = min(PAGE, keys - j * PAGE)
            self.k[p, :used] = torch.randn(used, N_KV, HEAD_DIM, generator=self.g)
            self.v[p, :used] = torch.randn(used, N_KV, HEAD_DIM, generator=self.g)
        return pages

    def caches(self):
        return self.k.to(DEVICE, self.dtype), self.v.to(DEVICE, self.dtype)


def attend(pool, requests, causal, *, table_pages, split_keys, exact=True, pad_rows=3):
    """requests: (q rows [q_len, H, D], seq_len, page list). Returns out [T, H, D] and the
    row offset of each request. `table_pages`: the table width (a graph bucket's padding)."""
    q_lens = [q.shape[0] for q, _, _ in requests]
    tables = [pages + [0] * (table_pages - len(pages)) for _, _, pages in requests]
    meta, _ = meta_for_batch(q_lens, [s for _, s, _ in requests], tables, PAGE, causal, DEVICE)
    q = torch.cat([q for q, _, _ in requests] + [torch.full((pad_rows, N_KV * GROUP, HEAD_DIM), float("nan"))])
    q = q.to(DEVICE, pool.dtype)
    k, v = pool.caches()
    out = paged_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.page_tables, HEAD_DIM**-0.5,
                          causal, meta.max_query_len, split_keys=split_keys, exact=exact)
    ref = ref_paged_attention(q, k, v, meta, HEAD_DIM**-0.5)
    rows = meta.query_start_loc_cpu[-1]
    assert rel_err(out[:rows], ref[:rows]) < REL_TOL[pool.dtype]
    return out, meta.query_start_loc_cpu


def neighbours(pool, g, n, max_q):
    """n requests with random q_len in [0, max_q] (0: a graph bucket's padding request) and
    random contexts."""
    reqs = []
    for _ in range(n):
        q_len = int(torch.randint(0, max_q + 1, (1,), generator=g))
        ctx = int(torch.randint(max(q_len, 1), 60, (1,), generator=g))
        reqs.append((torch.randn(q_len, N_KV * GROUP, HEAD_DIM, generator=g), ctx, pool.table(ctx)))
    return reqs


@pytest.mark.parametrize("dtype,split_keys", [(torch.float32, 64), (torch.float32, 128), (LOW, 64)]
                         + ([(LOW, EXACT_SPLIT_KEYS)] if ON_GPU else []), ids=str)
def test_attention_decode_row_equals_the_row_in_verify_and_prefill_blocks(dtype, split_keys):
    """The subject's row at position p: decoded alone (q_len 1, context p + 1) and as row i
    of a B-row verify block (context p - i + B) beside 4 or 16 other requests (padding
    requests among them), under different table widths; and inside a prefill chunk."""
    pool = Pool(dtype)
    g = torch.Generator().manual_seed(5)
    pages = pool.table(SUBJECT_CTX)
    block = torch.randn(8, N_KV * GROUP, HEAD_DIM, generator=g)  # rows at positions 292..299
    p0 = SUBJECT_CTX - 8

    def row_out(out, qsl, r, i):
        return out[qsl[r] + i]

    for i in (1, 7):  # the subject row: position p0 + i
        pos = p0 + i
        out, qsl = attend(pool, [(block[i:i + 1], pos + 1, pages)], True, table_pages=20, split_keys=split_keys)
        alone = row_out(out, qsl, 0, 0)
        for n_others, width, b in ((4, 20, 4), (16, 32, 8), (4, 64, 1)):
            first = max(0, i - b + 1)  # a B-row block ending at or after the subject row
            reqs = neighbours(pool, g, n_others, max_q=b)
            at = int(torch.randint(0, n_others + 1, (1,), generator=g))
            reqs.insert(at, (block[first:first + b], p0 + first + b, pages))
            out, qsl = attend(pool, reqs, True, table_pages=width, split_keys=split_keys)
            assert torch.equal(row_out(out, qsl, at, i - first), alone), (i, n_others, width, b)
        # a prefill chunk of 40 rows over the same context holds the row too
        chunk_q = torch.cat([torch.randn(32, N_KV * GROUP, HEAD_DIM, generator=g), block])
        out, qsl = attend(pool, [(chunk_q[: 32 + i + 1], pos + 1, pages)], True, table_pages=24,
                          split_keys=split_keys)
        assert torch.equal(row_out(out, qsl, 0, 32 + i), alone), i


def test_attention_block_straddling_a_split_boundary():
    """A verify block at positions 58..69 with 64-key splits: rows up to 63 have one split
    (written by the main kernel), later rows two (partials + combine). Each row equals its
    decode alone, beside a neighbour, and the reference (checked in `attend`)."""
    pool = Pool(torch.float32)
    g = torch.Generator().manual_seed(8)
    pages = pool.table(70)
    block = torch.randn(12, N_KV * GROUP, HEAD_DIM, generator=g)
    reqs = neighbours(pool, g, 2, max_q=4)
    reqs.insert(1, (block, 70, pages))
    out, qsl = attend(pool, reqs, True, table_pages=8, split_keys=64)
    for i in range(12):
        alone, _ = attend(pool, [(block[i:i + 1], 58 + i + 1, pages)], True, table_pages=5, split_keys=64)
        assert torch.equal(out[qsl[1] + i], alone[0]), i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_non_causal_block_is_invariant_to_its_batch(dtype):
    """The DFlash draft pass (non-causal): a request's block rows alone vs beside 4 / 16
    others, with the default split size (contexts spanning two 512-key splits)."""
    pool = Pool(dtype)
    g = torch.Generator().manual_seed(6)
    ctx = EXACT_SPLIT_KEYS + 100
    subject = (torch.randn(4, N_KV * GROUP, HEAD_DIM, generator=g), ctx, pool.table(ctx))
    out, qsl = attend(pool, [subject], False, table_pages=48, split_keys=None)
    alone = out[:4]
    for n_others, width in ((4, 48), (16, 64)):
        reqs = neighbours(pool, g, n_others, max_q=4)
        reqs.insert(1, subject)
        out, qsl = attend(pool, reqs, False, table_pages=width, split_keys=None)
        assert torch.equal(out[qsl[1]:qsl[2]], alone), n_others


def test_attention_fixed_split_rule_in_the_default_mode_matches_the_reference():
    """split_keys without exact: the batch-independent split rule on the default geometry
    (the proposal for the default mode, to be measured on the device)."""
    pool = Pool(torch.float32)
    g = torch.Generator().manual_seed(7)
    reqs = neighbours(pool, g, 5, max_q=6) + [(torch.randn(3, 4, HEAD_DIM, generator=g), 250, pool.table(250))]
    for causal in (True, False):
        attend(pool, reqs, causal, table_pages=20, split_keys=64, exact=False)  # checks vs the reference


# ---------------------------------------------------------------------- whole tiny target


class Requests:
    """A miniature model runner: paged KV for a tiny target, requests advanced step by step."""

    def __init__(self, model, tables, dtype):
        from dflash_engine.worker.kv_cache import KVCache

        self.kv = KVCache.allocate(model.config, None, 1 + max(p for t in tables for p in t), 4, dtype)
        self.tables, self.lens, self.model = tables, [0] * len(tables), model

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed chunks (request -> token ids; others idle this step) -> float32 logits per request."""
        order = sorted(chunks)
        q_lens = [len(chunks[r]) for r in order]
        seq_lens = [self.lens[r] + n for r, n in zip(order, q_lens)]
        meta, positions = meta_for_batch(q_lens, seq_lens, [self.tables[r] for r in order], 4, True)
        ids = torch.tensor([t for r in order for t in chunks[r]], dtype=torch.int64)
        with torch.no_grad():
            hidden, _ = self.model(ids, positions, meta, self.kv)
            logits = self.model.compute_logits(hidden)
        qsl = meta.query_start_loc_cpu
        for r, s in zip(order, seq_lens):
            self.lens[r] = s
        return {r: logits[qsl[j]:qsl[j + 1]] for j, r in enumerate(order)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_tiny_target_decode_equals_verify_bit_for_bit_on_the_kernel_path(qwen3_dir, monkeypatch, dtype):
    """Spec off (decode one token per step, alone) vs spec on (a 4-row verify block beside
    other requests, after a batched prefill): the same logits bits for every position the
    two share, through the Triton GEMM, attention, norms and RoPE in the exact mode."""
    from dflash_engine.models import load_target

    if ON_GPU:
        pytest.skip("the interpreter run; on the GPU tests/test_gpu_step.py covers the engine")
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    model = load_target(qwen3_dir, dtype=dtype, batch_invariant=True)
    g = torch.Generator().manual_seed(11)
    prompt_a, prompt_b, prompt_c = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 12, 5))
    tables = [[3, 9, 1, 7], [2, 8, 5, 11], [4, 10, 6, 12]]  # scattered pages, 16 positions each
    decode = [int(t) for t in torch.randint(0, 256, (4,), generator=g)]

    alone = Requests(model, tables, dtype)
    first = alone.step({0: prompt_a})[0]
    rows = [alone.step({0: [t]})[0][0] for t in decode]  # spec off: one row per step

    batched = Requests(model, tables, dtype)
    pre = batched.step({0: prompt_a, 1: prompt_b, 2: prompt_c})
    assert torch.equal(pre[0], first), "prefill alone == prefill beside others"
    batched.step({1: [5]})  # request 1 runs a decode step of its own in between
    verify = batched.step({0: decode, 1: [9], 2: [1, 2, 3]})  # spec on: a 4-row verify block
    for i, row in enumerate(rows):
        assert torch.equal(verify[0][i], row), f"verify row {i} != its decode step"
    assert verify[0].dtype == torch.float32


# ------------------------------------------------------------- the engine on the GPU (bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_bf16_exact_mode_spec_on_equals_spec_off_on_the_gpu(trained, enforce_eager):
    """Issue 21's acceptance test: bf16 on the GPU, the exact mode, a draft accepted often
    (verify blocks of 1..B rows, several requests per step): spec on == spec off, token for
    token, and at batch 1 == at batch 8."""
    from draft_training import random_prompts

    from dflash_engine import LLM, SamplingParams

    ps = [{"prompt_token_ids": p} for p in random_prompts(12, 8, seed=4321).tolist()]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(model=str(trained.target), device="cuda", dtype="bfloat16", num_gpu_blocks_override=256,
              batch_invariant=True, enforce_eager=enforce_eager)
    spec = {"method": "dflash", "model": str(trained.draft), "draft_length": "fixed"}

    def run(max_num_seqs, speculative_config=None):
        llm = LLM(**kw, max_num_seqs=max_num_seqs, speculative_config=speculative_config)
        out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        return out, llm.stats()

    on, stats = run(8, spec)
    assert stats.mean_acceptance_length > 1.5, "drafts must be accepted for verify blocks to matter"
    off, _ = run(8)
    assert on == off
    alone, _ = run(1, spec)
    assert alone == on


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_bf16_exact_mode_with_chunked_prefill_and_preemption_on_the_gpu(trained):
    """Issue 21 at c = 1, 8 and 32 under pressure: prompts of 8..47 tokens prefilled in
    chunks of a 48-token step budget beside decoding requests, and a 24-page pool that
    preempts (and recomputes) requests at c = 8 and 32: spec on equals spec off alone."""
    from draft_training import random_prompts

    from dflash_engine import LLM, SamplingParams

    base = random_prompts(32, 47, seed=99).tolist()
    ps = [{"prompt_token_ids": p[:8 + (7 * i) % 40]} for i, p in enumerate(base)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "dflash", "model": str(trained.draft), "draft_length": "fixed"}

    def run(max_num_seqs, speculative_config=None):
        llm = LLM(model=str(trained.target), device="cuda", dtype="bfloat16", batch_invariant=True,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=48, num_gpu_blocks_override=24,
                  speculative_config=speculative_config)
        out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        return out, llm.stats()

    alone, _ = run(1)
    for c in (1, 8, 32):
        on, stats = run(c, spec)
        assert on == alone, c
        assert stats.mean_acceptance_length > 1.3
        if c > 1:
            assert stats.num_preemptions > 0, c


def test_warmup_compiles_the_exact_variants():
    from dflash_engine.kernels.attention import warmup

    assert warmup(4, 2, 16, 16, torch.float32, torch.device(DEVICE), exact=True) == 2  # causal and not
