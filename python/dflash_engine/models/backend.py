"""The one hook through which a runtime backend changes how a model computes, never what.

A model computes through `ops/dispatch` (torch reference ops, or Triton kernels on the GPU)
with one code path, its GEMMs in the exact mode or the plain one by the model's flag
(`layers.set_batch_invariant`). A backend that needs work prepared per model -- the fast CPU
backend (python/dflash_engine/cpu/: packed bf16/int4 weights, a fused layer loop, a one-GEMM
context write) -- is installed once after loading by setting the model's `backend` attribute to
an object with the methods below; `None` (the default) is the reference path. The model keeps
its embedding, RoPE tables and every parameter; the backend replaces the stages named here,
computing the same function to its own numerical tolerance (it is not batch-invariant:
`set_batch_invariant(model, True)` removes it).

The backend holds references into the model (weights, norms): install it after the model's
weights and device are final. Nothing in models/ imports a backend.
"""
from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ..ops.attention import AttentionMetadata


class LayerStackBackend(Protocol):
    def run_layers(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata, kv_layers,
                   tap_layers: list[int] | None) -> tuple[Tensor, Tensor | None]:
        """`layers.run_layers` over the model's own decoder layers and final norm: (final-normed
        hidden [T, H], the residual streams after `tap_layers` concatenated, or None)."""
        ...


class TargetBackend(LayerStackBackend, Protocol):
    """What `CausalLM.backend` holds."""

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Float32 logits [N, V] of final-normed hidden rows."""
        ...

    def propose(self, hidden: Tensor) -> Tensor:
        """A draft's proposed tokens [N] from its final-normed hidden rows (a guess the target
        verifies: a backend may compute it more coarsely than `compute_logits`)."""
        ...


class DraftBackend(LayerStackBackend, Protocol):
    """What `DFlashDraftModel.backend` holds."""

    def write_context(self, taps: Tensor, positions: Tensor, slot_mapping: Tensor, kv) -> None:
        """`DFlashDraftModel.write_context`: taps [N, n_taps*H] -> every draft layer's K/V."""
        ...
