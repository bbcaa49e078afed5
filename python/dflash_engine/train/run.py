"""One training run: load the frozen target, pick the taps and the mask token, build (or
resume, or warm-start) the trainer, train with a progress bar and the held-out τ estimate,
fit the steps to a time budget, checkpoint, and export the draft."""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..models.config import draft_config_dict
from ..models.loader import read_config
from ..models.qwen3_5_config import is_hybrid_config
from .batches import Batches
from .data import Sample, content_hash, mask_token_candidates, pick_mask_token
from .export import atomic_torch_save, export_draft, init_weights_from
from .trainer import DraftTrainer, TrainConfig, TrainResult


def train(target: str | Path, out_dir: str | Path, samples: Sequence[Sample], cfg: TrainConfig, *,
          held_out: Sequence[Sample] = (), mask_token: tuple[int, int] | None = None, mask_candidates=None,
          device: str = "auto", resume: bool = False, progress: bool = True, data_info: dict | None = None,
          save_checkpoints: bool = True, stop_at: int | None = None, init_from: str | Path | None = None,
          log=print) -> TrainResult:
    """Train a DFlash draft for the target directory `target` on `samples` and export it to
    `out_dir` (config.json + model.safetensors). Deterministic for the same inputs on CPU
    (single thread). With `resume`, continues from out_dir/checkpoint.pt when it exists;
    `stop_at` ends this run after that step (checkpointed and exported; resume continues it).
    `init_from`: a draft directory of the same configuration whose weights start this run (a
    warm start with a fresh optimiser and schedule; ignored when a checkpoint is resumed)."""
    # (the engine's runtime is imported when a run starts: the command's --help and the data
    # helpers do not need it)
    from ..models import load_target
    from ..runtime_config import resolve_device

    target, out_dir = Path(target), Path(out_dir)
    dev = resolve_device(device)
    target_cfg = read_config(target)
    tgt = load_target(target, "auto", dev, batch_invariant=False).requires_grad_(False)
    if mask_token is None:
        if mask_candidates is None:
            from ..tokenizer import Tokenizer

            mask_candidates = mask_token_candidates(Tokenizer.from_dir(target))
        mask_token = pick_mask_token(mask_candidates, [s.ids for s in samples], tgt.config.vocab_size)
    mask_id, mask_count = mask_token
    # (a hybrid target by its parsed config: its text model, whichever checkpoint layout it came in)
    shape_of = tgt.config if is_hybrid_config(target_cfg) else target_cfg
    draft_cfg = draft_config_dict(shape_of, num_layers=cfg.num_layers, block_size=cfg.block_size,
                                  mask_token_id=mask_id, target_layer_ids=cfg.target_layer_ids)
    layer_ids = list(draft_cfg["dflash_config"]["target_layer_ids"])  # the default taps when not given
    trainer = DraftTrainer(tgt, draft_cfg, cfg, dev)
    res = TrainResult(mask_token_id=mask_id, mask_token_count=mask_count, target_layer_ids=layer_ids,
                      num_train=len(samples), num_held_out=len(held_out))
    ckpt_path = out_dir / "checkpoint.pt"
    data_key = (data_info or {}).get("key")
    if resume and ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, map_location=dev, weights_only=False)
        # (every key the checkpoint recorded: one saved before the config gained keys still resumes)
        if any(draft_cfg.get(k) != v for k, v in ckpt["draft_config"].items()):
            raise ValueError(f"{ckpt_path} is a checkpoint of another draft configuration; "
                             "train into a new --out or without --resume")
        if ckpt.get("data_key") != data_key:
            raise ValueError(f"{ckpt_path} was trained on other data (key {ckpt.get('data_key')} != {data_key})")
        trainer.load_state(ckpt)
        res.held_out_history = [tuple(x) for x in ckpt.get("held_out_history", [])]
        res.resumed_from = trainer.step
        log(f"resuming from {ckpt_path} at step {trainer.step}")
    elif resume and init_from is None:
        log(f"--resume: no checkpoint in {out_dir}, starting from scratch")
    if init_from is not None and res.resumed_from == 0:
        init_weights_from(trainer, Path(init_from), draft_cfg)
        log(f"weights initialised from {init_from}")

    train_b = Batches(samples, cfg.block_size, dev)
    held_b = Batches(sorted(held_out, key=content_hash)[: cfg.eval_samples], cfg.block_size, dev)
    t_taps = time.perf_counter()
    if kept := trainer.precompute_taps(train_b):
        kept += trainer.precompute_taps(held_b)
        log(f"target taps of {kept} of {len(train_b) + len(held_b)} samples computed once "
            f"({time.perf_counter() - t_taps:.1f}s; the others' at each step)")

    def save_checkpoint() -> None:
        if not save_checkpoints:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_torch_save(trainer.state({"data_key": data_key, "held_out_history": res.held_out_history}),
                           ckpt_path)

    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="train-draft", disable=not progress,
               dynamic_ncols=True)
    t0, tokens = time.perf_counter(), 0
    start_step = trainer.step
    tau = res.held_out_history[-1][1] if res.held_out_history else float("nan")
    budget = cfg.time_budget_s

    def fit_to_budget() -> None:
        """Steps that fit the time left at the rate so far (evaluations included): the cosine
        schedule then ends when the budget does."""
        done, el = trainer.step - start_step, time.perf_counter() - t0
        fit = trainer.step + int(0.97 * (budget - el) / max(el / max(done, 1), 1e-9))
        trainer.total_steps = max(trainer.step + 1, min(cfg.steps, fit))
        bar.total = trainer.total_steps
        log(f"time budget {budget:.0f}s: {el / max(done, 1) * 1e3:.1f} ms/step, training to step {trainer.total_steps}")

    try:
        while trainer.step < (trainer.total_steps if stop_at is None else min(trainer.total_steps, stop_at)):
            loss, n_tok = trainer.train_step(train_b)
            tokens += n_tok
            res.losses.append(loss)
            if math.isnan(res.first_loss):
                res.first_loss = loss
            last = trainer.step >= trainer.total_steps
            if cfg.eval_every and trainer.step % cfg.eval_every == 0 and not last and len(held_b):
                tau = trainer.held_out_tau(held_b)
                res.held_out_history.append((trainer.step, tau))
                if not progress:
                    el = time.perf_counter() - t0
                    log(f"step {trainer.step}/{trainer.total_steps}: loss {loss:.3f}, held-out tau {tau:.2f}, "
                        f"{tokens / max(el, 1e-9):.0f} tok/s, {el:.0f}s")
            if cfg.save_every and trainer.step % cfg.save_every == 0 and not last:
                save_checkpoint()
            if budget is not None:
                done = trainer.step - start_step
                # calibrate after the first steps, refine at every evaluation in the first half
                if done == 30 or (cfg.eval_every and trainer.step % cfg.eval_every == 0
                                  and trainer.step - start_step < (trainer.total_steps - start_step) / 2):
                    fit_to_budget()
                elif time.perf_counter() - t0 > budget:
                    log(f"time budget {budget:.0f}s spent at step {trainer.step}")
                    trainer.total_steps = trainer.step
            el = time.perf_counter() - t0
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / max(el, 1e-9):.0f}", tau=f"{tau:.2f}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
    res.seconds = time.perf_counter() - t0
    res.tokens_per_s = tokens / max(res.seconds, 1e-9)
    res.steps = trainer.step
    if len(held_b):
        res.held_out_tau = trainer.held_out_tau(held_b)
        res.held_out_history.append((trainer.step, res.held_out_tau))
    if res.losses:
        tail = res.losses[-max(1, min(20, len(res.losses) // 5)):]
        res.final_loss = sum(tail) / len(tail)
    save_checkpoint()
    export_draft(out_dir, trainer, cfg.save_dtype)
    return res
