"""Paged KV cache: one pool of pages shared by the target layers and the DFlash draft layers.

Draft layers use the same page ids and slot mapping as the target, so the draft context of a
request is always exactly the target's committed positions. Page 0 is the null page.
A hybrid target has KV for its attention layers only; its GDN layers' state slots are views
into the same pages (`state`, set by state_pool.state_views), so its pool is one flat byte
buffer (`flat`, [num_pages, bytes_per_page]) and every K/V tensor a strided view into it.
Either way the draft layers' K/V tensors are views of one `draft_stack` [L, 2, pages,
page_size, KV, D] (`draft[l] == (draft_stack[l, 0], draft_stack[l, 1])`), which the draft's
context write fills for every layer in one launch (kernels/rotary.py context_kv_store).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..models.config import DraftConfig, ModelConfig, resolve_dtype


def _layer_shapes(target_cfg: ModelConfig, draft_cfg: DraftConfig | None) -> tuple[list, list]:
    ids = getattr(target_cfg, "attention_layer_ids", None)  # a hybrid target: its attention layers
    n = target_cfg.num_hidden_layers if ids is None else len(ids)
    target = [(target_cfg.num_key_value_heads, target_cfg.head_dim)] * n
    draft = [] if draft_cfg is None else (
        [(draft_cfg.num_key_value_heads, draft_cfg.head_dim)] * draft_cfg.num_hidden_layers
    )
    return target, draft


class KVCache:
    def __init__(
        self,
        target: list[tuple[Tensor, Tensor]],
        draft: list[tuple[Tensor, Tensor]],
        num_pages: int,
        page_size: int,
        flat: Tensor | None = None,
        draft_stack: Tensor | None = None,
    ):
        self.target = target
        self.draft = draft
        self.num_pages = num_pages
        self.page_size = page_size
        self.flat = flat  # the one buffer behind every tensor above (flat allocation), else None
        self.draft_stack = draft_stack  # [L, 2, pages, page_size, KV, D]: every draft K/V (None: no draft)
        self.state = None  # a hybrid target's HybridState: views into these pages (state_pool.py)

    @staticmethod
    def bytes_per_page(
        target_cfg: ModelConfig,
        draft_cfg: DraftConfig | None,
        page_size: int,
        dtype: torch.dtype | str,
    ) -> int:
        elem = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
        target, draft = _layer_shapes(target_cfg, draft_cfg)
        return sum(2 * page_size * n_kv * head_dim * elem for n_kv, head_dim in target + draft)

    @classmethod
    def allocate(
        cls,
        target_cfg: ModelConfig,
        draft_cfg: DraftConfig | None,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | str,
        device: torch.device | str = "cpu",
        flat: bool = False,
    ) -> KVCache:
        """Zeroed pages. `flat`: one [num_pages, bytes_per_page] byte buffer whose page rows
        hold each K/V tensor's page one after the other (tensors are strided views; what a
        hybrid target's state slots need, state_pool.py); else one tensor per K and V."""
        if num_pages < 2:
            raise ValueError(f"KV cache needs at least 2 pages (page 0 is the null page), got {num_pages}")
        dtype = resolve_dtype(dtype)
        target, draft = _layer_shapes(target_cfg, draft_cfg)
        nd = len(draft)
        if flat:
            elem = torch.empty((), dtype=dtype).element_size()
            buf = torch.zeros((num_pages, cls.bytes_per_page(target_cfg, draft_cfg, page_size, dtype)),
                              dtype=torch.uint8, device=device)
            at = 0

            def view(n_kv: int, head_dim: int) -> Tensor:
                nonlocal at
                n = page_size * n_kv * head_dim * elem
                t = buf[:, at:at + n].view(dtype).view(num_pages, page_size, n_kv, head_dim)
                at += n
                return t

            pairs = [(view(*s), view(*s)) for s in target + draft]
            stack = None
            if nd:  # the draft's tensors sit last in each page row, K then V per layer, all one size
                k0 = pairs[len(target)][0]
                n_kv, head_dim = draft[0]
                m = page_size * n_kv * head_dim
                stack = k0.as_strided((nd, 2, num_pages, page_size, n_kv, head_dim),
                                      (2 * m, m, k0.stride(0), n_kv * head_dim, head_dim, 1))
            return cls(pairs[:len(target)], pairs[len(target):], num_pages, page_size, flat=buf, draft_stack=stack)

        def pair(n_kv: int, head_dim: int) -> tuple[Tensor, Tensor]:
            shape = (num_pages, page_size, n_kv, head_dim)
            return (torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, device=device))

        stack = None
        if nd:
            stack = torch.zeros((nd, 2, num_pages, page_size, *draft[0]), dtype=dtype, device=device)
        return cls([pair(*s) for s in target], [(stack[i, 0], stack[i, 1]) for i in range(nd)], num_pages,
                   page_size, draft_stack=stack)
