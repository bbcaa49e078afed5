"""The exact (batch-invariant) mode on the GPU (issue 21): is it exact, and what does it cost?

    python bench/batch_invariant_gpu.py [--check] [--time] [--e2e TARGET_DIR DRAFT_DIR]

--check: at Qwen3-8B shapes in bf16, a row computed alone vs inside bigger batches, bit for
  bit: the fixed-tile GEMM (kernels/gemm.py) at M = 1..256, and paged attention (decode row
  vs the same row in 16-row verify blocks, batches 1..64, two table widths) in the exact
  mode -- and, for contrast, in the default mode (expected to differ). Exit status 1 when
  the exact mode differs anywhere.
--time: microseconds per call (CUDA-graph replays, no launch overhead) of
  - the exact GEMM vs cuBLAS (F.linear) for one decoder layer's GEMMs and the logits;
  - attention: the default split count (`choose_num_splits`), the batch-independent rule
    (`split_keys` 512 / 1024 on the default geometry: the proposal for the default mode),
    and the exact mode, for decode (1 row) and verify (16 rows) at several batches.
--e2e: spec on vs spec off through the engine, bf16, exact mode, on a checkpoint (e.g.
  `python -m dflash_engine.random_checkpoint --shape qwen3-8b /tmp/q8 --draft /tmp/q8d`), at
  each --concurrency, with chunked prefill and preemption (e2e()): the greedy tokens must
  equal exact spec-off alone; prints tokens/s of both modes and of the default mode.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
import triton.testing

from dflash_engine.kernels.attention import choose_num_splits, paged_attention
from dflash_engine.kernels.gemm import matmul

DEV = "cuda"
N_HEADS, N_KV, HEAD_DIM, PAGE = 32, 8, 128, 16
# Qwen3-8B: (K, N) of qkv, o_proj, gate_up, down, and the logits
GEMMS = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096),
         "logits": (4096, 151936)}


def gemm_check() -> int:
    bad = 0
    for name, (k, n) in GEMMS.items():
        x = torch.randn(256, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
        for out_dtype in (None, torch.float32):
            full = matmul(x, w, None, out_dtype)
            for m in (1, 2, 5, 16, 17, 64, 65, 128):
                diff = int((matmul(x[:m], w, None, out_dtype) != full[:m]).any(-1).sum())
                bad += diff
                if diff:
                    print(f"  GEMM {name} out={out_dtype} M={m}: {diff} rows differ from M=256")
    print(f"GEMM: {'exact' if bad == 0 else f'{bad} rows differ'}")
    return bad


class Cache:
    """Random bf16 K/V pages; each request gets its own consecutive-free shuffled pages."""

    def __init__(self, pages: int):
        shape = (pages, PAGE, N_KV, HEAD_DIM)
        self.k = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        self.v = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        self.perm = (torch.randperm(pages - 1) + 1).tolist()

    def take(self, keys: int) -> list[int]:
        n = -(-keys // PAGE)
        out, self.perm = self.perm[:n], self.perm[n:]
        return out


def plan(cache, qs, ctxs, tables, width):
    """The device inputs of one attention call, built once (a CUDA graph cannot copy them)."""
    qsl = [0]
    for q in qs:
        qsl.append(qsl[-1] + q.shape[0])
    table = torch.zeros(len(qs), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return (torch.cat(qs), cache.k, cache.v, torch.tensor(qsl, dtype=torch.int32, device=DEV),
            torch.tensor(ctxs, dtype=torch.int32, device=DEV), table.to(DEV), HEAD_DIM**-0.5, True,
            max(q.shape[0] for q in qs))


def attend(cache, qs, ctxs, tables, width, **kw):
    return paged_attention(*plan(cache, qs, ctxs, tables, width), **kw), None


def attention_check(exact: bool) -> int:
    """Subject rows decoded alone vs inside 16-row verify blocks beside 0..63 others."""
    gen = torch.Generator().manual_seed(0)
    cache = Cache(40000)
    bad = 0
    for ctx in (700, 3000, 9000):
        pages = cache.take(ctx)
        block = torch.randn(16, N_HEADS, HEAD_DIM, generator=gen).to(DEV, torch.bfloat16)
        p0 = ctx - 16
        alone = []
        for i in range(16):
            out, _ = attend(cache, [block[i:i + 1]], [p0 + i + 1], [pages], -(-ctx // PAGE), exact=exact)
            alone.append(out[0])
        for batch in (1, 8, 32, 64):
            others = [(torch.randn(16, N_HEADS, HEAD_DIM, generator=gen).to(DEV, torch.bfloat16), c, cache.take(c))
                      for c in torch.randint(20, 4000, (batch - 1,), generator=gen).tolist()]
            for width in (-(-ctx // PAGE), 2560):  # sized to need / a max-length graph bucket
                qs = [block] + [q for q, _, _ in others]
                out, _ = attend(cache, qs, [ctx] + [c for _, c, _ in others], [pages] + [t for _, _, t in others],
                                max(width, -(-4000 // PAGE)), exact=exact)
                diff = sum(int(not torch.equal(out[i], alone[i])) for i in range(16))
                bad += diff
                if diff and exact:
                    print(f"  attention ctx={ctx} batch={batch} width={width}: {diff}/16 rows differ")
            cache.perm += [p for _, _, t in others for p in t]  # give the neighbours' pages back
    print(f"attention ({'exact' if exact else 'default'} mode): "
          f"{'exact' if bad == 0 else f'{bad} rows differ from their decode step'}")
    return bad


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50)


def gemm_time() -> None:
    print("GEMM us per call (exact Triton / cuBLAS):")
    for m in (1, 16, 64, 128, 512, 2048):
        cells = []
        for name, (k, n) in GEMMS.items():
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
            exact, cublas = us(lambda x=x, w=w: matmul(x, w)), us(lambda x=x, w=w: F.linear(x, w))
            cells.append(f"{name} {exact:.0f}/{cublas:.0f}")
        print(f"  M={m:5d}: " + "  ".join(cells))


def attention_time() -> None:
    print("attention us per call: default split count (n) | split_keys=512 | split_keys=1024 | exact")
    for ctx in (1024, 8192):
        for rows in (1, 16):
            for batch in (1, 4, 8, 16, 32, 64):
                cache = Cache(batch * -(-ctx // PAGE) + 2)
                tables = [cache.take(ctx) for _ in range(batch)]
                qs = [torch.randn(rows, N_HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16) for _ in range(batch)]
                width = -(-ctx // PAGE)
                args = plan(cache, qs, [ctx] * batch, tables, width)
                n = choose_num_splits(batch, N_KV, 1, width, PAGE)
                t = [us(lambda a=args, kw=kw: paged_attention(*a, **kw))
                     for kw in ({}, {"split_keys": 512}, {"split_keys": 1024}, {"exact": True})]
                print(f"  ctx={ctx:5d} rows={rows:2d} batch={batch:2d}: {t[0]:7.1f} ({n:2d}) | {t[1]:7.1f} | "
                      f"{t[2]:7.1f} | {t[3]:7.1f}")


def e2e(target: str, draft: str, concurrency: list[int], num_prompts: int = 8) -> bool:
    """Exact-mode spec on at each concurrency against exact spec off alone (c = 1), token for
    token. Prompts of 16..700 tokens with `max_num_batched_tokens` 512 (long prompts prefill
    in chunks beside decoding requests) and a KV pool of 400 pages (at c = 32 requests are
    preempted and recomputed): the conditions the issue names. Prints tokens/s, preemptions
    and equal requests per run, and the default mode's spec-off tokens/s for the cost."""
    from dflash_engine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(16, 700, (num_prompts,), generator=gen).tolist()
    ps = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=gen).tolist()} for n in lens]  # any vocabulary
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = {"method": "dflash", "model": draft, "draft_length": "fixed"}
    pressure = dict(max_num_batched_tokens=512, num_gpu_blocks_override=400, max_model_len=1024)
    runs, ok = {}, True
    plan = [("exact spec-off", 1, dict(batch_invariant=True))]
    plan += [(f"exact spec-on c={c}", c, dict(batch_invariant=True, speculative_config=spec)) for c in concurrency]
    plan += [("default spec-off", max(concurrency), dict(batch_invariant=False))]
    for name, c, kw in plan:
        llm = LLM(model=target, dtype="bfloat16", max_num_seqs=c, **pressure, **kw)
        llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
        before = llm.stats()
        t0 = time.perf_counter()
        out = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        dt = time.perf_counter() - t0
        st = llm.stats()
        runs[name] = out
        line = (f"{name}: {sum(map(len, out)) / dt:.0f} tokens/s, preemptions "
                f"{st.num_preemptions - before.num_preemptions}, steps {st.num_steps - before.num_steps}")
        if name.startswith("exact spec-on"):
            same = sum(a == b for a, b in zip(out, runs["exact spec-off"]))
            ok &= same == len(ps)
            line += f", tau {st.mean_acceptance_length:.2f}: {same}/{len(ps)} requests equal to exact spec-off alone"
        print(line, flush=True)
        del llm
        torch.cuda.empty_cache()
    print(f"e2e bf16 exact mode: spec-on == spec-off at c = {concurrency}: {ok}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--e2e", nargs=2, metavar=("TARGET", "DRAFT"))
    ap.add_argument("--concurrency", default="1,8,32", help="--e2e: spec-on concurrencies")
    ap.add_argument("--num-prompts", type=int, default=32, help="--e2e")
    args = ap.parse_args()
    ok = True
    if args.check:
        ok &= gemm_check() == 0
        ok &= attention_check(exact=True) == 0
        attention_check(exact=False)
    if args.time:
        gemm_time()
        attention_time()
    if args.e2e:
        ok &= e2e(*args.e2e, [int(c) for c in args.concurrency.split(",")], args.num_prompts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
