"""A hybrid target's recurrent state inside the KV pool: one pool of pages for everything.

The Rust core hands out page ids from one pool (rust/src/page_pool.rs); a page id names
either `page_size` tokens of attention KV (target and draft layers) or one *state slot* (the
conv window and recurrent state of every GDN layer), never both at once. Memory follows:

    one flat buffer [num_pages, bytes_per_page] (KVCache.allocate(flat=True));
    KV tensor i (one per attention layer and K|V, target then draft) is a strided view
      [num_pages, page_size, n_kv, d]: page p of tensor i = bytes [chunk offset i, + chunk_i)
      of row p, chunk_i = page_size * n_kv * d * elem;
    GDN layer g's conv window and recurrent state (its two *components*) sit at fixed byte
      offsets of the page (`place`, packed one after the other): slot p's state lies in row p.

So the state of slot p is a strided view into the very bytes that hold the KV of page p:
nothing is allocated for it, and the pool's bytes are `num_pages * bytes_per_page` whatever
the pages hold. `hybrid_page_size` raises the page's token count (in multiples of the one
asked for) until the components fit in one page's bytes (`layout`). Components cross the
K/V tensors' chunk boundaries freely, so the padding is under one base page of bytes (run 30
at the Qwen3.5-27B shape, with a slot per KV chunk: 1,536-token pages of 126 MiB for a
74.8 MiB slot; packed: 912 tokens, 74.8 MiB). The pool's one capacity number is pages
(memory.py); the core counts KV pages and state slots against it alike.

A page recycled from KV to state holds garbage: a slot is never read before it is written
(the core reads -1, zeros, for a request without state). A page recycled from state to KV is
only read at positions its new owner wrote (attention reads positions < seq_len).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.hybrid_state import HybridState
from ..models.qwen3_5_config import HybridConfig

# Component offsets are aligned to this many bytes inside a page.
ALIGN = 64
# The largest page the search tries (tokens): a state slot that needs more is a config error.
MAX_PAGE_SIZE = 1 << 20


@dataclass(frozen=True)
class Component:
    """One GDN layer's conv window or recurrent state (per slot)."""

    layer: int  # index among the GDN layers
    kind: str  # "conv" | "recurrent"
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class StateLayout:
    """Where each component of a slot lives: its byte offset in the page (the flat buffer's row)."""

    page_size: int
    chunk_bytes: tuple[int, ...]  # per KV tensor: bytes of one page (the chunks follow each other in a page)
    components: tuple[Component, ...]
    offsets: tuple[int, ...]  # per component: bytes from the page's start

    @property
    def bytes_per_slot(self) -> int:
        """The state of one slot, unpadded (HybridState.bytes_per_slot)."""
        return sum(c.nbytes for c in self.components)

    @property
    def bytes_per_page(self) -> int:
        return sum(self.chunk_bytes)


def components(cfg: HybridConfig, dtype: torch.dtype) -> list[Component]:
    conv, rec = HybridState.shapes(cfg)
    out = []
    for g in range(len(cfg.gdn_layer_ids)):
        out += [Component(g, "conv", conv, dtype), Component(g, "recurrent", rec, cfg.state_dtype)]
    return out


def chunk_bytes(target_cfg: HybridConfig, draft_cfg, page_size: int, dtype: torch.dtype) -> list[int]:
    """Bytes of one page of each KV tensor, in KVCache order (target layers' K, V, then the draft's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per = [target_cfg.num_key_value_heads * target_cfg.head_dim] * len(target_cfg.attention_layer_ids)
    if draft_cfg is not None:
        per += [draft_cfg.num_key_value_heads * draft_cfg.head_dim] * draft_cfg.num_hidden_layers
    return [page_size * n * elem for n in per for _ in "kv"]


def place(comps: list[Component], page_bytes: int) -> list[int] | None:
    """Byte offsets packing the components one after the other in a page of `page_bytes`
    (largest first, each offset a multiple of ALIGN and of its element size); None if they
    do not fit."""
    offsets: list[int | None] = [None] * len(comps)
    at = 0
    for i in sorted(range(len(comps)), key=lambda i: (-comps[i].nbytes, i)):
        at = -(-at // ALIGN) * ALIGN  # ALIGN is a multiple of every element size
        offsets[i] = at
        at += comps[i].nbytes
    return offsets if at <= page_bytes else None  # type: ignore[return-value]


def layout(target_cfg: HybridConfig, draft_cfg, page_size: int, dtype: torch.dtype) -> StateLayout | None:
    comps = components(target_cfg, dtype)
    chunks = chunk_bytes(target_cfg, draft_cfg, page_size, dtype)
    offsets = place(comps, sum(chunks))
    if offsets is None:
        return None
    return StateLayout(page_size, tuple(chunks), tuple(comps), tuple(offsets))


def hybrid_page_size(target_cfg: HybridConfig, draft_cfg, base: int, dtype: torch.dtype) -> int:
    """The smallest multiple of `base` tokens whose page holds one state slot (`layout`)."""
    if not target_cfg.attention_layer_ids:
        raise ValueError("a hybrid target without attention layers has no KV pages to hold its state")
    ps = base
    while layout(target_cfg, draft_cfg, ps, dtype) is None:
        ps += base
        if ps > MAX_PAGE_SIZE:
            raise ValueError(f"no page of <= {MAX_PAGE_SIZE} tokens holds one state slot")
    return ps


def _view(flat: Tensor, offset: int, c: Component) -> Tensor:
    """Component `c` of every slot: [num_pages, *c.shape], strided over the flat buffer's rows."""
    return flat[:, offset:offset + c.nbytes].view(c.dtype).view(flat.shape[0], *c.shape)


def state_views(kv, lay: StateLayout) -> HybridState:
    """The HybridState of a KVCache allocated flat with `lay.page_size`: views, no allocation."""
    if kv.flat is None:
        raise ValueError("a hybrid target's KV pool is allocated flat (KVCache.allocate(flat=True))")
    if kv.flat.shape[1] != lay.bytes_per_page:
        raise ValueError(f"KV pages of {kv.flat.shape[1]} bytes do not match the state layout's {lay.bytes_per_page}")
    n = len(lay.components) // 2
    conv: list[Tensor | None] = [None] * n
    recurrent: list[Tensor | None] = [None] * n
    for c, offset in zip(lay.components, lay.offsets):
        (conv if c.kind == "conv" else recurrent)[c.layer] = _view(kv.flat, offset, c)
    return HybridState(conv=conv, recurrent=recurrent)  # type: ignore[arg-type]
