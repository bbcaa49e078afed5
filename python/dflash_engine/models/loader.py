"""Load targets and DFlash drafts from Hugging Face directories (config.json + safetensors).

Strict: every parameter (every shard of a packed one, see packed.py) must come from exactly
one checkpoint tensor with the right shape, and every checkpoint tensor must be used (rotary
inv_freq buffers and a tied lm_head excepted).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from .. import envs
from .config import DraftConfig, ModelConfig, resolve_dtype, validate_draft_against_target
from .dflash import DFlashDraftModel
from .layers import set_batch_invariant
from .llama import LlamaForCausalLM
from .packed import checkpoint_shards
from .parallel import TPShard, checkpoint_slice, rank_config, read_slice, shard_model
from .qwen3 import Qwen3ForCausalLM
from .qwen3_5_config import HybridConfig, is_hybrid_config

TARGET_CLASSES = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}


def read_config(path: str | Path) -> dict:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"no config.json in {path}")
    return json.loads(config_path.read_text())


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"safetensors shards listed in {index} are missing: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


def _ignorable(name: str, model: nn.Module) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    ignores = getattr(model, "ignores_checkpoint_tensor", None)  # e.g. a vision tower (qwen3_5.py)
    if ignores is not None and ignores(name):
        return True
    # Tied checkpoints sometimes still store lm_head; the embedding is the source of truth.
    return name == "lm_head.weight" and getattr(model, "lm_head", 0) is None


def load_weights(model: nn.Module, files: list[Path], tp: TPShard | None = None,
                 full_config: ModelConfig | None = None) -> None:
    """Fill `model`'s parameters from Hugging Face safetensors files. Packed parameters
    (packed.py) are filled shard by shard; errors name the checkpoint tensor. Under tensor
    parallelism (`tp`; `model` built from `rank_config(full_config, tp.size)`) only the rank's
    slice of each split tensor is read (parallel.py, checkpoint_slice)."""
    params = dict(model.named_parameters())
    own = getattr(model, "checkpoint_shards", None)  # a model with its own checkpoint layout (qwen3_5.py)
    shards = own() if own is not None else checkpoint_shards(params.items(), model.config)
    loaded: set[str] = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in shards:
                        if _ignorable(name, model):
                            continue
                        raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                    if name in loaded:
                        raise ValueError(f"tensor {name!r} appears twice in the checkpoint "
                                         f"(again in {file.name})")
                    param_name, start, rows = shards[name]
                    dest = params[param_name].narrow(0, start, rows)
                    where = None if tp is None else checkpoint_slice(name, full_config, tp)
                    expected = tuple(dest.shape)
                    if where is None:
                        shape = tuple(f.get_slice(name).get_shape())
                        tensor = f.get_tensor(name) if shape == expected else None
                    else:  # only the rank's rows / columns are read; `expected`: the whole tensor's
                        tensor, shape = read_slice(f, name, where)
                        expected = expected[:where[0]] + (where[-1],) + expected[where[0] + 1:]
                    if tensor is None or tensor.shape != dest.shape:
                        rows_of = "" if param_name == name else f" (rows [{start}, {start + rows}) of {param_name})"
                        raise ValueError(
                            f"shape mismatch for tensor {name!r} in {file.name}: "
                            f"expected {expected}, got {shape}{rows_of}"
                        )
                    dest.copy_(tensor)
                    loaded.add(name)
    missing = sorted(set(shards) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing)}")


def _build(cls, cfg, path, dtype: torch.dtype, device, batch_invariant: bool | None,
           tp: TPShard | None = None) -> nn.Module:
    # Build without initialisation (meta device), then materialise and fill from the checkpoint.
    # Under tensor parallelism: this rank's part (its config view, its slices: parallel.py).
    with torch.device("meta"):
        model = cls(cfg if tp is None else rank_config(cfg, tp.size))
        if tp is not None:
            shard_model(model, tp)
    model = model.to(dtype).to_empty(device=device)
    load_weights(model, safetensors_files(path), tp, cfg)
    set_batch_invariant(model, envs.batch_invariant() if batch_invariant is None else batch_invariant)
    return model.eval().requires_grad_(False)


def target_config(d: dict) -> ModelConfig:
    """A target's parsed config.json: a HybridConfig for hybrid (Qwen3.5) targets (which
    models.targets.load_target loads; this module's load_target loads dense ones)."""
    return HybridConfig.from_dict(d) if is_hybrid_config(d) else ModelConfig.from_dict(d)


def load_target(path: str | Path, dtype: str | torch.dtype = "auto", device="cpu",
                batch_invariant: bool | None = None, tp: TPShard | None = None) -> nn.Module:
    """batch_invariant: CPU GEMMs in the exact mode (a row's bits never depend on its batch);
    None: `envs.batch_invariant()` (default off: plain GEMMs). The engine passes its resolved flag.
    tp: this rank's shard under tensor parallelism (models/parallel.py); None: the whole model."""
    cfg = ModelConfig.from_dict(read_config(path))
    return _build(TARGET_CLASSES[cfg.architecture], cfg, path, resolve_dtype(dtype, cfg.torch_dtype, device), device,
                  batch_invariant, tp)


def load_draft(
    path: str | Path, target_config: ModelConfig, dtype: str | torch.dtype = "auto", device="cpu",
    batch_invariant: bool | None = None, tp: TPShard | None = None,
) -> DFlashDraftModel:
    """dtype "auto": the target's dtype ("auto" of its checkpoint dtype; the draft reads the target's embeddings and
    hidden states, so it computes in the target's dtype; a bf16 draft serves a float32 target)."""
    cfg = DraftConfig.from_dict(read_config(path))
    validate_draft_against_target(cfg, target_config)
    return _build(DFlashDraftModel, cfg, path, resolve_dtype(dtype, target_config.torch_dtype, device), device,
                  batch_invariant, tp)
