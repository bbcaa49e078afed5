"""Replay the adaptive draft-length estimator offline over acceptance traces (issue 20).

    python bench/replay_draft_len.py trace --k 15 --sets humaneval --limit 24 --out he.json
    python bench/replay_draft_len.py replay he.json chat.json

`trace` runs the engine (CPU, the shipped draft) at a fixed K and records every committed
step's (handles, drafts, accepted). `replay` walks each request's steps one at a time: a K
chosen at a step commits min(accepted at the traced K, K) + 1 tokens (a shorter block proposes
the same leading drafts) and costs that K's entry of a cost table (batch 1 and 32 of the
H200's live table in run 39, the CPU's at batch 1). It compares fixed K against an estimator
written again here from rust/src/draft_len.rs (global and per-request decayed counts, the
prior chain) with no calibration, a factor per K, or a factor per draft position (what the
core does since the session of 2026-12-06). Not modelled: the explore / probe / plain-after
rules, batching (one request at a time), and what a different K does to later steps (the
replay keeps the traced positions).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np

CANDS = [0, 1, 3, 7, 15]
TABLES = {  # ms per step, by K: busy + host gap
    "gpu b1": {0: 1.38, 1: 1.64, 3: 1.665, 7: 1.696, 15: 1.70},
    "gpu b32": {0: 1.81, 1: 2.0, 3: 2.17, 7: 2.40, 15: 2.61},
    "cpu b1": {0: 9.0, 1: 18.4, 3: 20.8, 7: 30.0, 15: 45.0},
}
PRIOR_FIRST, PRIOR_DECAY, PRIOR_WEIGHT = 0.6, 0.9, 2.0
GLOBAL_DECAY, REQUEST_DECAY, CAL_DECAY, CAL_PRIOR = 0.98, 0.9, 0.99, 16.0


class Estimator:
    def __init__(self, k_max: int, cost: dict, mode: str = "position", n0: float = 2.0):
        self.k_max, self.cost, self.mode, self.n0 = k_max, cost, mode, n0
        self.cands = [k for k in CANDS if k <= k_max]
        self.gt, self.ga = np.zeros(k_max), np.zeros(k_max)
        self.req: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.per_k = {k: [0.0, 0.0] for k in self.cands}  # mode "k": (predicted drafts, accepted)
        self.pp, self.pa = np.zeros(k_max), np.zeros(k_max)  # mode "position": predicted / observed reach

    def estimates(self, h: int) -> np.ndarray:
        g, prior = [], PRIOR_FIRST
        for n, a in zip(self.gt, self.ga):
            g.append((a + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT))
            prior = PRIOR_DECAY * g[-1]
        g = np.array(g)
        if h not in self.req:
            return g
        t, a = self.req[h]
        return (a + self.n0 * g) / (t + self.n0)

    def tokens(self, h: int) -> dict[int, float]:
        reach = np.cumprod(self.estimates(h))
        if self.mode == "position":
            reach = reach * (self.pa + CAL_PRIOR) / (self.pp + CAL_PRIOR)
        out = {}
        for k in self.cands:
            f = 1.0
            if self.mode == "k" and k:
                f = (self.per_k[k][1] + 2 * CAL_PRIOR) / (self.per_k[k][0] + 2 * CAL_PRIOR)
            out[k] = 1 + f * reach[:k].sum()
        return out

    def choose(self, h: int) -> int:
        t = self.tokens(h)
        return max(self.cands, key=lambda k: (t[k] / self.cost[k], -k))

    def observe(self, h: int, k: int, acc: int) -> None:
        if k and h in self.req:
            reach = np.cumprod(self.estimates(h))
            for c in self.per_k.values():
                c[0] *= CAL_DECAY
                c[1] *= CAL_DECAY
            self.per_k[k][0] += reach[:k].sum()
            self.per_k[k][1] += acc
            self.pp *= CAL_DECAY
            self.pa *= CAL_DECAY
            self.pp[:k] += reach[:k]
            self.pa[:acc] += 1
        if k:
            self.gt *= GLOBAL_DECAY
            self.ga *= GLOBAL_DECAY
        t, a = self.req.setdefault(h, (np.zeros(self.k_max), np.zeros(self.k_max)))
        t *= REQUEST_DECAY
        a *= REQUEST_DECAY
        for j in range(min(acc + 1, k)):
            self.gt[j] += 1
            t[j] += 1
            if j < acc:
                self.ga[j] += 1
                a[j] += 1


def streams(trace: list, k: int) -> list[list[int]]:
    per: dict[int, list[int]] = {}
    for handles, drafts, accepted in trace:
        for h, d, a in zip(handles, drafts, accepted):
            if d == k:
                per.setdefault(h, []).append(a)
    return [per[h] for h in sorted(per)]


def replay(seqs: list[list[int]], cost: dict, est: Estimator | None = None, fixed: int | None = None):
    tokens = seconds = 0.0
    chosen: dict[int, int] = {}
    for h, seq in enumerate(seqs):
        for traced in seq:
            k = fixed if fixed is not None else est.choose(h)
            acc = min(traced, k)
            tokens, seconds = tokens + acc + 1, seconds + cost[k]
            chosen[k] = chosen.get(k, 0) + 1
            if est is not None:
                est.observe(h, k, acc)
    return tokens / seconds, dict(sorted(chosen.items()))


def trace(args) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import eval_draft

    from dflash_engine import LLM, SamplingParams

    spec = {"method": "dflash", "num_speculative_tokens": args.k}
    if args.draft:
        spec["model"] = args.draft
    llm = LLM(speculative_config=spec, max_num_seqs=args.max_num_seqs, device="cpu")
    eng, steps = llm.engine, []
    land = eng._land

    def recording_land(plan, flight):
        result = land(plan, flight)
        steps.append((plan.handles.tolist(), plan.num_drafts.tolist(), eng._spec_backlog[-1][1].tolist()))
        return result

    eng._land = recording_land
    sets = {"humaneval": eval_draft.humaneval_prompts, "chat": lambda: list(eval_draft.CHAT_PROMPTS)}
    prompts = [p for s in args.sets.split(",") for p in sets[s]()[: args.limit]]
    llm.chat([[{"role": "user", "content": p}] for p in prompts],
             SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    with open(args.out, "w") as f:
        json.dump({"k": args.k, "steps": steps}, f)
    print(f"{len(steps)} steps -> {args.out}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--k", type=int, default=15)
    t.add_argument("--draft", default=None, help="default: the embedded model's shipped draft")
    t.add_argument("--sets", default="humaneval")
    t.add_argument("--limit", type=int, default=24)
    t.add_argument("--max-tokens", type=int, default=192)
    t.add_argument("--max-num-seqs", type=int, default=8)
    t.add_argument("--out", required=True)
    r = sub.add_parser("replay")
    r.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)
    if args.cmd == "trace":
        trace(args)
        return 0
    seqs, k_max = [], None
    for path in args.traces:
        with open(path) as f:
            d = json.load(f)
        k_max = d["k"]
        seqs += streams(d["steps"], k_max)
    print(f"{len(seqs)} requests, {sum(map(len, seqs))} steps at K = {k_max}")
    for name, cost in TABLES.items():
        fixed = {k: replay(seqs, cost, fixed=k)[0] for k in CANDS if k <= k_max}
        best = max(fixed.values())
        print(f"== {name}: fixed " + ", ".join(f"K={k} {v / best:.3f}" for k, v in fixed.items()))
        for mode, n0 in itertools.product(["none", "k", "position"], [2.0, 8.0]):
            rate, chosen = replay(seqs, cost, Estimator(k_max, cost, mode, n0))
            print(f"   calibration {mode:<8} N0 {n0:<4}: {rate / best:.3f} of the best fixed K, K chosen {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
