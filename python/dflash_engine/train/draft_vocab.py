"""`dflash-engine draft-vocab TARGET --out DRAFT_DIR`: the draft vocabulary's token ranking
(models/draft_vocab.py) from the target's own greedy answers to train-draft's prompts
(self-written and stdlib code ones; the data is cached and shared with train-draft when the
recipe matches). Counts the answer tokens, what a draft has to propose, and writes
DRAFT_DIR/draft_vocab.json; `speculative_config` `draft_vocab_size: N` then proposes among the
N most frequent. Never count evaluation sets (HumanEval) here: the ranking would fit them."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ..models import draft_vocab
from .data import DataConfig, build_dataset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash-engine draft-vocab", description=__doc__)
    ap.add_argument("target", nargs="?", default=None,
                    help="the target's Hugging Face directory or .gguf (default: the embedded model)")
    ap.add_argument("--out", required=True, help="the draft's directory (or a .json path)")
    ap.add_argument("--samples", type=int, default=512, help="prompts the target answers (default 512)")
    ap.add_argument("--response-tokens", type=int, default=256)
    ap.add_argument("--data-dir", default=None, help="cache of the target's answers (default: OUT/.draft_vocab_data)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16,
                    help="answers no longer than this are not counted (train-draft drops them too; its cache is "
                         "shared when the recipe matches)")
    args = ap.parse_args(argv)
    if args.samples < 1 or args.response_tokens < 1:
        ap.error("--samples and --response-tokens must be positive")
    from ..model_path import resolve_model_path
    from ..models.loader import read_config, target_config

    target = Path(resolve_model_path(args.target))
    vocab = target_config(read_config(target)).vocab_size
    out = Path(args.out)
    data_dir = Path(args.data_dir) if args.data_dir else (out if out.is_dir() else out.parent) / ".draft_vocab_data"
    cfg = DataConfig(samples=args.samples, response_tokens=args.response_tokens, held_out=0.0, seed=args.seed)
    samples, info = build_dataset(target, data_dir, cfg, block_size=args.block_size, device=args.device)
    counts = draft_vocab.count_tokens((s.response_ids for s in samples), vocab)
    path = draft_vocab.write(out, counts, f"greedy answers of {target.name} to {len(samples)} train-draft prompts "
                                          f"(seed {args.seed}, at most {args.response_tokens} tokens each)")
    seen = int((counts > 0).sum())
    top = np.sort(counts)[::-1]
    cover = {n: float(top[:n].sum() / max(1, counts.sum())) for n in (1024, 4096, 8192, 16384, 32768) if n < vocab}
    print(f"{path}: {int(counts.sum())} answer tokens, {seen} of {vocab} ids seen; share of the counted tokens "
          "inside the N most frequent: " + ", ".join(f"{n}: {c:.3f}" for n, c in cover.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
