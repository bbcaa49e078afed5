"""Model configs parsed from Hugging Face config.json dicts, and draft/target validation."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..ops.attention import dead_positions
from ..ops.rotary import SUPPORTED_ROPE_TYPES, rope_type_of

SUPPORTED_TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
DRAFT_ARCHITECTURE = "DFlashDraftModel"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None = None, device=None) -> torch.dtype:
    """"auto" picks the checkpoint's float16/bfloat16/float32 dtype, else float32; on a GPU a
    float32 checkpoint runs in bfloat16 (as vLLM's "auto" does), on the CPU in float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        picked = _DTYPES.get(str(config_dtype).removeprefix("torch."), torch.float32)
        if picked == torch.float32 and device is not None and torch.device(device).type == "cuda":
            return torch.bfloat16
        return picked
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' field")
    return archs[0]


def _rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either the transformers v4 fields
    (rope_theta + rope_scaling) or the v5 field rope_parameters."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rope_type_of(params)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        # transformers gives a top-level original_max_position_embeddings priority.
        original = d.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
    return theta, params


def _check_full_attention(d: dict[str, Any], what: str) -> None:
    layer_types = d.get("layer_types")
    if layer_types is None:
        return
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise ValueError(
            f"{what} has layer_types {other} (e.g. sliding-window attention); "
            "only 'full_attention' layers are supported"
        )


FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
DRAFT_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def _draft_layer_types(d: dict[str, Any], num_layers: int) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) of a draft config: every layer "full_attention" or
    "sliding_attention", one per layer; a sliding layer needs `sliding_window` >= 1. As in
    transformers' Qwen3Config, `use_sliding_window: false` turns the window off (sliding_window
    None: the sliding layers attend to everything); an absent flag keeps it on."""
    layer_types = list(d.get("layer_types") or [FULL_ATTENTION] * num_layers)
    unknown = sorted(set(layer_types) - set(DRAFT_LAYER_TYPES))
    if unknown or len(layer_types) != num_layers:
        raise ValueError(
            f"DFlash draft layer_types must name {num_layers} layers (num_hidden_layers), each "
            f"{' or '.join(map(repr, DRAFT_LAYER_TYPES))}; got {len(layer_types)}"
            + (f" with unknown types {unknown}" if unknown else "")
        )
    window = d.get("sliding_window")
    if SLIDING_ATTENTION not in layer_types:
        return layer_types, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"DFlash draft has sliding_attention layers but sliding_window is {window!r}; "
            "it must be an integer >= 1"
        )
    if d.get("use_sliding_window") is False:
        window = None
    return layer_types, window


def _first_id(value: Any) -> int | None:
    return value[0] if isinstance(value, list) and value else value


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: int | list[int] | None = None
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "Qwen3ForCausalLM"

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else list(eos) if isinstance(eos, list) else [eos]

    @classmethod
    def _common(cls, d: dict[str, Any], architecture: str) -> dict[str, Any]:
        heads = d["num_attention_heads"]
        theta, scaling = _rope(d)
        return dict(
            architecture=architecture,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            eos_token_id=d.get("eos_token_id"),
            bos_token_id=_first_id(d.get("bos_token_id")),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            raw=d,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(d)
        if architecture not in SUPPORTED_TARGET_ARCHITECTURES:
            raise ValueError(
                f"unsupported target architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_TARGET_ARCHITECTURES)}"
            )
        _check_full_attention(d, f"target model ({architecture})")
        kw = cls._common(d, architecture)
        is_llama = architecture == "LlamaForCausalLM"
        return cls(
            **kw,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)) if is_llama else False,
            mlp_bias=bool(d.get("mlp_bias", False)) if is_llama else False,
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published drafts' taps: round(1 + i*(L-4)/(n-1)) for n draft layers over L target
    layers; a one-layer draft taps the middle layer L // 2. The one tap formula of the repo."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DraftConfig(ModelConfig):
    block_size: int = 16
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention / sliding_attention
    sliding_window: int | None = None  # keys a sliding layer's query at p sees: [p - window + 1, p + window - 1]

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer: its attention window (None: full attention)."""
        types = self.layer_types or [FULL_ATTENTION] * self.num_hidden_layers
        return [self.sliding_window if t == SLIDING_ATTENTION else None for t in types]

    def dead_context_positions(self, committed: int) -> int:
        """How many leading draft-context positions of a request with `committed` tokens no
        draft layer reads again: the next draft block's first query sits at `committed`, and
        `committed` never decreases, so a position below every layer's window start
        (ops.attention.window_start) is dead for good. 0 while any layer is full attention;
        per layer group (e.g. only the sliding layers), `dead_positions(committed, windows)`."""
        return dead_positions(committed, self.layer_windows)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DraftConfig:
        architecture = _architecture(d)
        if architecture != DRAFT_ARCHITECTURE:
            raise ValueError(
                f"unsupported draft architecture {architecture!r}; supported: {DRAFT_ARCHITECTURE}"
            )
        dflash = d.get("dflash_config") or {}
        block_size = dflash.get("block_size", d.get("block_size"))
        mask_token_id = dflash.get("mask_token_id", d.get("mask_token_id"))
        num_target_layers = d.get("num_target_layers")
        for name, value in (("block_size", block_size), ("mask_token_id", mask_token_id),
                            ("num_target_layers", num_target_layers)):
            if value is None:
                raise ValueError(f"DFlash draft config.json is missing {name}")
        if block_size < 2:
            raise ValueError(f"DFlash block_size must be >= 2, got {block_size}")
        kw = cls._common(d, architecture)
        layer_ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if layer_ids is None:
            layer_ids = default_target_layer_ids(num_target_layers, kw["num_hidden_layers"])
        layer_types, window = _draft_layer_types(d, kw["num_hidden_layers"])
        return cls(
            **kw,
            layer_types=layer_types,
            sliding_window=window,
            tie_word_embeddings=False,
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in layer_ids],
            num_target_layers=int(num_target_layers),
        )


def validate_draft_against_target(draft: DraftConfig, target: ModelConfig) -> None:
    problems = []
    if draft.hidden_size != target.hidden_size:
        problems.append(
            f"draft hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}"
        )
    if draft.num_target_layers != target.num_hidden_layers:
        problems.append(
            f"draft was trained for a target with {draft.num_target_layers} layers, "
            f"but the target has {target.num_hidden_layers}"
        )
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        problems.append(
            f"draft target_layer_ids {bad} out of range for a target with "
            f"{target.num_hidden_layers} layers"
        )
    if not 0 <= draft.mask_token_id < target.vocab_size:
        problems.append(
            f"draft mask_token_id {draft.mask_token_id} is outside the target vocabulary "
            f"(vocab_size {target.vocab_size})"
        )
    if problems:
        raise ValueError("DFlash draft does not match the target: " + "; ".join(problems))


def draft_config_dict(
    target: dict[str, Any] | ModelConfig,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    torch_dtype: str = "float32",
    initializer_range: float = 0.02,
    validate: bool = True,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    attention: dict[str, int] | None = None,
) -> dict[str, Any]:
    """config.json of a DFlash draft in the published layout (DFlashDraftModel, Qwen3-style
    layers, block_size at the top, dflash_config {mask_token_id, target_layer_ids}) with
    `num_layers` layers of the target's width, heads, RoPE and vocabulary. This is the one
    writer of draft configs: the trainer's export, random checkpoints and test drafts all use it.

    `target` is the target's config.json dict (or its parsed ModelConfig: a hybrid target's
    HybridConfig); taps default to
    default_target_layer_ids. `validate` refuses a draft the target cannot run (taps outside
    it, a mask token outside its vocabulary); tests that write broken drafts on purpose turn
    it off.

    `layer_types` (default: every layer "full_attention") with `sliding_window` writes a draft
    whose "sliding_attention" layers attend within that window (use_sliding_window true, as
    transformers' Qwen3Config needs to keep it). `attention` overrides the target's
    num_attention_heads / num_key_value_heads / head_dim / intermediate_size: a hybrid
    target's drafts are Qwen3-style layers of their own shape (head_dim 128, full RoPE)."""
    t = target if isinstance(target, ModelConfig) else ModelConfig.from_dict(target)
    taps = (default_target_layer_ids(t.num_hidden_layers, num_layers) if target_layer_ids is None
            else [int(i) for i in target_layer_ids])
    types = list(layer_types) if layer_types is not None else [FULL_ATTENTION] * num_layers
    sliding = SLIDING_ATTENTION in types
    shape = {"num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
             "head_dim": t.head_dim, "intermediate_size": t.intermediate_size, **(attention or {})}
    cfg = {
        "architectures": [DRAFT_ARCHITECTURE],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "bos_token_id": t.raw.get("bos_token_id"),
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": taps},
        "eos_token_id": t.raw.get("eos_token_id"),
        "head_dim": shape["head_dim"],
        "hidden_act": "silu",
        "hidden_size": t.hidden_size,
        "initializer_range": initializer_range,
        "intermediate_size": shape["intermediate_size"],
        "layer_types": types,
        "max_position_embeddings": t.max_position_embeddings,
        "max_window_layers": num_layers,
        "model_type": "qwen3",
        "num_attention_heads": shape["num_attention_heads"],
        "num_hidden_layers": num_layers,
        "num_key_value_heads": shape["num_key_value_heads"],
        "num_target_layers": t.num_hidden_layers,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_scaling": t.rope_scaling,
        "rope_theta": t.rope_theta,
        "sliding_window": sliding_window if sliding else None,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "use_cache": True,
        "use_sliding_window": sliding,
        "vocab_size": t.vocab_size,
    }
    if validate:
        validate_draft_against_target(DraftConfig.from_dict(cfg), t)
    return cfg


def write_draft_config(directory: str | Path, cfg: dict[str, Any]) -> Path:
    """Write `cfg` (a draft_config_dict) as `directory`/config.json; returns that path."""
    path = Path(directory) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path
