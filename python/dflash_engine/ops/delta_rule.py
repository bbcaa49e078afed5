"""The gated delta rule (Gated DeltaNet's token mixer): torch reference, CPU and GPU.

Per value head, with a state S [d_k, d_v] and per-token log decay g_t <= 0, rate beta_t:

    S <- exp(g_t) * S;   u_t = beta_t * (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

Two forms of the same recurrence over packed variable-length sequences (rows of sequence r
are [cu[r], cu[r+1])):
- `chunk_gated_delta_rule`: chunks of C tokens solved in parallel (prefill); returns the
  final state of each sequence.
- `recurrent_gated_delta_rule`: one token at a time (decode, verification); reads each
  sequence's initial state from a slot of a state pool and stores the state after every
  row whose write slot is >= 0 (speculative rollback keeps one state per draft row).

q, k [T, H_k, d_k]; v [T, H_v, d_v]; g, beta [T, H_v]; H_v is a multiple of H_k and key
head h serves value heads [h*H_v/H_k, (h+1)*H_v/H_k). States are float32; outputs come
back in v's dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def host_list(x: Tensor | Sequence[int]) -> list[int]:
    return x.tolist() if isinstance(x, Tensor) else [int(i) for i in x]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def read_slots(pool: Tensor, slots: Tensor) -> Tensor:
    """pool[slots] (a copy), zeros where slot < 0: a slot without an initial state is never
    read, since slots are recycled and hold a previous owner's state."""
    out = pool.index_select(0, slots.clamp(min=0).long())
    return out.masked_fill_((slots < 0).view(-1, *([1] * (pool.dim() - 1))).to(out.device), 0)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """float32, key heads repeated to the value heads, q/k l2-normed where asked, q scaled."""
    groups = v.shape[1] // k.shape[1]
    q, k = q.float(), k.float()
    if use_qk_l2norm:  # before the repeat: the same numbers, fewer of them
        q, k = l2norm(q), l2norm(k)
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v.float(), g.float(), beta.float()


def _chunk_one(q, k, v, g, beta, state, chunk_size):
    """One sequence, head-major: q, k [H, L, d_k], v [H, L, d_v], g, beta [H, L], state
    [H, d_k, d_v] -> (o [H, L, d_v], final state).

    Within a chunk, with G_t = exp(cumulative g up to t) and S0 the state entering it,
    u_t = beta_t (v_t - G_t S0^T k_t - sum_{j<t} (G_t/G_j)(k_t.k_j) u_j): a unit lower
    triangular system (I + A) U = beta V - diag(beta G) K S0, solved once for both
    right-hand sides; then o_t = G_t S0^T q_t + sum_{j<=t} (G_t/G_j)(q_t.k_j) u_j and
    S_C = G_C S0 + sum_j (G_C/G_j) k_j u_j^T."""
    h, length = g.shape
    pad = (-length) % chunk_size
    if pad:  # g = beta = k = 0 on padding: the state passes through it unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n, c = (length + pad) // chunk_size, chunk_size
    q, k, v = (x.reshape(h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, n, c).cumsum(-1), beta.reshape(h, n, c)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # exp(g_i - g_j) for j <= i; masked before exp so no overflow on the upper triangle
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # diagonal unused: unitriangular
    rhs = torch.cat((v * beta[..., None], k_beta * g.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_new, w_state = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * g.exp()[..., None]
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(n):
        u = u_new[:, i] - w_state[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ u
        state = state * g[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(h, n * c, -1)[:, :length], state


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | Sequence[int],
    initial_state: Tensor | None = None, scale: float | None = None, use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunked form. initial_state [R, H_v, d_k, d_v] (None: zeros) -> (o [T, H_v, d_v],
    final_state [R, H_v, d_k, d_v] float32)."""
    cu = host_list(cu_seqlens)
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    h, d_k, d_v = vf.shape[1], k.shape[-1], vf.shape[-1]
    states = (torch.zeros(len(cu) - 1, h, d_k, d_v, device=v.device) if initial_state is None
              else initial_state.float().clone())
    out = torch.empty_like(vf)
    for r in range(len(cu) - 1):
        s, e = cu[r], cu[r + 1]
        if e == s:
            continue
        o, states[r] = _chunk_one(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), vf[s:e].transpose(0, 1),
                                  g[s:e].t(), beta[s:e].t(), states[r], chunk_size)
        out[s:e] = o.transpose(0, 1)
    return out.to(v.dtype), states


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | Sequence[int],
    state_pool: Tensor, read: Tensor, write: Tensor, scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """Per-token form over a state pool [S, H_v, d_k, d_v]: sequence r starts from
    state_pool[read[r]] (zeros where < 0); the state after row t goes to state_pool[write[t]]
    where write[t] >= 0. Every initial state is read before any state is written, so a
    sequence may overwrite the slot it read. Returns o [T, H_v, d_v].

    A pool of lower precision than float32 (a 16-bit `mamba_ssm_cache_dtype`): the state is
    rounded to the pool's dtype after every row, kept or not, so the next row continues from
    exactly what a step that stopped here would store and the next step read: a token's
    state does not depend on how many rows its step verified (spec-on == spec-off).

    The sequences run side by side, padded to the longest with g = beta = 0 (a padded step
    leaves the state bit-identical); each step is elementwise products and sums over d_k,
    so a row's numbers do not depend on the other sequences of the batch."""
    cu = host_list(cu_seqlens)
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    lens = [e - s for s, e in zip(cu, cu[1:])]
    r_count, longest = len(lens), max(lens, default=0)
    state = read_slots(state_pool, read).float()  # [R, H, d_k, d_v]
    out = torch.empty_like(vf)
    if longest == 0:
        return out.to(v.dtype)
    # [R, L, ...] views of the rows: row index per (sequence, step), -1 on padding
    rows = torch.full((r_count, longest), -1, dtype=torch.long)
    for r, (s, n) in enumerate(zip(cu, lens)):
        rows[r, :n] = torch.arange(s, s + n)
    rows = rows.to(v.device)
    valid = rows >= 0
    idx = rows.clamp(min=0)
    qs, ks, vs = q[idx], k[idx], vf[idx]
    gs, bs = g[idx].masked_fill(~valid[..., None], 0.0), beta[idx].masked_fill(~valid[..., None], 0.0)
    write = write.to(v.device).long()
    for t in range(longest):
        state = state * gs[:, t].exp()[..., None, None]
        kv_mem = (state * ks[:, t, :, :, None]).sum(-2)
        delta = (vs[:, t] - kv_mem) * bs[:, t, :, None]
        state = state + ks[:, t, :, :, None] * delta[:, :, None, :]
        o = (state * qs[:, t, :, :, None]).sum(-2)
        live = valid[:, t]
        out[rows[live, t]] = o[live]
        slots = torch.where(live, write[idx[:, t]], -1)
        keep = slots >= 0
        if bool(keep.any()):
            state_pool.index_copy_(0, slots[keep], state[keep].to(state_pool.dtype))
        if state_pool.dtype != torch.float32:
            state = state.to(state_pool.dtype).float()
    return out.to(v.dtype)


def recurrent_states(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | Sequence[int],
    initial_state: Tensor | None = None, scale: float | None = None, use_qk_l2norm: bool = False,
) -> tuple[Tensor, Tensor]:
    """The per-token form without a pool: initial_state [R, H_v, d_k, d_v] (None: zeros) ->
    (o [T, H_v, d_v], the state after every row [T, H_v, d_k, d_v] float32)."""
    r_count, t_count = len(host_list(cu_seqlens)) - 1, q.shape[0]
    h, d_k, d_v = v.shape[1], k.shape[-1], v.shape[-1]
    pool = torch.zeros(r_count + t_count, h, d_k, d_v, device=v.device)
    if initial_state is not None:
        pool[:r_count] = initial_state.float()
    read = torch.arange(r_count, device=v.device)
    write = torch.arange(r_count, r_count + t_count, device=v.device)  # row t keeps its state at r_count + t
    out = recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens, pool, read, write, scale, use_qk_l2norm)
    return out, pool[r_count:]
