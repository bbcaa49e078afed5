"""The fast CPU backend of a target and of a DFlash draft: the objects `install` puts in the
models' `backend` hook (models/backend.py: TargetBackend, DraftBackend)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..models.dflash import DFlashDraftModel
from ..models.layers import CausalLM
from .layers import ConcatGemm, FastContextWrite, FastStack
from .logits import packed_logits, row_argmax
from .weights import INT4_MAX_ROWS, Gemm, PackedWeight, make_gemm


def gemm_of(fmt: str, rounded: bool = False):
    """linear module -> its Gemm in format `fmt` (weights/make_gemm)."""
    return lambda m: make_gemm(m.weight, m.bias, fmt, rounded)


def format_counts(gemms) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g in gemms:
        counts[g.format] = counts.get(g.format, 0) + 1
    return counts


class FastTarget(FastStack):
    """A target's layer loop, logits and proposals (TargetBackend)."""

    def __init__(self, model: CausalLM, fmt: str, proposals: PackedWeight | None = None):
        make = gemm_of(fmt)
        super().__init__(model.model.layers, model.model.norm, make)
        self.vocab_size = model.config.vocab_size
        self.logits_weight = model.logits_weight  # float: packed_logits' refine reads its rows
        if model.lm_head is None:  # tied: the embedding is the logits weight
            self.logits = make_gemm(self.logits_weight, None, fmt)
        else:
            self.logits = make(model.lm_head)
        # The logits weight rounded to int4 for a draft's proposals of up to INT4_MAX_ROWS rows
        # (logits.pack_proposal_weight); None: proposals through `logits`, unrefined.
        self.proposals = proposals

    def gemms(self) -> list[Gemm]:
        return super().gemms() + [self.logits]

    def compute_logits(self, hidden: Tensor, refine: bool = True) -> Tensor:
        """Float32 logits. Through a packed logits weight, each row's top few are recomputed in
        float32 unless `refine` is False (proposals: logits.packed_logits)."""
        packed = self.logits.packed
        if packed is not None:
            return packed_logits(hidden, packed, self.logits_weight, refine)
        return self.logits(hidden).float()

    def propose(self, hidden: Tensor) -> Tensor:
        """The argmax of the unrefined logits, or of the rounded int4 ones (`proposals`) for a
        block of up to INT4_MAX_ROWS rows."""
        if self.proposals is not None and hidden.shape[0] <= INT4_MAX_ROWS:
            return row_argmax(self.proposals(hidden)[:, :self.vocab_size].contiguous())
        return row_argmax(self.compute_logits(hidden, refine=False))


class FastDraft(FastStack):
    """A DFlash draft's layer loop and context write (DraftBackend). `rounded`: every GEMM weight
    rounded to int4 (weights.int4_round; fmt "int4"): a draft only proposes."""

    def __init__(self, model: DFlashDraftModel, fmt: str, rounded: bool = False):
        make = gemm_of(fmt, rounded)
        super().__init__(model.layers, model.norm, make)
        self.fc = make(model.fc)
        attn = [layer.self_attn for layer in model.layers]
        kv_weights = [a.qkv_proj.weight[a.q_size:] for a in attn]  # the k, v rows: views
        kv_biases = [None if a.qkv_proj.bias is None else a.qkv_proj.bias[a.q_size:] for a in attn]
        if fmt == "none":  # no stacked float copy: one GEMM per layer over the rows in place
            kv = ConcatGemm([make_gemm(w, b, fmt) for w, b in zip(kv_weights, kv_biases)])
        else:
            stacked_bias = None if kv_biases[0] is None else torch.cat(kv_biases)
            kv = make_gemm(torch.cat(kv_weights), stacked_bias, fmt, rounded)
        self.context = FastContextWrite(model, self.fc, kv)

    def gemms(self) -> list[Gemm]:
        kv = self.context.kv
        return super().gemms() + [self.fc] + (kv.parts if isinstance(kv, ConcatGemm) else [kv])

    def write_context(self, taps: Tensor, positions: Tensor, slot_mapping: Tensor, kv) -> None:
        self.context(taps, positions, slot_mapping, kv)
