"""The frozen target's taps over whole training sequences, for any target.

Dense targets (Llama, Qwen3) run dense.dense_target_taps: their layer stack without a KV
cache. A hybrid target (Qwen3.5: Gated DeltaNet + gated attention) runs the engine's own
forward (models/qwen3_5.py Qwen3_5ForCausalLM.forward, its GDN and attention ops unchanged)
as one prefill of every sequence, over a temporary KV cache (each sequence its own pages)
and a temporary HybridState that nothing reads or keeps (every sequence starts from the zero
state). Both are causal: trailing padding does not change earlier positions.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..models.hybrid_state import HybridState, StateMetadata
from ..models.qwen3_5_config import HybridConfig
from ..ops.attention import AttentionMetadata
from ..worker.kv_cache import KVCache
from .dense import dense_target_taps

_PAGE = 16  # tokens per page of the temporary KV cache


def target_taps(target, ids: Tensor, tap_layers: Sequence[int]) -> Tensor:
    """The residual stream after each layer in `tap_layers` of a causal forward of the
    engine target `target` over whole sequences ids [N, S] -> [N, S, n_taps*H]."""
    if isinstance(target.config, HybridConfig):
        return hybrid_target_taps(target, ids, tap_layers)
    return dense_target_taps(target, ids, tap_layers)


@torch.no_grad()
def hybrid_target_taps(target, ids: Tensor, tap_layers: Sequence[int]) -> Tensor:
    """target_taps of a hybrid target (models/qwen3_5.py): every row of ids [N, S] is one
    request prefilled from scratch, all in one forward of the engine's layer stack."""
    cfg: HybridConfig = target.config
    n, s = ids.shape
    dev = ids.device
    dtype = target.model.embed_tokens.weight.dtype
    # KV: request r's positions fill pages 1 + r*P .. (r+1)*P in order (page 0 is the null page).
    # A fixed page size: the GPU attention kernels are compiled per page size.
    per = -(-s // _PAGE)
    shape = (1 + n * per, _PAGE, cfg.num_key_value_heads, cfg.head_dim)
    kv = KVCache([(torch.empty(shape, dtype=dtype, device=dev), torch.empty(shape, dtype=dtype, device=dev))
                  for _ in cfg.attention_layer_ids], [], shape[0], _PAGE)
    qsl, lens = list(range(0, n * s + 1, s)), [s] * n
    first_slot = (1 + per * torch.arange(n, device=dev)) * _PAGE
    meta = AttentionMetadata(
        slot_mapping=(first_slot[:, None] + torch.arange(s, device=dev)).reshape(-1),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        page_tables=torch.arange(1, 1 + n * per, dtype=torch.int32, device=dev).view(n, per),
        causal=True, max_query_len=s, query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    # State: every request starts fresh (reads no slot) and keeps none (writes none): one
    # slot of a 27B-class target is ~100 MB, and nothing is decoded after this forward.
    state = HybridState.allocate(cfg, 1, dtype, dev)
    state_meta = StateMetadata.from_lists([-1] * n, [-1] * (n * s), dev)
    positions = torch.arange(s, device=dev).repeat(n)
    _, taps = target(ids.reshape(-1), positions, meta, kv, list(tap_layers), state=state, state_meta=state_meta)
    return taps.view(n, s, -1)
