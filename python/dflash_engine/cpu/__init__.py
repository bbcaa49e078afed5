"""The fast CPU backend: what CPU users get by default (the fast mode, not batch-invariant).

The models compute through `ops/dispatch` only (models/layers.py); this package replaces their
layer loop, logits, proposals and draft-context write through the models' `backend` hook
(models/backend.py), once, after loading:

    fmt = resolve_format(cfg.cpu_weights, device, batch_invariant, cfg.dtype, model_dtype, is_gguf)
    for line in install(target, draft, fmt):
        logger.info(line)

What it installs (docs/perf.md, "CPU spec step"): per GEMM weight a packed bf16 / int4 form
(weights.py; "none": the weight in the model's dtype, stored column-major for `fast_linear`),
the fused layer loop and one-GEMM context write (layers.py), float32-refined packed logits and
blocked argmax scans (logits.py). With format "int4" and a draft, the draft's GEMMs and its
proposals' logits are rounded to int4 (lossy: a proposal is a guess the target verifies, so
this moves the acceptance rate, never the output).
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.dflash import DFlashDraftModel
from ..models.layers import CausalLM, DecoderLayer
from ..ops import dispatch
from .backend import FastDraft, FastTarget, format_counts
from .logits import pack_proposal_weight, row_argmax, row_topk
from .weights import FORMATS, INT4_MAX_ROWS, PackedWeight, column_major, fast_linear, int4_available

__all__ = [
    "FORMATS",
    "INT4_MAX_ROWS",
    "FastDraft",
    "FastTarget",
    "PackedWeight",
    "applies",
    "fast_linear",
    "install",
    "resolve_format",
    "row_argmax",
    "row_topk",
]


def resolve_format(fmt: str, device, batch_invariant: bool, dtype_arg: str, model_dtype: torch.dtype,
                   is_gguf: bool) -> str:
    """The packed format a model gets: "none" off the CPU and in the exact mode (whatever was
    asked); "auto": int4 for a GGUF-converted float32 model loaded at dtype "auto" (the embedded
    default: its layers are Q4_1, so the int4 form holds their exact values), bf16 for a bfloat16
    model (lossless), none otherwise (an explicit dtype="float32" keeps float32 GEMMs)."""
    if fmt not in FORMATS:
        raise ValueError(f"cpu_weights must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if torch.device(device).type != "cpu" or batch_invariant:
        return "none"
    if fmt != "auto":
        return fmt
    if model_dtype == torch.bfloat16:
        return "bf16"
    if is_gguf and dtype_arg == "auto" and model_dtype == torch.float32:
        return "int4"
    return "none"


def applies(model: CausalLM | DFlashDraftModel) -> bool:
    """Whether the backend runs `model`: on the CPU, in the fast mode (not `batch_invariant`), and
    with dispatch's torch ops (not the Triton kernels under the interpreter)."""
    if isinstance(model, CausalLM):
        weight, exact = model.logits_weight, model.batch_invariant
    else:
        weight, exact = model.fc.weight, model.fc.batch_invariant
    return weight.device.type == "cpu" and not exact and not dispatch.use_kernels(weight)


def _plain_layers(layers) -> bool:
    """Whether every layer is a full-attention models.layers.DecoderLayer: the layers FastLayer
    computes (a hybrid target's or a sliding-window layer keeps the reference path)."""
    return all(isinstance(layer, DecoderLayer) and getattr(layer.self_attn, "window", None) is None
               for layer in layers)


def _relayout(model: nn.Module) -> None:
    """Every Linear weight (and a tied logits weight: the embedding) column-major, in place: what
    `fast_linear` streams fastest. Only for format "none": packed weights never read the
    parameter's layout. `set_batch_invariant(model, True)` restores the row-major layout."""
    tied = isinstance(model, CausalLM) and model.lm_head is None
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) or (tied and isinstance(m, nn.Embedding)):
                m.weight.data = column_major(m.weight.data)


def install(target: CausalLM, draft: DFlashDraftModel | None, fmt: str) -> list[str]:
    """Install the fast CPU backend into `target` (a CausalLM) and `draft` (a DFlashDraftModel or
    None), GEMM weights in format `fmt` ("none", "bf16" or "int4": `resolve_format`'s answer).
    Returns log lines. Installs nothing (returns []) where it does not apply (`applies`): a model
    off the CPU, in the exact mode, or under the kernel interpreter. A model whose layers the fused
    loop does not compute (a hybrid target, sliding-window draft layers) keeps the reference path,
    and a log line says so. Call once, after loading; `models.layers.set_batch_invariant(model,
    True)` removes it."""
    if fmt not in FORMATS[1:]:
        raise ValueError(f"install takes a resolved format (none, bf16, int4), got {fmt!r}")
    if not applies(target):
        return []
    if not _plain_layers(target.model.layers):
        return [f"CPU backend: not installed ({type(target).__name__}'s layers run the reference path)"]
    if draft is not None and not applies(draft):
        raise ValueError("the draft must run in the target's mode on the target's device")
    lines = []
    if draft is not None and not _plain_layers(draft.layers):
        lines.append("CPU backend: not for the draft (its sliding-window layers run the reference path)")
        draft = None
    if fmt == "none":
        for model in (target, draft):
            if model is not None:
                _relayout(model)
    proposals = None
    if draft is not None and fmt == "int4" and int4_available():
        proposals = pack_proposal_weight(target.logits_weight)
    target.backend = FastTarget(target, fmt, proposals)
    lines += [f"CPU backend (fast mode): GEMM weights ({fmt}) of the target: {format_counts(target.backend.gemms())}"]
    if draft is not None:
        draft.backend = FastDraft(draft, fmt, rounded=fmt == "int4")
        lines.append(f"CPU backend (fast mode): GEMM weights ({fmt}) of the draft: "
                     f"{format_counts(draft.backend.gemms())}")
    if proposals is not None:
        lines.append(f"CPU backend (fast mode): the draft's proposal logits weight: {proposals.format} (rounded)")
    return lines
