"""Gated DeltaNet layer ops over a flat batch with slot-indexed state: torch reference.

A GDN layer keeps, per sequence, a conv window (the last K-1 inputs of its short causal
conv) and a recurrent state; both live in pools indexed by state slot. Every op here takes
the same slot contract (models/hybrid_state.py's StateMetadata):
- `read[r]`: the slot sequence r's state is read from (< 0: no state yet, start from zeros);
- `write[t]`: the slot that receives the state after row t (< 0: not kept).
All states are read before any is written, so a request may write the slot it read.

`dispatch.use_kernels(x)` sends each op to its Triton kernel (kernels/gdn.py), which takes
device tensors only; the torch path below is the CPU oracle.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import dispatch
from .delta_rule import chunk_gated_delta_rule, host_list, read_slots, recurrent_gated_delta_rule


def _depthwise(seq: Tensor, weight: Tensor) -> Tensor:
    """Valid depthwise conv: seq [C, K-1+L], weight [C, K] -> [C, L], as K shifted
    multiply-adds (F.conv1d's depthwise CPU path costs ~10 ms a call on a busy 2-core host)."""
    length = seq.shape[1] - weight.shape[1] + 1
    y = seq[:, :length] * weight[:, :1]
    for j in range(1, weight.shape[1]):
        y = y.addcmul_(seq[:, j:j + length], weight[:, j:j + 1])
    return y


def causal_conv1d(
    x: Tensor, weight: Tensor, cu_seqlens: Tensor | Sequence[int], conv_pool: Tensor, read: Tensor,
    write: Tensor,
) -> Tensor:
    """silu(depthwise causal conv) of each sequence, continuing from its window.

    x [T, C]; weight [C, K]; conv_pool [S, C, K-1] (the activation dtype). The window after
    row t (its last K-1 inputs, row t included) is stored at conv_pool[write[t]]. The conv
    runs in the weight's dtype and the result comes back in x's (as transformers does).
    The kernel path takes `cu_seqlens` as a device tensor as is (a host list is copied)."""
    if dispatch.use_kernels(x):
        from ..kernels import gdn as _kernels

        return _kernels.causal_conv1d(x, weight, _device_index(cu_seqlens, x.device), conv_pool, read, write)
    cu = host_list(cu_seqlens)
    width = weight.shape[1] - 1
    windows = read_slots(conv_pool, read)  # [R, C, K-1]
    out = torch.empty_like(x)
    keep_slots, keep_windows = [], []
    write_host = host_list(write)
    for r in range(len(cu) - 1):
        s, e = cu[r], cu[r + 1]
        if e == s:
            continue
        seq = torch.cat((windows[r], x[s:e].t().to(windows.dtype)), dim=1)  # [C, K-1+L]
        out[s:e] = F.silu(_depthwise(seq.to(weight.dtype), weight)).t().to(x.dtype)
        rows = [t for t in range(e - s) if write_host[s + t] >= 0]
        if rows:  # window after row t = columns [t+1, t+K) of seq
            after = seq.unfold(1, width, 1)[:, 1:]  # [C, L, K-1]
            keep_windows.append(after[:, rows].transpose(0, 1))
            keep_slots += [write_host[s + t] for t in rows]
    if keep_slots:
        conv_pool.index_copy_(0, torch.tensor(keep_slots, device=conv_pool.device),
                              torch.cat(keep_windows).to(conv_pool.dtype))
    return out


def per_token_sequences(cu_seqlens: Sequence[int], write: Sequence[int]) -> list[bool]:
    """Which sequences run the per-token recurrence: those that keep a state before their
    last row (verification) and single-row ones (decode, so that a decode step and a
    verify block compute a token's state the same way); the rest (prefill) run chunked."""
    out = []
    for s, e in zip(cu_seqlens, cu_seqlens[1:]):
        out.append(e - s == 1 or any(w >= 0 for w in write[s:e - 1]))
    return out


def _rows(cu: list[int], seqs: list[int], device) -> tuple[Tensor, list[int]]:
    """Row indices of sequences `seqs` (in order) and their cu_seqlens within that sub-batch."""
    idx, sub_cu = [], [0]
    for r in seqs:
        idx += range(cu[r], cu[r + 1])
        sub_cu.append(len(idx))
    return torch.tensor(idx, dtype=torch.long, device=device), sub_cu


def gdn_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(g, beta) from the in_proj outputs a, b [T, H_v]: g = -exp(A_log) * softplus(a +
    dt_bias) in float32 (in half precision A_log.exp() can overflow), beta = sigmoid(b)."""
    beta = b.sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, beta: Tensor | None, cu_seqlens: Sequence[int],
    state_pool: Tensor, read: Tensor, write: Tensor, write_host: Sequence[int], per_token: Sequence[bool],
    chunk_size: int = 64, query_start_loc: Tensor | None = None,
    gates: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """The delta rule of a flat batch over a state pool [S, H_v, d_k, d_v], q/k l2-normed.
    Sequences flagged in `per_token` (see `per_token_sequences`) run the recurrent form and
    keep every state `write` asks for; the others run chunked and keep their final state
    at their last row's write slot. Returns o [T, H_v, d_v].

    `gates` = (a, b, A_log, dt_bias) in place of g and beta (pass None for those): the raw
    in_proj outputs, turned into g and beta by `gdn_gates`, or inside the recurrent kernel
    on the kernel path (torch computes them there only for chunked sequences).
    `query_start_loc`: cu_seqlens on the device (the attention metadata's), for the kernel
    path; without it the host list is copied there."""
    if dispatch.use_kernels(v):
        return _gated_delta_rule_kernels(q, k, v, g, beta, cu_seqlens, state_pool, read, write, write_host,
                                         per_token, chunk_size, query_start_loc, gates)
    if gates is not None:
        g, beta = gdn_gates(*gates)
    cu = list(cu_seqlens)
    out = torch.empty_like(v)
    groups = ([r for r, p in enumerate(per_token) if p], [r for r, p in enumerate(per_token) if not p])
    for recurrent, seqs in zip((True, False), groups):
        if not seqs:
            continue
        whole = len(seqs) == len(per_token)
        idx, sub_cu = (None, cu) if whole else _rows(cu, seqs, v.device)

        def pick(x: Tensor, idx: Tensor | None = idx) -> Tensor:
            return x if idx is None else x.index_select(0, idx)

        seq_ids = torch.tensor(seqs, dtype=torch.long, device=read.device)
        sub_read = read if whole else read.index_select(0, seq_ids)
        if recurrent:
            o = recurrent_gated_delta_rule(pick(q), pick(k), pick(v), pick(g), pick(beta), sub_cu, state_pool,
                                           sub_read, pick(write), use_qk_l2norm=True)
        else:
            o, final = chunk_gated_delta_rule(pick(q), pick(k), pick(v), pick(g), pick(beta), sub_cu,
                                              read_slots(state_pool, sub_read), use_qk_l2norm=True,
                                              chunk_size=chunk_size)
            last = [write_host[cu[r + 1] - 1] if cu[r + 1] > cu[r] else -1 for r in seqs]
            keep = [i for i, slot in enumerate(last) if slot >= 0]
            if keep:
                state_pool.index_copy_(0, torch.tensor([last[i] for i in keep], device=state_pool.device),
                                       final[keep].to(state_pool.dtype))
        if idx is None:
            out = o
        else:
            out.index_copy_(0, idx, o)
    return out


def _device_index(x: Tensor | Sequence[int], device) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(device)
    return torch.tensor(list(x), dtype=torch.int64, device=device)


def _gated_delta_rule_kernels(q, k, v, g, beta, cu_seqlens, state_pool, read, write, write_host, per_token,
                              chunk_size, query_start_loc, gates):
    """gated_delta_rule on the kernel path. A step whose sequences all run per token (or
    are empty: a graph's padding) is ONE launch of the fused recurrent kernel, without host
    lists (decode / verify: what a CUDA graph captures); with `gates` the kernel computes g
    and beta itself. A mixed step runs its per-token sequences in place (one launch,
    `seq_ids`) and gathers the chunked ones' rows for the chunked form (fla on CUDA), whose
    final states go to their last row's write slot (g and beta from `gdn_gates` there)."""
    from ..kernels import gdn as _kernels

    cu_dev = _device_index(cu_seqlens if query_start_loc is None else query_start_loc, v.device)
    # the recurrent kernel's gate inputs: raw a, b with A_log, dt_bias, or g and beta
    rec_g, rec_beta, rec_kw = (g, beta, {}) if gates is None else \
        (gates[0], gates[1], {"a_log": gates[2], "dt_bias": gates[3]})
    chunked = [r for r, p in enumerate(per_token) if not p]
    if chunked:  # host lengths are read only here: empty sequences need no chunked pass
        cu = list(cu_seqlens)
        chunked = [r for r in chunked if cu[r + 1] > cu[r]]
    if not chunked:
        return _kernels.fused_recurrent_gated_delta_rule(q, k, v, rec_g, rec_beta, cu_dev, state_pool, read, write,
                                                         **rec_kw)
    if gates is not None:
        g, beta = gdn_gates(*gates)
    out = torch.empty_like(v)
    recurrent = [r for r, p in enumerate(per_token) if p]
    if recurrent:
        _kernels.fused_recurrent_gated_delta_rule(
            q, k, v, rec_g, rec_beta, cu_dev, state_pool, read, write,
            seq_ids=torch.tensor(recurrent, dtype=torch.int64, device=v.device), out=out, **rec_kw)
    # every per-token sequence's slots differ from these reads: reading after its writes is safe
    idx, sub_cu = _rows(cu, chunked, v.device)
    sub_read = read.index_select(0, torch.tensor(chunked, dtype=torch.long, device=read.device))
    o, final = _kernels.chunk_gated_delta_rule(
        q.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx), g.index_select(0, idx),
        beta.index_select(0, idx), sub_cu, read_slots(state_pool, sub_read), use_qk_l2norm=True,
        chunk_size=chunk_size)
    out.index_copy_(0, idx, o.to(out.dtype))
    last = [write_host[cu[r + 1] - 1] for r in chunked]
    keep = [i for i, slot in enumerate(last) if slot >= 0]
    if keep:
        state_pool.index_copy_(0, torch.tensor([last[i] for i in keep], device=state_pool.device),
                               final[keep].to(state_pool.dtype))
    return out


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm(x) * weight * silu(gate) over the last dim: the GDN output norm (norm, then
    gate), with transformers' casts (float32 statistics and gate, weight in x's dtype)."""
    if dispatch.use_kernels(x) and x.dim() == 3:
        from ..kernels import gdn as _kernels

        return _kernels.gated_rms_norm(x, gate, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)
