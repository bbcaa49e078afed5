"""The paged attention kernel (kernels/attention.py) alone, at the Qwen3-8B verify and draft
shapes (32 q / 8 KV heads of 128, 16 query rows per request, context 1024), against its own
tile variants and a contiguous-K/V reference (issue 22: attention is 14% of the c = 32 step
at ~100 TFLOP/s; 0.56 ms of the c = 1 step with its combine):

    python bench/bench_attention.py [--c 1,8,32] [--context 1024] [--sweep | --splits] [--prefill 2048]
        [--pool-pages 18395] [--json out.json]

Each configuration is timed inside a CUDA graph over enough copies of the K/V cache (>= 512
MB) that every key is read from HBM, as in a step (each layer's cache read once). Reports us
per call, the K/V read rate (GB/s) and the attention TFLOP/s (4 x heads x head_dim per
visible (row, key) pair). `--sweep` adds tile variants: BLOCK_N, warps and pipeline stages
(monkeypatched `_pick_blocks` / `_launch_config`), and page sizes 16 / 64 / whole-context
(the page-table gather against none), and at c <= 16 the context splits (fixed split_keys
64 / 128 / 256 / 512, or none; `--splits`: those alone). The reference is torch's SDPA (flash backend, GQA) on
contiguous K/V, the same rows and keys, non-causal. Without a GPU it runs a smoke pass on
tiny sizes under the interpreter (numbers meaningless).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
from dflash_engine.kernels import attention as attn  # noqa: E402
from dflash_engine.ops.gemm_tuning import time_graph_us  # noqa: E402  (the GEMM tuning's graph timer)


class Case:
    """One call's inputs: c requests of q_len rows over `context` committed keys, `copies`
    caches (one per simulated layer), page size `page`."""

    def __init__(self, c, q_len, context, page, n_heads, n_kv, head_dim, dtype, device, min_bytes, pool_pages=0):
        self.c, self.q_len, self.seq = c, q_len, context + q_len
        pages_per = -(-self.seq // page)
        kv_bytes = 2 * c * pages_per * page * n_kv * head_dim * dtype.itemsize
        self.copies = max(1, -(-min_bytes // kv_bytes))
        self.kv_bytes = kv_bytes
        self.caches = []
        # `pool_pages`: the caches hold that many pages (a served pool's size per layer) and the
        # requests' pages are drawn from all of them, so a layer's reads spread over the whole
        # pool as in the engine, not over a region the size of the batch's K/V.
        pool = max(pool_pages, c * pages_per)
        for _ in range(self.copies):
            kc = torch.randn(pool + 1, page, n_kv, head_dim, dtype=dtype, device=device)
            self.caches.append((kc, torch.randn_like(kc)))
        # Each request's pages in a shuffled order (a real pool is not contiguous).
        perm = torch.randperm(pool, device=device)[:c * pages_per].to(torch.int32) + 1
        self.table = perm.view(c, pages_per).contiguous()
        self.q = torch.randn(c * q_len, n_heads, head_dim, dtype=dtype, device=device)
        self.out = torch.empty_like(self.q)
        self.qsl = torch.arange(0, c * q_len + 1, q_len, dtype=torch.int32, device=device)
        self.lens = torch.full((c,), self.seq, dtype=torch.int32, device=device)
        self.scale = head_dim ** -0.5

    def run(self, i, causal, **split):
        kc, vc = self.caches[i]
        attn.paged_attention(self.q, kc, vc, self.qsl, self.lens, self.table, self.scale, causal,
                             self.q_len, out=self.out, **split)

    def flops(self, n_heads, head_dim, causal):
        pairs = self.q_len * (self.seq - self.q_len) + (self.q_len * (self.q_len + 1) // 2 if causal
                                                        else self.q_len * self.q_len)
        return 4 * n_heads * head_dim * pairs * self.c


def patched(block_n=None, warps=None, stages=None):
    """Context: the kernel's tile choice with BLOCK_N / warps / stages replaced."""
    pick, launch = attn._pick_blocks, attn._launch_config

    class _Ctx:
        def __enter__(self):
            if block_n is not None:
                attn._pick_blocks = lambda *a: (*pick(*a)[:2], block_n)
            if warps is not None or stages is not None:
                def cfg(*a):
                    w, s = launch(*a)
                    return (warps or w, stages or s)
                attn._launch_config = cfg

        def __exit__(self, *exc):
            attn._pick_blocks, attn._launch_config = pick, launch
    return _Ctx()


def sdpa_us(case, n_heads, n_kv, head_dim, dtype, device, cuda):
    """torch SDPA (flash, GQA) over contiguous K/V of the same rows and keys, non-causal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(case.c, n_heads, case.q_len, head_dim, dtype=dtype, device=device)
    kvs = [(torch.randn(case.c, n_kv, case.seq, head_dim, dtype=dtype, device=device),) * 2
           for _ in range(case.copies)]
    backend = SDPBackend.FLASH_ATTENTION if cuda else SDPBackend.MATH

    def fn(i):
        with sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(q, kvs[i][0], kvs[i][1], enable_gqa=True)
    return time_graph_us(fn, case.copies, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--c", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--q-len", type=int, default=16)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--splits", action="store_true", help="only the context-split variants (c <= 16), no tile sweep")
    ap.add_argument("--prefill", type=int, default=0, help="also time one causal chunk of this many rows")
    ap.add_argument("--pool-pages", type=int, default=0,
                    help="also time the default tiles with each layer's cache this many 16-token pages (the "
                         "engine's pool, e.g. 18395 for the 8B shape at --gpu-memory-utilization 0.9) and the "
                         "requests' pages drawn from all of it (address spread: TLB reach)")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        n_heads, n_kv, head_dim, dtype, context, min_bytes = 32, 8, 128, torch.bfloat16, args.context, 512 << 20
        pages = [16, 64, None] if args.sweep else [16]
    else:
        n_heads, n_kv, head_dim, dtype, context, min_bytes = 4, 2, 32, torch.float32, 64, 0
        pages = [16]
    variants = [("default", {})]
    if args.sweep and cuda:
        for bn, w, s in [(32, 4, 3), (32, 4, 4), (32, 4, 5), (32, 8, 3), (32, 8, 4), (64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 2), (64, 8, 3),
                         (128, 4, 2), (128, 4, 3), (128, 8, 3)]:
            variants.append((f"BLOCK_N {bn}, {w} warps, {s} stages", dict(block_n=bn, warps=w, stages=s)))
    rows = []
    if args.prefill:  # one causal chunk from an empty context: the 128-row prefill tiles
        case = Case(1, args.prefill, 0, 16, n_heads, n_kv, head_dim, dtype, device, min_bytes)
        for name, kw in variants:
            try:
                with patched(**kw):
                    us = time_graph_us(lambda i: case.run(i, True), case.copies, device)
            except Exception as e:  # noqa: BLE001
                print(f"prefill {name}: failed: {str(e).splitlines()[0][:120]}")
                continue
            rows.append(dict(c=1, page=16, kind=f"prefill {args.prefill}", variant=name, us=us,
                             tflops=case.flops(n_heads, head_dim, True) / us / 1e6))
            print(f"prefill {args.prefill} rows {name:<32} {us:8.1f} us  {rows[-1]['tflops']:6.1f} TFLOP/s", flush=True)
        case = None  # (frees the caches before the next case)
    for c in [int(x) for x in args.c.split(",")]:
        for page in pages + (["pool"] if args.pool_pages else []):
            pool = args.pool_pages if page == "pool" else 0
            page = 16 if page == "pool" else page
            pg = page or (context + args.q_len)
            case = Case(c, args.q_len, context, pg, n_heads, n_kv, head_dim, dtype, device, min_bytes,
                        pool_pages=pool if cuda else 4 * c * (-(-(context + args.q_len) // pg)) * bool(pool))
            for causal in (True, False):
                kind = "verify (causal)" if causal else "draft (non-causal)"
                split_variants = [(f"split_keys {n}", dict(split_keys=n)) for n in (64, 128, 256, 512)]
                split_variants.append(("one split", dict(num_splits=1)))
                for name, kw in (variants + (split_variants if (args.sweep or args.splits) and c <= 16 else [])
                                 if page == 16 and not pool else variants[:1]):
                    split = {k: kw.pop(k) for k in ("split_keys", "num_splits") if k in kw}
                    try:
                        with patched(**kw):
                            us = time_graph_us(lambda i: case.run(i, causal, **split), case.copies, device)
                    except Exception as e:  # noqa: BLE001 (a variant out of shared memory: recorded, not fatal)
                        print(f"c={c} page={pg} {kind} {name}: failed: {str(e).splitlines()[0][:120]}")
                        continue
                    if pool:
                        name = f"{name}, pool of {case.caches[0][0].shape[0] - 1} pages"
                    r = dict(c=c, page=pg, kind=kind, variant=name, us=us,
                             gbs=case.kv_bytes / us / 1e3, tflops=case.flops(n_heads, head_dim, causal) / us / 1e6)
                    rows.append(r)
                    print(f"c={c:>3} page={pg:>5} {kind:<19} {name:<32} {us:8.1f} us  "
                          f"{r['gbs']:7.0f} GB/s  {r['tflops']:6.1f} TFLOP/s", flush=True)
            if page == 16 and not pool:
                us = sdpa_us(case, n_heads, n_kv, head_dim, dtype, device, cuda)
                r = dict(c=c, page=None, kind="sdpa contiguous (non-causal)", variant="torch flash", us=us,
                         gbs=case.kv_bytes / us / 1e3, tflops=case.flops(n_heads, head_dim, False) / us / 1e6)
                rows.append(r)
                print(f"c={c:>3} {'contiguous':>10} sdpa flash (GQA, non-causal)        {us:8.1f} us  "
                      f"{r['gbs']:7.0f} GB/s  {r['tflops']:6.1f} TFLOP/s", flush=True)
            case = None  # (frees the caches before the next case)
            if cuda:
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if cuda else "cpu (interpreter)", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
