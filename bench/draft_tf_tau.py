"""Where a draft's acceptance goes: the engine's real τ beside the draft's teacher-forced τ on
the same greedy answers (CPU, float32, the embedded SmolLM2 target by default).

For each prompt: the engine decodes greedily with the draft (spec on) and reports its τ; then
the draft is run densely (the trainer's forward) at every anchor of the answer, and prints
- the teacher-forced τ over all anchors (1 + leading block rows equal to the answer),
- the τ that greedy speculative decoding would see, simulated from those per-anchor counts
  (anchor a accepts n, the next anchor is a + n + 1),
- the per-anchor accepted counts, so loops, copies and hard spans show up.
If the simulated τ matches the engine's, the engine drafts what the draft learnt.

    python bench/draft_tf_tau.py --draft DIR [--target DIR] [--set humaneval|chat] [--limit 3]
        [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    from eval_draft import CHAT_PROMPTS, humaneval_prompts

    from dflash_engine import LLM, SamplingParams
    from dflash_engine.model_path import resolve_model_path
    from dflash_engine.models import load_target
    from dflash_engine.models.loader import load_draft, read_config
    from dflash_engine.train.dense import dense_block_forward
    from dflash_engine.train.taps import target_taps

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--target", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--set", choices=["humaneval", "chat"], default="humaneval")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    prompts = (humaneval_prompts() if args.set == "humaneval" else list(CHAT_PROMPTS))[: args.limit]
    llm = LLM(model=args.target, device="cpu", dtype="float32", max_num_seqs=1,
              speculative_config={"method": "dflash", "model": args.draft})
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    st = llm.stats()
    seqs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    del llm

    target_dir = resolve_model_path(args.target)
    tgt = load_target(target_dir, torch.float32, "cpu", batch_invariant=False)
    draft = load_draft(args.draft, tgt.config, torch.float32, "cpu", batch_invariant=False)
    cfg = read_config(args.draft)
    taps_at, mask, b = cfg["dflash_config"]["target_layer_ids"], cfg["dflash_config"]["mask_token_id"], cfg["block_size"]
    emb = tgt.model.embed_tokens.weight
    lm_w = emb if tgt.lm_head is None else tgt.lm_head.weight
    all_acc, sim_acc, sim_steps = [], 0, 0
    for i, (p, o) in enumerate(seqs):
        ids = torch.tensor([p + o])
        if len(o) < b:
            continue
        taps = target_taps(tgt, ids, taps_at)
        anchors = torch.arange(len(p), ids.shape[1] - b + 1)
        blk = ids[0][anchors[:, None] + torch.arange(b)].clone()
        labels = blk[:, 1:].clone()
        blk[:, 1:] = mask
        with torch.no_grad():
            h = dense_block_forward(draft, taps, F.embedding(blk, emb)[None], anchors)
            pred = F.linear(h[0, :, 1:], lm_w).argmax(-1)
        acc = (pred == labels).long().cumprod(-1).sum(-1)
        a, n_acc, steps = 0, 0, 0
        while a < len(acc):
            k = int(acc[a])
            n_acc, steps, a = n_acc + k, steps + 1, a + k + 1
        sim_acc, sim_steps = sim_acc + n_acc, sim_steps + steps
        all_acc.append(acc)
        print(json.dumps({"prompt": i, "prompt_tokens": len(p), "answer_tokens": len(o),
                          "teacher_forced_tau": round(1 + float(acc.float().mean()), 3),
                          "simulated_tau": round(1 + n_acc / steps, 3), "accepted_per_anchor": acc.tolist()}))
    engine_tau = 1 + st.spec_num_accepted_tokens / max(st.spec_num_drafts, 1)
    tf = 1 + float(torch.cat(all_acc).float().mean()) if all_acc else float("nan")
    print(f"engine tau {engine_tau:.3f}  simulated tau {1 + sim_acc / max(sim_steps, 1):.3f}  "
          f"teacher-forced tau (every anchor) {tf:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
