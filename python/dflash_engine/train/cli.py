"""`dflash-engine train-draft`: train a DFlash draft for a target that has none.

The command line of `dflash_engine.train`: data (generated once, cached under OUT/data and
reused by later runs; --gen-workers N answers it in N processes), training, then OUT/config.json,
OUT/model.safetensors, train_report.json and a README.md model card. Load the draft with
`speculative_config={"method": "dflash", "model": OUT}`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from .code_prompts import CODE_SOURCES
from .data import DataConfig, build_dataset, read_samples, split_held_out
from .export import model_card
from .run import train
from .trainer import TrainConfig


def run_data_workers(argv: list[str], workers: int) -> None:
    """--gen-workers N: run this command once per data shard (--data-only --data-shard i/N) in
    N processes at once and wait for them; each caches its shard, which this process then
    reads. A worker that fails fails the command (its log is in the output)."""
    import subprocess

    base = list(argv)
    while "--gen-workers" in base:  # drop "--gen-workers N" / "--gen-workers=N"
        i = base.index("--gen-workers")
        del base[i: i + 2]
    base = [a for a in base if not a.startswith("--gen-workers=")]
    procs = [subprocess.Popen([sys.executable, "-m", "dflash_engine.train", *base, "--data-only",
                               "--data-shard", f"{i}/{workers}"]) for i in range(workers)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"data workers exited with {codes}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflash-engine train-draft", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None,
                    help="target: HF directory or .gguf (default or 'default': the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, help="draft directory to write (checkpoints and data go here too)")
    ap.add_argument("--layers", type=int, default=5, help="draft layers (default 5)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2048, help="prompts answered by the target")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="end this run after this step (checkpoint + export); --resume continues to --steps")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="random anchors per sequence per step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--max-len", type=int, default=512, help="prompt + response tokens")
    ap.add_argument("--response-tokens", type=int, default=384)
    ap.add_argument("--code-fraction", type=float, default=0.4,
                    help="share of code prompts built from Python sources (see --code-source)")
    ap.add_argument("--self-code-fraction", type=float, default=0.3,
                    help="share of code requests the target writes itself from a few openings "
                         "(the rest of --samples: user turns it writes freely)")
    ap.add_argument("--code-source", choices=CODE_SOURCES, default="stdlib",
                    help="code prompts from the standard library, or from it and the installed packages (all)")
    ap.add_argument("--data-shard", default=None, metavar="I/N",
                    help="answer only shard I of N of the prompts (a data cache of its own)")
    ap.add_argument("--gen-workers", type=int, default=1,
                    help="generate the data in this many processes at once (one shard each, on the same "
                         "GPU: the engine's step is host-bound for a small target), then train on all")
    ap.add_argument("--data-dir", default=None, help="data cache (default: OUT/data)")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--save-dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gen-batch", type=int, default=64, help="concurrent requests while generating data")
    ap.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                    help="wall-clock seconds for this whole command (data, training, export): the run's "
                         "steps (and its learning-rate schedule) are fitted to what is left after the data")
    ap.add_argument("--data-time-budget", type=float, default=None, metavar="SECONDS",
                    help="stop answering new prompts after this many seconds of data generation "
                         "(the dataset then has fewer than --samples samples)")
    ap.add_argument("--extra-data", nargs="+", default=[], metavar="FILE",
                    help="also train on these data files of earlier runs for the same target "
                         "(samples-*.jsonl, or .jsonl.gz)")
    ap.add_argument("--init-from", default=None, metavar="DRAFT_DIR",
                    help="start from this draft's weights (same configuration; fresh optimiser and schedule)")
    ap.add_argument("--data-only", action="store_true",
                    help="generate (or find) the cached data and stop; a later run trains on it")
    ap.add_argument("--taps-cache-gib", type=float, default=8.0,
                    help="keep the target's taps of every sample on the training device when they fit")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..model_path import resolve_model_path

    t_start = time.perf_counter()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.block_size < 2 or args.layers < 1 or args.steps < 0 or args.samples < 2:
        print("error: need --block-size >= 2, --layers >= 1, --steps >= 0, --samples >= 2", file=sys.stderr)
        return 2
    target = resolve_model_path(None if args.target in (None, "default") else args.target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shard, num_shards = 0, 1
    if args.data_shard is not None:
        try:
            shard, num_shards = (int(x) for x in args.data_shard.split("/"))
        except ValueError:
            shard, num_shards = -1, 0
        if not 0 <= shard < num_shards:
            print(f"error: --data-shard must be I/N with 0 <= I < N, got {args.data_shard!r}", file=sys.stderr)
            return 2
    if args.gen_workers < 1 or (args.gen_workers > 1 and args.data_shard is not None):
        print("error: --gen-workers must be >= 1, and is not combined with --data-shard", file=sys.stderr)
        return 2
    fractions = (args.code_fraction, args.self_code_fraction)
    if min(fractions) < 0 or sum(fractions) > 1:
        print("error: --code-fraction and --self-code-fraction must be >= 0 with a sum <= 1", file=sys.stderr)
        return 2
    dcfg = DataConfig(samples=args.samples, code_fraction=args.code_fraction, max_len=args.max_len,
                      response_tokens=args.response_tokens, seed=args.seed, gen_batch=args.gen_batch,
                      self_code_fraction=args.self_code_fraction, code_source=args.code_source,
                      shard=shard, num_shards=num_shards if args.gen_workers == 1 else args.gen_workers)
    data_dir = Path(args.data_dir or out / "data")
    if args.gen_workers > 1:
        run_data_workers(argv, args.gen_workers)
    deadline = None if args.data_time_budget is None else time.monotonic() + args.data_time_budget
    samples, info = build_dataset(target, data_dir, dcfg, block_size=args.block_size,
                                  device=args.device, deadline=deadline)
    for i in range(1, dcfg.num_shards if args.gen_workers > 1 else 1):  # the workers' shards (cached now)
        more, more_info = build_dataset(target, data_dir, replace(dcfg, shard=i), block_size=args.block_size,
                                        device=args.device)
        samples = samples + more
        info["key"] = hashlib.sha256(f"{info['key']}:{more_info['key']}".encode()).hexdigest()[:16]
        info["seconds"] = max(info["seconds"], more_info["seconds"])
    if args.data_only:
        print(f"data ready: {len(samples)} samples in {info['path']}" +
              (f" and {dcfg.num_shards - 1} more shard files" if args.gen_workers > 1 else ""))
        return 0
    if args.extra_data:
        extra = [x for f in args.extra_data for x in read_samples(f, args.block_size)]
        info["extra"] = {"files": list(args.extra_data), "samples": len(extra)}
        # a checkpoint resumes only on the same data: the key covers the extra samples too
        info["key"] = hashlib.sha256(json.dumps([info["key"], [asdict(x) for x in extra]]).encode()).hexdigest()[:16]
        samples = samples + extra
        print(f"data: {len(extra)} samples from {len(args.extra_data)} extra file(s); {len(samples)} in all")
    train_s, held = split_held_out(samples, dcfg.held_out)
    cfg = TrainConfig(num_layers=args.layers, block_size=args.block_size, steps=args.steps,
                      batch_size=args.batch_size, anchors_per_seq=args.anchors, lr=args.lr, seed=args.seed,
                      eval_every=args.eval_every, save_every=args.save_every, save_dtype=args.save_dtype,
                      taps_cache_gib=args.taps_cache_gib)
    if args.time_budget is not None:
        # what is left after the data, less a margin for loading, the taps and the export
        cfg.time_budget_s = max(1.0, args.time_budget - (time.perf_counter() - t_start) - 30.0)
    res = train(target, out, train_s, cfg, held_out=held, device=args.device, resume=args.resume,
                progress=not args.no_progress, data_info=info, stop_at=args.stop_at, init_from=args.init_from)
    report = {"target": str(target), "data": {**asdict(dcfg), **info}, "train": asdict(cfg),
              "result": {k: v for k, v in asdict(res).items() if k != "losses"}, "argv": list(argv)}
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    (out / "README.md").write_text(model_card(out, str(args.target or "default"), cfg, dcfg, res, info, argv))
    print(f"draft written to {out}: {res.steps} steps, loss {res.first_loss:.3f} -> {res.final_loss:.3f}, "
          f"held-out tau {res.held_out_tau:.2f}")
    return 0

