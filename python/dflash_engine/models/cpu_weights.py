"""Packed GEMM weights for the fast CPU mode (`cpu_weights`, docs/perf.md "CPU weight formats").

A CPU decode step is bound by the weight GEMMs, and a float32 GEMV of one row reads 4 bytes per
weight. Two packed forms, each a copy made once at load beside the float32 parameter (which stays
the source of truth: the exact mode and `set_batch_invariant` never see the packed copies):

- bf16: the weight in bfloat16, reordered once by oneDNN into its blocked GEMM layout
  (`mkldnn._reorder_linear_weight`; AVX512-BF16 where the CPU has it). Used for every GEMM of
  a packed layer that the int4 form does not take. Lossless for a bf16 checkpoint.
- int4: for weights that lie exactly on a 4-bit affine grid in groups of 32 along the input
  dimension -- what a Q4_0/Q4_1 GGUF dequantises to (the embedded SmolLM2's layers are Q4_1) --
  the 4-bit codes plus a bf16 scale and zero per group (`_weight_int4pack_mm_for_cpu`). A weight
  not on such a grid (checked element by element) gets no int4 form. Used for GEMMs of at most
  `INT4_MAX_ROWS` rows (a decode step, a short verify block): there it reads 1/8 of float32's
  bytes; past that oneDNN's bf16 GEMM is faster.

Either way the GEMM's input is rounded to bfloat16 and its output (bf16) is returned in the
input's dtype: activations, norms, attention and the KV cache keep the model's dtype.
"""
from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32  # int4 group size along the input dimension (GGUF's Q4_0/Q4_1 block)
INT4_MAX_ROWS = 6  # rows up to which the int4 GEMM beats oneDNN's bf16 one (2-core Zen4, docs/perf.md)
_BF16_PACK_ROWS = 16  # the row count oneDNN's weight reorder is tuned for (fast from 1 to 16 rows)
FORMATS = ("auto", "none", "bf16", "int4")


def _mkldnn_bf16() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int4_available() -> bool:
    return hasattr(torch, "_convert_weight_to_int4pack_for_cpu") and hasattr(torch, "_weight_int4pack_mm_for_cpu")


def int4_grid(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor] | None:
    """(codes [N, K] int32 in 0..15, scale [N, K/group], min [N, K/group]) with
    weight == codes * scale + min (to a thousandth of a step) for every element, or None when
    `weight` is not on such a grid. The grid of each group is its min and (max - min) / 15: a
    Q4_1 block's extremes are codes 0 and 15 (llama.cpp quantises to the block's own range)."""
    n, k = weight.shape
    if k % group or weight.dtype != torch.float32:
        return None
    w = weight.detach().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((w - lo[..., None]) / safe[..., None]).round_().clamp_(0, 15)
    err = (codes * scale[..., None] + lo[..., None] - w).abs()
    if bool((err > 1e-3 * safe[..., None] + 1e-12).any()):
        return None
    return codes.reshape(n, k).to(torch.int32), scale, lo


def int4_round(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor, Tensor] | None:
    """`int4_grid`'s (codes, scale, min) for any weight: each group of `group` inputs rounded to
    the nearest of 16 steps spanning its own range (lossy: at most half a step, (max - min) / 30,
    per element). None when the input dimension is not whole groups."""
    n, k = weight.shape
    if k % group:
        return None
    w = weight.detach().float().reshape(n, k // group, group)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((w - lo[..., None]) / safe[..., None]).round_().clamp_(0, 15)
    return codes.reshape(n, k).to(torch.int32), scale, lo


class PackedWeight:
    """A [N, K] weight's packed forms; `__call__(x [M, K])` -> x @ weight.T in x's dtype.

    int4=True packs an int4 form where the weight lies on a 4-bit grid (exact); `rounded=True`
    packs one for any weight, rounded to the grid (`int4_round`: lossy, for GEMMs whose result is
    only a guess: a draft's). bf16=False packs no bf16 form (every row count then runs int4)."""

    def __init__(self, weight: Tensor, int4: bool, rounded: bool = False, bf16: bool = True):
        self.shape = tuple(weight.shape)
        self.mkldnn = _mkldnn_bf16()
        self.int4: tuple[Tensor, Tensor] | None = None
        # The int4 packing takes N in multiples of 16 (and K in whole groups: int4_grid).
        packable = (int4 or rounded) and int4_available() and weight.shape[0] % 16 == 0
        grid = (int4_round(weight) if rounded else int4_grid(weight)) if packable else None
        if grid is not None:
            codes, scale, lo = grid
            # The kernel computes (code - 8) * scale + zero: zero = min + 8 * scale.
            zeros = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(torch.bfloat16).contiguous()
            self.int4 = (torch._convert_weight_to_int4pack_for_cpu(codes, 2), zeros)
        self.int4_only = self.int4 is not None and not bf16
        self.bf16 = None
        if not self.int4_only:
            w16 = weight.detach().to(torch.bfloat16).contiguous()
            self.bf16 = torch.ops.mkldnn._reorder_linear_weight(w16, _BF16_PACK_ROWS) if self.mkldnn else w16

    @property
    def format(self) -> str:
        return "int4" if self.int4 is not None else "bf16"

    def __call__(self, x: Tensor) -> Tensor:
        xb = x.to(torch.bfloat16)
        if self.int4 is not None and (xb.shape[0] <= INT4_MAX_ROWS or self.int4_only):
            out = torch._weight_int4pack_mm_for_cpu(xb, self.int4[0], GROUP, self.int4[1])
        elif self.mkldnn:
            out = torch.ops.mkldnn._linear_pointwise(xb, self.bf16, None, "none", [None], "")
        else:
            out = torch.nn.functional.linear(xb, self.bf16)
        return out.to(x.dtype)


def pack_cpu_weights(model: torch.nn.Module, fmt: str, rounded: bool = False) -> dict[str, int]:
    """Give every Linear of `model` (and a target's logits weight) packed forms: fmt "bf16" or
    "int4" (int4 too where the weight is on a 4-bit grid; with `rounded`, every weight gets an
    int4 form rounded to a grid: a draft's). A DFlash draft's context write gets every layer's k, v
    rows stacked in one packed weight (`ctx_kv_packed`). Returns {format: count}. The model
    must be on the CPU in the fast mode (set_batch_invariant(model, False))."""
    from .dflash import DFlashDraftModel
    from .layers import Attention, CausalLM, Linear

    if fmt not in ("bf16", "int4"):
        raise ValueError(f"cannot pack CPU weights as {fmt!r}")
    counts: dict[str, int] = {}

    def pack(w: Tensor) -> PackedWeight:
        p = PackedWeight(w, int4=fmt == "int4", rounded=rounded)
        counts[p.format] = counts.get(p.format, 0) + 1
        return p

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear):
                m.packed = pack(m.weight)
        for m in model.modules():
            if isinstance(m, CausalLM):
                m.logits_packed = pack(m.model.embed_tokens.weight) if m.lm_head is None else m.lm_head.packed
        if isinstance(model, DFlashDraftModel) and all(
                layer.self_attn.qkv_proj.bias is None for layer in model.layers):
            # The context write: every layer's k, v rows in one GEMM (DFlashDraftModel.write_context).
            model.ctx_kv_packed = pack(torch.cat([layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:]
                                                  for layer in model.layers]))
            if model.layers[0].self_attn.k_norm is not None:
                model.ctx_k_norm_weight = torch.stack([layer.self_attn.k_norm.weight for layer in model.layers])[:, None]
        elif isinstance(model, DFlashDraftModel):
            for m in model.modules():
                if isinstance(m, Attention):
                    m.kv_packed = pack(m.qkv_proj.weight[m.q_size:])  # the context write: k and v only
    return counts


def unpack_cpu_weights(model: torch.nn.Module) -> None:
    """Drop every packed form (the model computes from its parameters again)."""
    from .dflash import DFlashDraftModel
    from .layers import Attention, CausalLM, Linear

    for m in model.modules():
        if isinstance(m, DFlashDraftModel):
            m.ctx_kv_packed = m.ctx_k_norm_weight = None
        if isinstance(m, Linear):
            m.packed = None
        elif isinstance(m, CausalLM):
            m.logits_packed = m.proposal_packed = None
        elif isinstance(m, Attention):
            m.kv_packed = None


def pack_proposal_logits(target: torch.nn.Module) -> str | None:
    """Give a target (CausalLM, packed by `pack_cpu_weights`) a rounded int4 copy of its logits
    weight for a draft's proposals of up to INT4_MAX_ROWS rows (`CausalLM.propose`): about half
    the bf16 GEMM's time at a K = 3 block. Returns the format packed, or None where this torch has no CPU int4 GEMM."""
    if not int4_available():
        return None
    weight = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    with torch.no_grad():
        pad = -weight.shape[0] % 16  # the int4 packing takes N in multiples of 16: zero rows, sliced off
        w = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]) if pad else weight
        p = PackedWeight(w, int4=True, rounded=True, bf16=False)  # more rows: logits_packed
    target.proposal_packed = p
    return p.format


def resolve_cpu_weights(fmt: str, device: torch.device, batch_invariant: bool, dtype_arg: str,
                        model_dtype: torch.dtype, from_gguf: bool) -> str:
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
    if from_gguf and dtype_arg == "auto" and model_dtype == torch.float32:
        return "int4"
    return "none"


REFINE_TOP = 8  # logits recomputed in float32 per row (packed_logits)
_SCAN_BLOCK = 128  # columns per block of `row_topk` / `row_argmax`


def row_topk(x: Tensor, k: int) -> Tensor:
    """The indices of each row's k largest entries of x [M, V] (what x.topk(k).indices holds, up
    to the order among ties at the k-th value), in two passes over blocks of 128 columns: the
    top k elements lie in the k blocks of largest maximum. torch's CPU topk over a 49,152-wide
    row takes ~120 us a row; this ~20. Falls back to topk where V is not whole blocks."""
    m, v = x.shape
    if v % _SCAN_BLOCK or v < 4 * k * _SCAN_BLOCK:
        return x.topk(min(k, v), dim=-1).indices
    blocks = x.view(m, v // _SCAN_BLOCK, _SCAN_BLOCK)
    top = blocks.amax(-1).topk(k, dim=-1).indices  # [M, k] blocks
    cand = blocks.gather(1, top[..., None].expand(m, k, _SCAN_BLOCK)).view(m, k * _SCAN_BLOCK)
    pos = cand.topk(k, dim=-1).indices
    return top.gather(1, pos // _SCAN_BLOCK) * _SCAN_BLOCK + pos % _SCAN_BLOCK


def row_argmax(x: Tensor) -> Tensor:
    """x.argmax(-1) for x [M, V] on the CPU, exactly (the first index of each row's maximum),
    through the blocks' maxima: torch's CPU argmax over a 49,152-wide row is ~4x amax's time."""
    m, v = x.shape
    if x.device.type != "cpu" or v % _SCAN_BLOCK or v < 4 * _SCAN_BLOCK or m == 0:
        return x.argmax(-1)
    blocks = x.view(m, v // _SCAN_BLOCK, _SCAN_BLOCK)
    b = blocks.amax(-1).argmax(-1)  # the first block holding the row's maximum
    inner = blocks[torch.arange(m), b].argmax(-1)
    return b * _SCAN_BLOCK + inner


def packed_logits(hidden: Tensor, packed: PackedWeight, weight: Tensor, refine: bool = True) -> Tensor:
    """Float32 logits through the packed (bf16) logits weight, each row's `REFINE_TOP` largest
    recomputed from the float32 `weight` and `hidden`. The bf16 GEMM's output is bf16: at a
    logit of ~25 its step is 0.125, so near-ties (a margin of 0.08 decides the embedded model's
    first answer token to "What is the capital of France?") would tie and flip the greedy choice;
    refined, greedy picks what float32 weights pick unless the bf16 error (~3e-3 relative) pushes
    the winner out of the top 8. The rest of the row keeps the bf16 values (sampling's tail)."""
    logits = packed(hidden).float()
    if refine and logits.shape[0]:
        idx = row_topk(logits, REFINE_TOP)  # [M, k]
        exact = torch.bmm(weight[idx].float(), hidden.float().unsqueeze(-1)).squeeze(-1)  # [M, k]
        logits.scatter_(1, idx, exact)
    return logits
