"""The decode/verify step, written once (DFlash's "one speculative step").

    draft pass (non-causal, D rows per decoding request) -> proposals d_1..d_K
    target pass over every row ([bonus, d_1..d_K] per decoding request, prefill chunks)
    draft-context write of every target row's taps, at the row's own slot
    logits of the sampled rows -> sampling (keyed by seed and position)
    acceptance per decoding request (longest prefix of drafts the target agrees with)

Eager steps call `run_step` on tensors built from the plan (`StepInputs.from_plan`); the
CUDA-graph runner (graph_runner.py) captures the same function over static padded buffers.
Everything positional (rows, slots, pages, positions) comes from the Rust plan.

The draft context is written for every target row before acceptance is known: rows past
the accepted prefix land at positions >= the new committed length, which the next draft
block overwrites (as scratch) before any draft pass reads them.

Decoding requests lead the plan and each samples its B verify rows, so the sampled rows of
decoding request i are i*B .. i*B+B-1 and its bonus row is target row i*B, in both paths.

A hybrid target (GDN layers) also reads and writes recurrent-state slots: `state_meta` holds
the plan's `state_read` / `state_write` (the core chose every slot: each request reads its
committed slot, verify rows and a chunk's last row keep their states in other slots, and the
commit moves the committed slot; models/hybrid_state.py), and the slots are views into the
KV pool (`kv.state`, worker/state_pool.py). Dense targets have neither.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..models.hybrid_state import StateMetadata
from ..ops import dispatch
from ..ops.attention import AttentionMetadata
from ..ops.sampling import SamplingTensors


@dataclass
class StepModels:
    """What a step runs on: the models, the KV cache they read and write, and the
    benchmark-only synthetic acceptance rates (None: real acceptance)."""

    target: torch.nn.Module
    draft: torch.nn.Module | None
    kv: object  # KVCache (swapped for a 2-page cache while profiling)
    tap_layers: list[int] | None
    synthetic_rates: Tensor | None = None


@dataclass
class DraftInputs:
    input_ids: Tensor  # [n*D]: [bonus, MASK x (D-1)] per block
    positions: Tensor  # [n*D]
    meta: AttentionMetadata  # non-causal; page tables = the decoding requests' own
    proposal_rows: Tensor  # [n*(B-1)]: draft rows whose outputs are the proposals
    verify_rows: Tensor  # [n*(B-1)]: target rows the proposals go into


@dataclass
class StepInputs:
    input_ids: Tensor  # [T] target rows
    positions: Tensor  # [T]
    meta: AttentionMetadata  # causal
    sample_rows: Tensor | None  # rows whose logits are sampled (None: every row)
    sampling: SamplingTensors  # per sampled row
    num_decode: int  # decoding requests (they lead the plan)
    block_rows: int  # B
    draft: DraftInputs | None  # None: no draft pass (no drafts this step)
    state_meta: StateMetadata | None = None  # hybrid targets: the state slots each row reads / keeps

    @classmethod
    def from_plan(cls, plan, st: Mapping[str, np.ndarray], device: torch.device) -> StepInputs:
        """The eager step's inputs: the plan's arrays as they are (variable shapes)."""
        def t(a: np.ndarray) -> Tensor:  # plan arrays are read-only numpy: copy, never alias
            return torch.tensor(a, device=device)

        qsl, seq_lens = plan.query_start_loc, plan.seq_lens
        meta = AttentionMetadata(
            slot_mapping=t(plan.slot_mapping), query_start_loc=t(qsl), seq_lens=t(seq_lens),
            page_tables=t(plan.page_tables), causal=True, max_query_len=int(np.diff(qsl).max(initial=0)),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist())
        draft = None
        if plan.draft_rows and plan.num_decode:
            dq, ds = plan.draft_query_start_loc, plan.draft_seq_lens
            draft = DraftInputs(
                input_ids=t(plan.draft_input_ids), positions=t(plan.draft_positions),
                meta=AttentionMetadata(
                    slot_mapping=t(plan.draft_slot_mapping), query_start_loc=t(dq), seq_lens=t(ds),
                    page_tables=t(plan.draft_page_tables), causal=False, max_query_len=plan.draft_rows,
                    query_start_loc_cpu=dq.tolist(), seq_lens_cpu=ds.tolist()),
                proposal_rows=t(plan.draft_proposal_rows), verify_rows=t(plan.verify_target_rows))
        state_meta = None
        if len(plan.state_read):  # a hybrid target's plan
            state_meta = StateMetadata(read=t(plan.state_read), write=t(plan.state_write),
                                       read_cpu=plan.state_read.tolist(), write_cpu=plan.state_write.tolist())
        return cls(input_ids=t(plan.input_ids), positions=t(plan.positions), meta=meta,
                   sample_rows=t(plan.sample_rows), sampling=SamplingTensors.from_numpy(st, device),
                   num_decode=plan.num_decode, block_rows=plan.block_rows, draft=draft, state_meta=state_meta)


def draft_pass(m: StepModels, x: StepInputs) -> tuple[Tensor, Tensor]:
    """The draft's blocks -> (the verify pass's input ids with the proposals in place,
    proposals [num_decode * K])."""
    d = x.draft
    h = m.draft(m.target.embed(d.input_ids), d.positions, d.meta, m.kv)
    drafts = m.target.propose(h[d.proposal_rows])
    return x.input_ids.index_put((d.verify_rows,), drafts), drafts


def verify_pass(m: StepModels, x: StepInputs, ids: Tensor, keep_context=None) -> Tensor:
    """The target over every row, the draft-context write of every row's taps (module
    doc) -> logits of the sampled rows (float32, or bf16 on the GPU's default path:
    dispatch.logits). `keep_context(taps, positions, slots)`: instead of writing, hand the
    rows over to be written later (deferred_context.py; a step without a draft pass only)."""
    state = {} if x.state_meta is None else {"state": m.kv.state, "state_meta": x.state_meta}
    hidden, taps = m.target(ids, x.positions, x.meta, m.kv, m.tap_layers, **state)
    if m.draft is not None and keep_context is not None and x.draft is None:
        keep_context(taps, x.positions, x.meta.slot_mapping)
    elif m.draft is not None:
        m.draft.write_context(taps, x.positions, x.meta.slot_mapping, m.kv)
    if x.sample_rows is not None:
        hidden = hidden[x.sample_rows]
    return m.target.compute_logits(hidden)


def run_step(m: StepModels, x: StepInputs, all_greedy: bool, keep_context=None) -> tuple[Tensor | None, Tensor]:
    """-> (accepted drafts per decoding request [num_decode] or None without drafts,
    sampled token per sampled row). Capturable: no host syncs, static shapes in, static out
    (`keep_context`: verify_pass; eager steps only)."""
    ids, drafts = draft_pass(m, x) if x.draft is not None else (x.input_ids, None)
    sampled = dispatch.sample(verify_pass(m, x, ids, keep_context), x.sampling, all_greedy)
    if drafts is None:
        return None, sampled
    n, b = x.num_decode, x.block_rows
    drafts, blocks = drafts.view(n, b - 1), sampled[:n * b].view(n, b)
    if m.synthetic_rates is None:
        return dispatch.accept(drafts, blocks), sampled
    # Benchmark-only: accepted counts from a seeded RNG; the accepted drafts are committed.
    first = slice(0, n * b, b)  # each decoding request's bonus row
    accepted, tokens = dispatch.synthetic_accept(drafts, blocks, x.sampling.seed[first], x.positions[first],
                                                 m.synthetic_rates)
    return accepted, torch.cat([tokens.reshape(-1), sampled[n * b:]])
