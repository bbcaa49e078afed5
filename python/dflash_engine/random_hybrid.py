"""Random-weight Qwen3.5 hybrid checkpoints (`dflash-engine make-random-checkpoint --shape
qwen3.5-27b | qwen3.5-4b | tiny-hybrid`): the layout Qwen3.5 is published in, with a matching
DFlash draft whose layers mix sliding-window and full attention.

Target: `Qwen3_5ForConditionalGeneration` (config.json with the text model under
`text_config`, model_type "qwen3_5_text"; weights under `model.language_model.`, `lm_head.weight`
at the top unless tied), safetensors shards with an index, generation_config.json and the
Qwen3.5 tokenizer (qwen3_5_tokenizer.py). The vision tower and the multi-token-prediction
layer of the published checkpoints are not written: the engine serves the text model and
ignores them (models/qwen3_5.py), and transformers initialises a missing tower itself.

Draft: DFlashDraftModel (models/config.py draft_config_dict) of 5 Qwen3-style layers, the
first 4 "sliding_attention" with window 2048 and the last "full_attention", block 16, taps
by the default formula, heads as the published Qwen3.5 drafts (32 x 128, 8 KV heads).

Where the numbers come from (public config.json files of the checkpoints and their copies):
- qwen3.5-27b: hidden 5120, 64 layers (every 4th full attention: 16 attention + 48 GDN),
  24 query / 4 KV heads of 256, FFN 17408, GDN 16 key / 48 value heads of 128, conv 4,
  vocab 248320, untied, rope_theta 1e7, partial_rotary_factor 0.25, mRoPE sections
  [11, 11, 10] interleaved, eos 248044 (the published Qwen3.5/3.6-27B text_config; the same
  dims in slime's scripts/models/qwen3.5-27B.sh).
- qwen3.5-4b: hidden 2560, 32 layers (8 attention + 24 GDN), 16 query / 4 KV heads of 256,
  FFN 9216, GDN 16 key / 32 value heads of 128, vocab 248320, tied embeddings, rope_theta 1e7
  (Qwen3.5-4B text_config and its derivatives).
- drafts: the public Qwen3.5-27B DFlash config (5 layers, 32 heads x 128, 8 KV heads, FFN =
  the target's, mask_token_id 248070, taps [1, 16, 31, 46, 61] = the default formula).
Text-model parameters from these shapes: 26.9 B (27B) and 4.21 B (4B); `parameter_count`.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .models.config import FULL_ATTENTION, SLIDING_ATTENTION, draft_config_dict
from .models.qwen3_5_config import HybridConfig
from .qwen3_5_tokenizer import SPECIAL_IDS, write_qwen3_5_tokenizer
from .random_checkpoint import (
    CHAT_TEMPLATE,
    DEFAULT_MAX_SHARD_BYTES,
    INIT_STD,
    _check_dtype,
    _numel,
    _write_json,
    draft_tensor_shapes,
    make_random_checkpoint,
    write_checkpoints,
    write_sharded_weights,
)

VOCAB_SIZE = 248320  # the embedding rows: 248,077 tokens padded
ENDOFTEXT_ID, IM_END_ID = SPECIAL_IDS["<|endoftext|>"], SPECIAL_IDS["<|im_end|>"]
DFLASH_MASK_TOKEN_ID = 248070  # the published Qwen3.5 drafts' mask token
LIN, FULL = "linear_attention", "full_attention"
TEXT_PREFIX = "model.language_model."

HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-27b": dict(
        hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, tie_word_embeddings=False, vocab_size=VOCAB_SIZE,
    ),
    "qwen3.5-4b": dict(
        hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        intermediate_size=9216, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, tie_word_embeddings=True, vocab_size=VOCAB_SIZE,
    ),
    # Test-sized, the real vocabulary (the real tokenizer), every layer kind.
    "tiny-hybrid": dict(
        hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, tie_word_embeddings=False, vocab_size=VOCAB_SIZE,
    ),
}
# The published drafts' attention shape; the tiny draft's own.
DRAFT_ATTENTION = {"qwen3.5-27b": dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128),
                   "qwen3.5-4b": dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128),
                   "tiny-hybrid": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)}
DRAFT_LAYER_TYPES = [SLIDING_ATTENTION] * 4 + [FULL_ATTENTION]
DRAFT_SLIDING_WINDOW = {"qwen3.5-27b": 2048, "qwen3.5-4b": 2048, "tiny-hybrid": 32}
DRAFT_BLOCK_SIZE = 16
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, num_position_embeddings=16)


# ----------------------------------------------------------------------------- configs

def target_config(shape: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of a Qwen3_5ForConditionalGeneration target, as Qwen3.5 is published."""
    if shape not in HYBRID_SHAPES:
        raise ValueError(f"unknown hybrid shape {shape!r}; choose one of {', '.join(HYBRID_SHAPES)}")
    _check_dtype(dtype)
    s = HYBRID_SHAPES[shape]
    n = s["num_hidden_layers"]
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": None,
        "dtype": dtype, "eos_token_id": ENDOFTEXT_ID, "full_attention_interval": 4, "head_dim": s["head_dim"],
        "hidden_act": "silu", "hidden_size": s["hidden_size"], "initializer_range": INIT_STD,
        "intermediate_size": s["intermediate_size"],
        "layer_types": [FULL if (i + 1) % 4 == 0 else LIN for i in range(n)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": s["linear_key_head_dim"],
        "linear_num_key_heads": s["linear_num_key_heads"], "linear_num_value_heads": s["linear_num_value_heads"],
        "linear_value_head_dim": s["linear_value_head_dim"], "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_text",
        "num_attention_heads": s["num_attention_heads"], "num_hidden_layers": n,
        "num_key_value_heads": s["num_key_value_heads"], "pad_token_id": None,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000.0, "rope_type": "default"},
        "tie_word_embeddings": s["tie_word_embeddings"], "use_cache": True, "vocab_size": s["vocab_size"],
    }
    vision = dict(TINY_VISION) if shape == "tiny-hybrid" else {}  # transformers' defaults for the others
    vision.update(model_type="qwen3_5", out_hidden_size=s["hidden_size"])
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "image_token_id": SPECIAL_IDS["<|image_pad|>"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": s["tie_word_embeddings"],
        "video_token_id": SPECIAL_IDS["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": SPECIAL_IDS["<|vision_end|>"],
        "vision_start_token_id": SPECIAL_IDS["<|vision_start|>"],
    }


def draft_config(target: dict[str, Any], shape: str, num_layers: int | None = None, dtype: str = "bfloat16",
                 block_size: int = DRAFT_BLOCK_SIZE) -> dict[str, Any]:
    """config.json of the matching DFlash draft: sliding-window layers and one full layer last."""
    n = num_layers or len(DRAFT_LAYER_TYPES)
    types = [SLIDING_ATTENTION] * (n - 1) + [FULL_ATTENTION]
    return draft_config_dict(HybridConfig.from_dict(target), num_layers=n, block_size=block_size,
                             mask_token_id=DFLASH_MASK_TOKEN_ID, torch_dtype=dtype, initializer_range=INIT_STD,
                             layer_types=types, sliding_window=DRAFT_SLIDING_WINDOW[shape],
                             attention=DRAFT_ATTENTION[shape])


def generation_config() -> dict[str, Any]:
    return {"bos_token_id": ENDOFTEXT_ID, "do_sample": True, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "pad_token_id": ENDOFTEXT_ID, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


# ----------------------------------------------------------------------------- tensor layout

def target_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names (transformers' Qwen3_5ForConditionalGeneration) and shapes of the text model."""
    t = cfg["text_config"]
    h, hd, inter = t["hidden_size"], t["head_dim"], t["intermediate_size"]
    nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim, hv = t["linear_num_value_heads"] * t["linear_value_head_dim"], t["linear_num_value_heads"]
    conv_dim = 2 * key_dim + value_dim
    shapes = {TEXT_PREFIX + "embed_tokens.weight": (t["vocab_size"], h)}
    for i, kind in enumerate(t["layer_types"]):
        p = f"{TEXT_PREFIX}layers.{i}."
        if kind == LIN:
            shapes.update({
                p + "linear_attn.A_log": (hv,),
                p + "linear_attn.conv1d.weight": (conv_dim, 1, t["linear_conv_kernel_dim"]),
                p + "linear_attn.dt_bias": (hv,),
                p + "linear_attn.in_proj_a.weight": (hv, h),
                p + "linear_attn.in_proj_b.weight": (hv, h),
                p + "linear_attn.in_proj_qkv.weight": (conv_dim, h),
                p + "linear_attn.in_proj_z.weight": (value_dim, h),
                p + "linear_attn.norm.weight": (t["linear_value_head_dim"],),
                p + "linear_attn.out_proj.weight": (h, value_dim),
            })
        else:
            shapes.update({
                p + "self_attn.q_proj.weight": (2 * nq * hd, h),  # per head: query | output gate
                p + "self_attn.k_proj.weight": (nkv * hd, h),
                p + "self_attn.v_proj.weight": (nkv * hd, h),
                p + "self_attn.o_proj.weight": (h, nq * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
            })
        shapes.update({
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    shapes[TEXT_PREFIX + "norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (t["vocab_size"], h)
    return shapes


def parameter_count(cfg: dict[str, Any]) -> int:
    """Parameters of the text model (a tied lm_head counted once)."""
    return sum(_numel(s) for s in target_tensor_shapes(cfg).values())


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  seed: int) -> torch.Tensor:
    """Qwen3.5's norms scale by (1 + weight): zeros are identity, the GDN output norm (plain
    weight) ones; A_log = log(A) with A uniform in [1, 16) and dt_bias ones (transformers'
    init); every other weight N(0, 0.02). Values depend on (seed, name) only."""
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        return torch.ones(shape, dtype=dtype, device=device)
    if "norm" in name:
        return torch.zeros(shape, dtype=dtype, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if name.endswith("A_log"):
        return torch.empty(shape, dtype=torch.float32, device=device).uniform_(1.0, 16.0, generator=gen).log().to(dtype)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, INIT_STD, generator=gen)


def draft_random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                        seed: int) -> torch.Tensor:
    """The draft's Qwen3-style norms are plain (ones); other weights N(0, 0.02)."""
    if "norm" in name:
        return torch.ones(shape, dtype=dtype, device=device)
    return random_tensor(name, shape, dtype, device, seed)


def make_hybrid_checkpoint(
    shape: str, out_dir: str | Path, draft_dir: str | Path | None = None, device: str = "auto", seed: int = 0,
    dtype: str = "bfloat16", max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, config_only: bool = False,
    overwrite: bool = False, draft_layers: int | None = None, log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write the Qwen3.5 target (and the sliding-window draft); the summary of
    random_checkpoint.make_random_checkpoint."""
    tcfg = target_config(shape, dtype)
    dcfg = draft_config(tcfg, shape, draft_layers, dtype) if draft_dir is not None else None

    def target_files(path: Path) -> None:
        _write_json(path / "config.json", tcfg)
        _write_json(path / "generation_config.json", generation_config())
        write_qwen3_5_tokenizer(path, CHAT_TEMPLATE)

    def weights(path: Path, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]], dev: torch.device) -> list[str]:
        make = random_tensor if cfg is tcfg else draft_random_tensor
        return write_sharded_weights(path, shapes, dtype, dev, seed, max_shard_bytes, log, tensor=make)

    return write_checkpoints(shape, dtype, device, out_dir, tcfg, target_tensor_shapes(tcfg), draft_dir, dcfg,
                             draft_tensor_shapes(dcfg) if dcfg else None, target_files, weights,
                             config_only=config_only, overwrite=overwrite, log=log)


def make_checkpoint(shape: str, out_dir: str | Path, *args, **kwargs) -> dict[str, Any]:
    """Any shape of the command: the Qwen3.5 ones here, the Qwen3 ones random_checkpoint's."""
    make = make_hybrid_checkpoint if shape in HYBRID_SHAPES else make_random_checkpoint
    return make(shape, out_dir, *args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """`dflash-engine make-random-checkpoint ...` with every shape, Qwen3 and Qwen3.5."""
    from .random_checkpoint import main as qwen3_main

    return qwen3_main(argv, make=make_checkpoint, extra_shapes=list(HYBRID_SHAPES))
