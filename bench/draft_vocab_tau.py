"""τ of a DFlash draft with and without a reduced draft vocabulary (speculative_config
draft_vocab_size; docs/perf.md "Draft vocabulary"): the embedded SmolLM2 target by default,
K fixed, the first N HumanEval and chat prompts as user messages, greedy. Each engine's outputs
are compared with the full vocabulary's (lossless: they should be equal on the CPU in float32).

    python bench/draft_vocab_tau.py --draft DIR [--sizes 4096,16384] [--limit 16] [--max-tokens 64] [--sets humaneval,chat]
        [--device cpu] [--k 15] [--concurrency 8]

DIR needs a draft_vocab.json (`dflash-engine draft-vocab --source stdlib-text --out DIR`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    from eval_draft import CHAT_PROMPTS, humaneval_prompts

    from dflash_engine import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sets", default="humaneval,chat")
    args = ap.parse_args(argv)
    sources = {"humaneval": humaneval_prompts, "chat": lambda: CHAT_PROMPTS}
    sets = {name: sources[name]()[:args.limit] for name in args.sets.split(",")}
    outs = {}
    for size in [None] + [int(x) for x in args.sizes.split(",") if x]:
        spec = {"method": "dflash", "model": args.draft, "num_speculative_tokens": args.k, "draft_length": "fixed"}
        if size:
            spec["draft_vocab_size"] = size
        for name, ps in sets.items():
            llm = LLM(model=args.target, speculative_config=spec, device=args.device, max_num_seqs=args.concurrency,
                      cpu_weights="none")
            t0 = time.perf_counter()
            o = llm.chat([[{"role": "user", "content": p}] for p in ps],
                         SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
            st = llm.stats()
            got = [x.outputs[0].token_ids for x in o]
            outs[(size, name)] = got
            print(json.dumps({"draft_vocab_size": size, "set": name, "prompts": len(ps),
                              "tau": round(st.mean_acceptance_length, 3), "drafts": st.spec_num_drafts,
                              "accepted": st.spec_num_accepted_tokens, "tokens": sum(map(len, got)),
                              "same_as_full_vocab": None if size is None else got == outs[(None, name)],
                              "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
            del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
