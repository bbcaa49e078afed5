"""Issue 21, item 2: how often the default (not exact) GPU mode's spec-on output equals spec-off,
and which op makes a row's bits depend on the step it runs in.

    python bench/default_closeness.py --rows
    python bench/default_closeness.py --e2e VARIANT --draft DRAFT_DIR [--sets chat] [--concurrency 1]
        [--limit 64] [--max-tokens 256] [--draft-lengths 15,adaptive] [--json out.json]

--rows (random weights, no checkpoint): does a row's result depend on the rows beside it?
  - cuBLAS (F.linear, bf16) at the SmolLM2-135M and Qwen3-8B GEMM shapes: row 0 of an M-row
    call against row 0 computed alone, M = 1 .. 64;
  - the attention kernel (default mode): a token decoded as a 1-row request against the same
    token inside a 16-row verify block, with the decode call's tile geometry chosen from its own
    query length (today) or from 16 rows ("tile16"), at batch 1 and 32; and the decode call's
    time under both geometries.
--e2e: bench/eval_draft.py's spec-off vs spec-on comparison on the embedded SmolLM2 with a
  draft, with ops/dispatch patched per VARIANT ("+"-joined):
  default  as shipped;
  tile16   causal attention calls of fewer than 16 query rows use the 16-row tile geometry
           (the patch run 27 measured; the kernel has floored its tile at 16 rows since
           416cce3, so on that code tile16 changes nothing and `default` is the rule);
  logits   the logits from the exact GEMM (kernels/gemm.py, float32 out);
  gemm     every Linear through the exact GEMM;
  nosplit  every default-mode attention call in one split (no flash-decoding partials);
  eager    both engines with enforce_eager=True (no CUDA graphs): tells graph capture apart.
--trace I,J|:N: chat prompts I, J (or the first N) traced inside the target (trace() below): the first position
  whose final hidden state or tap-layer state differs between spec off and spec on.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

DEV = "cuda"
SHAPES = {  # name -> (heads, kv heads, head dim, {GEMM: (K, N)})
    "smollm2": (9, 3, 64, {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                           "logits": (576, 49152)}),
    "qwen3-8b": (32, 8, 128, {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576),
                              "down": (12288, 4096), "logits": (4096, 151936)}),
}
PAGE = 16


def gemm_rows() -> None:
    print("cuBLAS bf16: is row 0 of an M-row F.linear equal to row 0 alone? (y = equal)")
    ms = (1, 2, 4, 8, 16, 17, 32, 64)
    print(f"  {'shape':<18}" + "".join(f"{m:>4}" for m in ms))
    for model, (_, _, _, gemms) in SHAPES.items():
        for name, (k, n) in gemms.items():
            x = torch.randn(64, k, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
            alone = F.linear(x[:1], w)[0]
            cells = ["y" if torch.equal(F.linear(x[:m], w)[0], alone) else "." for m in ms]
            print(f"  {model + ' ' + name:<18}" + "".join(f"{c:>4}" for c in cells))
    print("cuBLAS bf16 inside CUDA graphs: is row 0 of a captured M-row F.linear equal to row 0 of a "
          "captured 1-row one (g) / of an eager 1-row one (e)? (y = equal)")
    print(f"  {'shape':<18}" + "".join(f"{m:>6}" for m in ms))
    for model, (_, _, _, gemms) in SHAPES.items():
        for name, (k, n) in gemms.items():
            x = torch.randn(64, k, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) / k**0.5
            eager_alone = F.linear(x[:1], w)[0]
            rows = {}
            for m in ms:
                out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up off the capture, as the graph runner does
                    torch.matmul(x[:m], w.t(), out=out)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out.copy_(F.linear(x[:m], w))
                g.replay()
                torch.cuda.synchronize()
                rows[m] = out[0].clone()
            cells = [("g" if torch.equal(rows[m], rows[1]) else ".") + ("e" if torch.equal(rows[m], eager_alone) else ".")
                     for m in ms]
            print(f"  {model + ' ' + name:<18}" + "".join(f"{c:>6}" for c in cells))


def attention_rows() -> None:
    from dflash_engine.kernels.attention import paged_attention

    print("attention (default mode): decode row == the same row in a 16-row verify block?")
    for model, (heads, kv, d, _) in SHAPES.items():
        gen = torch.Generator().manual_seed(0)
        for batch in (1, 32):
            for ctx in (300, 1000, 2000):
                width = -(-2048 // PAGE) + 2
                pages = batch * width + 1
                kc = torch.randn(pages, PAGE, kv, d, generator=gen).to(DEV, torch.bfloat16)
                vc = torch.randn(pages, PAGE, kv, d, generator=gen).to(DEV, torch.bfloat16)
                table = (torch.arange(batch * width, dtype=torch.int32).view(batch, width) + 1).to(DEV)
                blocks = torch.randn(batch, 16, heads, d, generator=gen).to(DEV, torch.bfloat16)
                qsl = torch.arange(0, 16 * batch + 1, 16, dtype=torch.int32, device=DEV)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
                verify = paged_attention(blocks.flatten(0, 1), kc, vc, qsl, lens, table, d**-0.5, True, 16)
                verify = verify.view(batch, 16, heads, d)
                same = {1: 0, 16: 0}
                for i in range(16):
                    q = blocks[:, i].contiguous()
                    dqsl = torch.arange(0, batch + 1, dtype=torch.int32, device=DEV)
                    dlens = lens - 15 + i
                    for geom in same:
                        out = paged_attention(q, kc, vc, dqsl, dlens, table, d**-0.5, True, geom)
                        same[geom] += int(torch.equal(out, verify[:, i]))
                print(f"  {model:<9} batch={batch:<3} ctx={ctx:<5} rows equal (of 16): own geometry {same[1]:>2},"
                      f" tile16 {same[16]:>2}")


def attention_time() -> None:
    import triton.testing

    from dflash_engine.kernels.attention import paged_attention

    print("decode attention us per call (CUDA-graph replay): own geometry | tile16")
    for model, (heads, kv, d, _) in SHAPES.items():
        for ctx in (1024, 4096):
            for batch in (1, 8, 32, 64):
                width = -(-ctx // PAGE)
                kc = torch.randn(batch * width + 1, PAGE, kv, d, device=DEV, dtype=torch.bfloat16)
                vc = torch.randn_like(kc)
                table = (torch.arange(batch * width, dtype=torch.int32).view(batch, width) + 1).to(DEV)
                q = torch.randn(batch, heads, d, device=DEV, dtype=torch.bfloat16)
                qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=DEV)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
                t = [1e3 * triton.testing.do_bench_cudagraph(
                    lambda g=g: paged_attention(q, kc, vc, qsl, lens, table, d**-0.5, True, g), rep=30)
                    for g in (1, 16)]
                print(f"  {model:<9} ctx={ctx:<5} batch={batch:<3} {t[0]:7.1f} | {t[1]:7.1f}")


def patch(variant: str) -> None:
    from dflash_engine.ops import dispatch

    parts = set(variant.split("+")) - {"default"}
    unknown = parts - {"tile16", "logits", "gemm", "nosplit", "eager"}
    if unknown:
        raise SystemExit(f"unknown variant part(s): {sorted(unknown)}")
    if "tile16" in parts:
        attend = dispatch.paged_attention

        def paged_attention(q, k_cache, v_cache, meta, scale, batch_invariant=False, window=None):
            if meta.causal and meta.max_query_len < 16:
                meta = dataclasses.replace(meta, max_query_len=16)
            return attend(q, k_cache, v_cache, meta, scale, batch_invariant, window)

        dispatch.paged_attention = paged_attention
    if "logits" in parts:
        from dflash_engine.kernels import gemm

        dispatch.logits = lambda hidden, weight, bi: gemm.matmul(hidden, weight, None, out_dtype=torch.float32)
    if "gemm" in parts:
        from dflash_engine.kernels import gemm

        dispatch.linear = lambda x, weight, bias, bi: gemm.matmul(x, weight, bias)
    if "nosplit" in parts:
        from dflash_engine.kernels import attention

        kernel = attention.paged_attention

        def one_split(*a, **kw):
            if not kw.get("exact"):
                kw["num_splits"] = 1
            return kernel(*a, **kw)

        attention.paged_attention = one_split


def e2e(args) -> int:
    import eval_draft

    patch(args.e2e)
    sets = {"humaneval": eval_draft.humaneval_prompts, "chat": lambda: list(eval_draft.CHAT_PROMPTS)}
    rows = []
    for name in args.sets.split(","):
        prompts = sets[name]()[: args.limit]
        for c in [int(x) for x in args.concurrency.split(",")]:
            kw = dict(max_tokens=args.max_tokens, device=args.device, batch_invariant=False, max_model_len=2048,
                      gpu_memory_utilization=0.9, num_gpu_blocks_override=4096)  # a dropped engine's memory is not always given back: a fixed KV pool each
            if "eager" in args.e2e.split("+"):
                kw["enforce_eager"] = True
            off, off_tokens = eval_draft.run(None, None, prompts, c, **kw)
            for k in args.draft_lengths.split(","):
                on, on_tokens = eval_draft.run(None, args.draft, prompts, c, **kw, draft_length=k)
                same = sum(a == b for a, b in zip(on_tokens, off_tokens))
                first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                         for a, b in zip(on_tokens, off_tokens) if a != b]
                row = {"variant": args.e2e, "set": name, "c": c, "k": on["k"], "same": f"{same}/{len(prompts)}",
                       "first_diff_tokens": sorted(first), "tok_s_off": off["tok_s"], "tok_s_on": on["tok_s"],
                       "tau": on["tau"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:  # after every row: a run cut short keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
    return 0


def trace(args) -> int:
    """--trace: where do spec-off and spec-on first differ, inside the target? Each engine runs
    the chosen chat prompts once, c = 1, eagerly (hooks do not run inside CUDA graphs; run 34
    found the same differences eager as with graphs), prefix caching off (every prompt row is
    recomputed). While the target's forward runs, every ops/dispatch call's output is
    fingerprinted per row (`_record_ops`), and a forward hook keeps each row's final hidden
    state; rows are keyed by (prompt, position, input token): a verify row whose draft was
    rejected is replaced when that position is verified again. Along each committed sequence
    the two runs are compared: the first position where any op's row differs and which op
    (the root: a K/V row that differs changes later positions' attention), the first position
    whose final hidden differs, and the first sampled token that differs."""
    import eval_draft
    import numpy as np

    prompts = [list(eval_draft.CHAT_PROMPTS)[i] for i in args.trace]
    runs = {}
    for name, draft in (("off", None), ("on", args.draft)):
        hidden: dict[tuple[int, int, int], np.ndarray] = {}
        ops: dict[tuple[int, int, int], np.ndarray] = {}
        e = eval_draft.build(None, draft, prompts, 1, max_tokens=args.max_tokens, device=args.device,
                             batch_invariant=False, max_model_len=2048, gpu_memory_utilization=0.9,
                             draft_length=args.draft_lengths.split(",")[0] if draft else None,
                             enforce_eager=True, num_gpu_blocks_override=4096, cpu_weights="none",
                             enable_prefix_caching=False)
        target = e["llm"].engine.runner.models.target
        target.backend = None  # the CPU's fast layer loop bypasses ops/dispatch (the GPU has none)
        names: list[str] = []
        handles = _record_ops(target, hidden, ops, names)
        eval_draft.timed_pass(e)
        for h in handles:
            h.remove()
        seqs = [(list(o.prompt_token_ids) + list(o.outputs[0].token_ids), len(o.prompt_token_ids)) for o in e["outs"]]
        runs[name] = (seqs, hidden, ops)
        eval_draft.finish(e)
    out = []
    (seqs_off, h_off, o_off), (seqs_on, h_on, o_on) = runs["off"], runs["on"]
    for q, ((s_off, n_prompt), (s_on, _)) in enumerate(zip(seqs_off, seqs_on)):
        first_tok = next((j for j, (a, b) in enumerate(zip(s_off, s_on)) if a != b), None)
        end = min(len(s_off), len(s_on)) if first_tok is None else first_tok + 1
        row = {"prompt": args.trace[q], "first_token_diff": None if first_tok is None else first_tok - n_prompt,
               "first_op_diff": None, "first_hidden_diff": None, "missing": 0}
        for pos in range(end - 1):  # the row at pos predicts the token at pos + 1
            ka, kb = (q, pos, s_off[pos]), (q, pos, s_on[pos])
            if ka not in h_off or kb not in h_on:
                row["missing"] += 1
                continue
            oa, ob = o_off[ka], o_on[kb]
            if row["first_op_diff"] is None and not np.array_equal(oa, ob):
                j = int(np.argmax(oa != ob)) if len(oa) == len(ob) else min(len(oa), len(ob))
                per_layer = [n for n in names[:j]]
                row["first_op_diff"] = {"position": pos - n_prompt, "op_index": j, "ops_per_forward": len(oa),
                                        "op": names[j] if j < len(names) else None,
                                        "ops_before_in_call_order": per_layer[-3:],
                                        "ops_differing_there": int((oa != ob).sum()) if len(oa) == len(ob) else None}
            if not np.array_equal(h_off[ka], h_on[kb]):
                row["first_hidden_diff"] = pos - n_prompt
                row["hidden_max_abs_diff"] = float(np.abs(h_off[ka] - h_on[kb]).max())
                break
        out.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


_TRACED_OPS = ("linear", "rms_norm", "add_rms_norm", "qk_norm_rope", "paged_attention", "silu_and_mul")


def _record_ops(target, hidden: dict, ops: dict, names: list) -> list:
    """While `target.forward` runs: each ops/dispatch call's output (every part of a tuple),
    per row, fingerprinted on the device (the row's bits as int32 words times fixed odd
    multipliers, summed in int64: exact, so the fingerprint's own reduction order cannot
    matter), one transfer per forward; ops[(prompt, position, input token)] = the row's
    fingerprints in call order, `names` their op names, hidden[...] the row's final hidden
    state. The prompt index advances at each forward that starts at position 0 (c = 1,
    prefix caching off). Returns handles whose remove() undoes the patching."""

    from dflash_engine.ops import dispatch

    live: dict = {"prompt": -1}
    mults: dict[tuple[int, torch.device], torch.Tensor] = {}

    def fingerprint(t: torch.Tensor, n: int) -> torch.Tensor | None:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            return None
        w = t.detach().contiguous().view(n, -1)
        w = w.view(torch.int16).to(torch.int64) if w.element_size() == 2 else w.view(torch.int32).to(torch.int64)
        key = (w.shape[1], w.device)
        if key not in mults:
            g = torch.Generator().manual_seed(w.shape[1])
            mults[key] = (torch.randint(1, 2**31 - 1, (w.shape[1],), generator=g, dtype=torch.int64) | 1).to(w.device)
        return (w * mults[key]).sum(-1)

    def wrap(name, fn):
        def traced(*args, **kwargs):
            out = fn(*args, **kwargs)
            if "rows" in live:
                for part, t in enumerate(out if isinstance(out, tuple) else (out,)):
                    f = fingerprint(t, live["n"])
                    if f is not None:
                        live["rows"].append(f)
                        if live["first"]:
                            names.append(f"{name}.{part}")
            return out
        return traced

    saved = {name: getattr(dispatch, name) for name in _TRACED_OPS}
    for name, fn in saved.items():
        setattr(dispatch, name, wrap(name, fn))

    def pre(mod, args):
        ids, positions = args[0], args[1]
        pos = positions.tolist()
        if pos[0] == 0:
            live["prompt"] += 1
        live.update(rows=[], n=len(pos), keys=[(live["prompt"], p, t) for p, t in zip(pos, ids.tolist())],
                    first=not names)

    def post(mod, args, output):
        h = (output[0] if isinstance(output, tuple) else output).float().cpu().numpy()
        f = torch.stack(live.pop("rows"), dim=1).cpu().numpy()  # [T, ops]
        for r, key in enumerate(live.pop("keys")):
            ops[key], hidden[key] = f[r], h[r]
        live.pop("n"), live.pop("first")

    class _Undo:
        def remove(self):
            for name, fn in saved.items():
                setattr(dispatch, name, fn)

    return [target.register_forward_pre_hook(pre), target.register_forward_hook(post), _Undo()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", action="store_true")
    ap.add_argument("--e2e", default=None, metavar="VARIANT")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--sets", default="chat")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft-lengths", default="15,adaptive")
    ap.add_argument("--trace", type=lambda v: [int(x) for x in v.split(",")] if "," in v or not v.startswith(":")
                    else list(range(int(v[1:]))), default=None, metavar="I,J|:N",
                    help="chat prompts (indices, or :N for the first N) to trace inside the target (needs --draft)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="--e2e and --trace (cpu: a smoke run)")
    args = ap.parse_args(argv)
    if args.rows:
        gemm_rows()
        attention_rows()
        attention_time()
    if args.e2e:
        if not args.draft:
            ap.error("--e2e needs --draft")
        return e2e(args)
    if args.trace is not None:
        if not args.draft:
            ap.error("--trace needs --draft")
        return trace(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
