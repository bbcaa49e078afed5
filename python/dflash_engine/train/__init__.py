"""Training a DFlash draft for a target that has none (`dflash-engine train-draft`).

A tool outside the engine: it answers prompts through the public `LLM` API and reads the
target with the models loader. Nothing is downloaded.

Data (`data`, `self_prompts`, `code_prompts`): prompts the target writes itself under its chat
template (free user turns, and code requests from a few openings), and code prompts built
from Python's own sources (signatures and docstrings, read with `ast`); answered by the
target, greedy, and cached; a content-hashed slice is held out for the acceptance estimate.

Training (`dense`, `taps`, `batches`, `trainer`, `run`):
- random anchors `a` on response tokens (a <= len - B); the block input is
  `[x_a, MASK x (B-1)]` embedded with the frozen target embedding at positions a..a+B-1;
- the block attends to the draft context strictly before the anchor and bidirectionally
  within its own block;
- row k (k >= 1) predicts x_{a+k} through the frozen target lm_head (same-position labels),
  loss weight exp(-(k-1)/gamma): gamma 7 for B=16, 5 for B=10, 4 for B=8 and B/2 for any
  other B (the published 4 at 8 and 5 at 10);
- taps from models/config.py `default_target_layer_ids`, computed online by a causal forward
  of the frozen target over whole sequences (or once, when they fit in memory): a dense one for
  dense targets, the engine's own forward for hybrid (Qwen3.5) targets (`taps`); AdamW,
  warm-up then cosine decay; bf16 autocast on the GPU;
- a progress bar with the loss, tokens/s and a held-out acceptance estimate (τ, teacher-forced
  on the target's own greedy responses: the τ greedy speculative decoding would see there);
- checkpoints (OUT/checkpoint.pt) every --save-every steps; `--resume` continues one.

Output (`export`): OUT/config.json (models/config.py `draft_config_dict`, the published
DFlashDraftModel format), OUT/model.safetensors (Hugging Face names), train_report.json and
a README.md model card.
"""
from .data import DATA_VERSION, DataConfig, Sample, build_dataset, pick_mask_token, read_samples, split_held_out
from .export import export_draft
from .run import train
from .trainer import DraftTrainer, TrainConfig, TrainResult, loss_gamma

__all__ = [
    "DATA_VERSION", "DataConfig", "DraftTrainer", "Sample", "TrainConfig", "TrainResult", "build_dataset",
    "export_draft", "loss_gamma", "pick_mask_token", "read_samples", "split_held_out", "train",
]
