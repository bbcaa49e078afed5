"""`dflash-engine draft-vocab TARGET --out DRAFT_DIR`: the draft vocabulary's token ranking
(models/draft_vocab.py), written to DRAFT_DIR/draft_vocab.json; `speculative_config`
`draft_vocab_size: N` then proposes among the N most frequent. Sources (`auto`, the default:
`answers` where a GPU generates them, else `stdlib-text`):
- `answers`: the target's own greedy answers to train-draft's prompts (self-written
  and stdlib code ones; cached, and shared with train-draft when the recipe matches): what a
  draft has to propose. Generation wants a GPU (on a 2-core CPU it takes hours);
- `stdlib-text`: the standard library's Python sources (code, docstrings, comments) through the
  target's tokenizer: no generation, a proxy for code and English answers.
Never count evaluation sets (HumanEval) here: the ranking would fit them."""
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
    ap.add_argument("--source", choices=["auto", "answers", "stdlib-text"], default="auto",
                    help="auto (default): answers with a GPU, stdlib-text without one")
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
    source = args.source
    if source == "auto":
        import torch

        gpu = args.device != "cpu" and torch.cuda.is_available()
        source = "answers" if gpu else "stdlib-text"
        print(f"--source auto: {source} (" + ("the target's answers, generated on the GPU" if gpu else
              "no GPU: generating answers on a CPU takes hours; --source answers forces it") + ")")
    if source == "stdlib-text":
        counts, source = stdlib_text_counts(target, vocab)
        return report(draft_vocab.write(out, counts, source), counts, vocab)
    data_dir = Path(args.data_dir) if args.data_dir else (out if out.is_dir() else out.parent) / ".draft_vocab_data"
    cfg = DataConfig(samples=args.samples, response_tokens=args.response_tokens, held_out=0.0, seed=args.seed)
    samples, info = build_dataset(target, data_dir, cfg, block_size=args.block_size, device=args.device)
    counts = draft_vocab.count_tokens((s.response_ids for s in samples), vocab)
    path = draft_vocab.write(out, counts, f"greedy answers of {target.name} to {len(samples)} train-draft prompts "
                                          f"(seed {args.seed}, at most {args.response_tokens} tokens each)")
    return report(path, counts, vocab)


def stdlib_text_counts(target: Path, vocab: int) -> tuple[np.ndarray, str]:
    """Token counts of the standard library's .py files (train-draft's code sources: no test
    suites or tooling) through the target's tokenizer."""
    from ..tokenizer import Tokenizer
    from .code_prompts import _source_files, code_roots

    tok = Tokenizer.from_dir(target)
    files = [f for root in code_roots("stdlib") for f, _ in _source_files(root, packages=False)]
    texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
    counts = draft_vocab.count_tokens((tok.encode(t, add_special_tokens=False) for t in texts), vocab)
    return counts, f"{len(files)} standard-library sources through {target.name}'s tokenizer"


def report(path: Path, counts: np.ndarray, vocab: int) -> int:
    seen = int((counts > 0).sum())
    top = np.sort(counts)[::-1]
    cover = {n: float(top[:n].sum() / max(1, counts.sum())) for n in (1024, 4096, 8192, 16384, 32768) if n < vocab}
    print(f"{path}: {int(counts.sum())} tokens counted, {seen} of {vocab} ids seen; share of the counted tokens "
          "inside the N most frequent: " + ", ".join(f"{n}: {c:.3f}" for n, c in cover.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
