"""What a plain step costs a speculative engine on the CPU (issue 20, chat at c = 1).

    python bench/plain_step_ab.py [--prompts 24] [--max-tokens 128] [--rounds 3] [--concurrency 1]

Engines over the same chat prompts at c = --concurrency (embedded SmolLM2, shipped draft, fast mode),
built first, then their passes interleaved round by round (the machine's drift hits all):
  off           speculation off;
  adaptive      the default policy (its live cost table is printed at the end);
  plain         the adaptive engine with costs that make every step plain (K = 0),
                its context rows deferred (worker/deferred_context.py, the default);
  plain-write   the same, every step writing its own context rows (no deferral);
  plain-none    the same, the context never written (a lower bound; drafts would be blind).
Prints tok/s, busy and idle ms per step, and the deferred writes' count, rows and time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

DRAFT = os.path.join(os.path.dirname(__file__), "..", "python", "dflash_engine", "drafts",
                     "smollm2-135m-instruct-dflash")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    args = ap.parse_args(argv)
    import eval_draft

    prompts = list(eval_draft.CHAT_PROMPTS)[:args.prompts]
    engines = {}
    for name in ("off", "adaptive", "plain", "plain-write", "plain-none"):
        e = eval_draft.build(None, None if name == "off" else DRAFT, prompts, args.concurrency, max_tokens=args.max_tokens,
                             device="cpu", batch_invariant=False, max_model_len=2048, gpu_memory_utilization=0.5,
                             draft_length=None if name == "off" else "adaptive")
        runner = e["llm"].engine.runner
        if name.startswith("plain"):
            c = runner.step_costs
            e["llm"].engine.scheduler.set_step_costs(c.buckets, c.ks, [[1e-3 if k == 0 else 1.0 for k in c.ks]
                                                                      for _ in c.buckets])
            e["llm"].engine._live_costs = None
        if name == "plain-write":
            runner.deferred = None
        if name == "plain-none":
            runner.deferred = None
            runner.models.draft.write_context = lambda *a, **k: None
        if runner.deferred is not None:  # time the batched writes
            d, flush, spent = runner.deferred, runner.deferred.flush, [0.0, 0]

            def timed(d=d, flush=flush, spent=spent):
                t0, n = time.perf_counter(), d.num_rows
                flush()
                spent[0] += time.perf_counter() - t0
                spent[1] += n
            d.flush, e["flush"] = timed, spent
        engines[name] = e
    print(f"{'round':>5} {'engine':<12} {'tok/s':>7} {'busy ms':>8} {'idle ms':>8} {'steps':>6}  deferred writes")
    for r in range(args.rounds):
        for name, e in engines.items():
            before = e["llm"].stats()
            eval_draft.timed_pass(e)
            s = e["llm"].stats()
            n = s.num_steps - before.num_steps
            extra = ""
            if "flush" in e:
                extra = f"{e['flush'][1]} rows in {e['flush'][0] * 1e3:.0f} ms (all rounds)"
            print(f"{r:>5} {name:<12} {e['rates'][-1]:>7.1f} {(s.step_busy_seconds - before.step_busy_seconds) / n * 1e3:>8.2f} "
                  f"{(s.step_idle_seconds - before.step_idle_seconds) / n * 1e3:>8.2f} {n:>6}  {extra}", flush=True)
    live = engines["adaptive"]["llm"].engine._live_costs
    if live is not None:
        st = live.startup
        print("adaptive, live cost table at batch 1 (ms, busy + host):",
              {k: round(v * 1e3, 2) for k, v in zip(st.ks, live.seconds()[0])},
              "K chosen:", engines["adaptive"]["llm"].stats().spec_draft_len_counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
