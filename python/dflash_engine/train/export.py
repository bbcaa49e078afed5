"""What a training run leaves behind: the draft in the published format (config.json +
model.safetensors with Hugging Face names: no `model.` prefix, q/k/v and gate/up split out of
the packed parameters), its model card, and checkpoints saved atomically; and the warm start
that reads such a draft back (--init-from)."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..models.config import write_draft_config
from .data import DataConfig
from .trainer import DraftTrainer, TrainConfig, TrainResult, loss_gamma

_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save through a temporary file: a run killed mid-save leaves the old checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def export_draft(out_dir: Path, trainer: DraftTrainer, dtype_name: str) -> None:
    """The trainer's draft as out_dir/config.json + model.safetensors, weights in `dtype_name`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(trainer.checkpoint_state_dict(_SAVE_DTYPES[dtype_name]), str(out_dir / "model.safetensors"))
    write_draft_config(out_dir, {**trainer.draft_cfg, "torch_dtype": dtype_name})


def init_weights_from(trainer: DraftTrainer, src: Path, draft_cfg: dict[str, Any]) -> None:
    """Copy the weights of the draft directory `src` into the trainer's draft (float32)."""
    from ..models.loader import load_draft, read_config

    src_cfg = read_config(src)
    for key in ("block_size", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "dflash_config"):
        if src_cfg.get(key) != draft_cfg.get(key):
            raise ValueError(f"--init-from {src}: its {key} {src_cfg.get(key)!r} differs from this run's "
                             f"{draft_cfg.get(key)!r}")
    weights = load_draft(src, trainer.target.config, torch.float32, "cpu", batch_invariant=False).state_dict()
    with torch.no_grad():
        for name, p in trainer.draft.state_dict().items():
            p.copy_(weights[name])


def model_card(out: Path, target: str, cfg: TrainConfig, dcfg: DataConfig, res: TrainResult, info: dict,
               argv: Sequence[str]) -> str:
    """README.md of a trained draft: how it was made and how to serve it."""
    return f"""# DFlash draft for `{target}`

Trained with `dflash-engine train-draft` (this engine; the recipe: python/dflash_engine/train/__init__.py).

- Command: `dflash-engine train-draft {' '.join(argv)}`
- Draft: {cfg.num_layers} layers, block size {cfg.block_size}, taps {res.target_layer_ids},
  mask token id {res.mask_token_id} (an unused special token; {res.mask_token_count} occurrences in the data)
- Data: {res.num_train} training + {res.num_held_out} held-out samples (self-written prompts + Python
  stdlib code prompts, {dcfg.code_fraction:.0%} code; responses by the target, greedy; max length {dcfg.max_len});
  cache {info.get('path')}
- Training: {res.steps} steps (resumed from {res.resumed_from}), batch {cfg.batch_size} sequences x
  {cfg.anchors_per_seq} anchors, AdamW lr {cfg.lr}, loss gamma {cfg.gamma or loss_gamma(cfg.block_size)}
- Loss: {res.first_loss:.3f} (first step of this run) -> {res.final_loss:.3f} (mean of the last steps)
- Held-out acceptance estimate τ (teacher-forced, greedy): {res.held_out_tau:.2f}
- Speed: {res.tokens_per_s:.0f} tokens/s over {res.seconds:.0f}s

Serve: `dflash-engine serve {target} --speculative-config '{{"method": "dflash", "model": "{out}"}}'`
"""

