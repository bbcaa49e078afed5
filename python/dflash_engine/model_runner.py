"""Runs one step plan: draft pass, target verify/prefill pass, sampling, acceptance, and
the draft-context write (DFLASH.md, "One speculative step").

Everything positional (rows, slots, pages, positions) comes from the Rust plan. The step
crosses to the core once each way: the plan in, (accepted, sampled) out. The draft context
is written for every target row, before acceptance is known: rows past the accepted
prefix land at positions >= the new committed length, which the next draft block
overwrites (as scratch) before any draft pass reads them (GPU.md, "One step, one graph").
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import numpy as np
import torch

from . import _core
from .config import EngineConfig, synthetic_rates
from .kv_cache import KVCache
from .models import load_draft, load_target
from .ops.attention import AttentionMetadata
from .decode_graph import DecodeGraphRunner
from .ops.dispatch import use_kernels
from .sampler import SamplingTensors, accept, sample, synthetic_accept

logger = logging.getLogger(__name__)

_CPU_KV_BYTES_DEFAULT = 1 << 30


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return dev


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_path: Path, max_model_len: int):
        self.device = resolve_device(cfg.device)
        self.target = load_target(model_path, cfg.dtype, self.device, batch_invariant=cfg.batch_invariant)
        self.model_config = self.target.config
        self.dtype = self.target.model.embed_tokens.weight.dtype
        self.draft = None
        self.num_speculative_tokens = 0
        self.tap_layers: list[int] | None = None
        self.mask_token_id = 0
        spec = cfg.speculative_config
        if spec is not None:
            self.draft = load_draft(spec.model, self.model_config, cfg.dtype, self.device,
                                    batch_invariant=cfg.batch_invariant)
            dcfg = self.draft.config
            n = spec.num_speculative_tokens if spec.num_speculative_tokens is not None else dcfg.block_size - 1
            if n >= dcfg.block_size:
                raise ValueError(
                    f"num_speculative_tokens ({n}) must be < the draft's block_size ({dcfg.block_size})"
                )
            self.num_speculative_tokens = n
            self.tap_layers = list(dcfg.target_layer_ids)
            self.mask_token_id = dcfg.mask_token_id
        # Benchmark-only synthetic acceptance (never on by default; labelled wherever it shows).
        self.synthetic_rates: torch.Tensor | None = None
        if spec is not None and spec.synthetic:
            rates = synthetic_rates(self.num_speculative_tokens, spec.synthetic_acceptance_length,
                                    spec.synthetic_acceptance_rates)
            self.synthetic_rates = torch.tensor(rates, dtype=torch.float64, device=self.device)
            expected = sum(float(np.prod(rates[:i])) for i in range(len(rates) + 1))
            logger.warning("SYNTHETIC acceptance (benchmark only): per-position rates %s, expected "
                           "acceptance length %.2f; outputs are NOT the target's", [round(r, 4) for r in rates],
                           expected)
        self.page_size = cfg.block_size  # vLLM's --block-size: tokens per KV page
        self.bytes_per_page = KVCache.bytes_per_page(
            self.model_config, self.draft.config if self.draft else None, self.page_size, self.dtype
        )
        self.num_pages = self._num_pages(cfg, max_model_len)
        self.kv = KVCache.allocate(
            self.model_config, self.draft.config if self.draft else None,
            self.num_pages, self.page_size, self.dtype, self.device,
        )
        # The GPU's pure-decode step: fixed shapes per batch bucket, one CUDA graph each.
        self.decode_graphs: DecodeGraphRunner | None = None
        if use_kernels(self.kv.target[0][0]):
            self.decode_graphs = DecodeGraphRunner(self, cfg.max_num_seqs, max_model_len, cfg.enforce_eager)
            self.decode_graphs.capture()

    def _num_pages(self, cfg: EngineConfig, max_model_len: int) -> int:
        """Pages in the pool, null page included: the only capacity number."""
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override + 1
        if self.device.type == "cuda":
            # Memory cached by torch for engines already dropped in this process counts as free.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations and logits of the largest step.
            reserve = (1 << 30) + 4 * self.model_config.vocab_size * 4096 * 2
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - reserve
            if budget < 2 * self.bytes_per_page:
                raise ValueError("not enough GPU memory left for the KV cache")
            return budget // self.bytes_per_page
        # CPU: a byte budget, capped by what max_num_seqs full-length requests can use.
        budget = int(float(os.environ.get("DFLASH_CPU_KV_CACHE_GB", "0") or 0) * (1 << 30)) or _CPU_KV_BYTES_DEFAULT
        per_seq = _core.pages_per_seq(max_model_len, self.num_speculative_tokens, self.page_size)
        return max(2, min(budget // self.bytes_per_page, cfg.max_num_seqs * per_seq + 1))

    def _t(self, a: np.ndarray) -> torch.Tensor:
        # Plan arrays are read-only numpy: copy rather than alias them.
        return torch.tensor(a, device=self.device)

    def _meta(self, slots, qsl, seq_lens, tables, causal: bool) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._t(slots), query_start_loc=self._t(qsl), seq_lens=self._t(seq_lens),
            page_tables=self._t(tables), causal=causal, max_query_len=int(np.diff(qsl).max(initial=0)),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
        )

    def execute(self, plan, st: dict[str, np.ndarray], all_greedy: bool) -> tuple[np.ndarray, np.ndarray]:
        """Returns (accepted drafts per plan entry, sampled token per plan sample row).
        `st`: per sample row, the owning request's sampling parameters (numpy)."""
        if self.decode_graphs is not None and plan.num_decode == len(plan):
            return self.decode_graphs.run(plan, st, all_greedy)
        return self._execute_eager(plan, st, all_greedy)

    def _sample(self, logits: torch.Tensor, st: dict[str, np.ndarray], all_greedy: bool) -> torch.Tensor:
        t = SamplingTensors.from_numpy(st, self.device)
        if not use_kernels(logits):
            return sample(logits, t)
        from .kernels import sampling

        return sampling.sample(logits, t.greedy, t.temperature, t.top_k, t.top_p, t.min_p, t.seed, t.position,
                               all_greedy=all_greedy)

    @torch.inference_mode()
    def _execute_eager(self, plan, st: dict[str, np.ndarray], all_greedy: bool) -> tuple[np.ndarray, np.ndarray]:
        input_ids = self._t(plan.input_ids)
        draft_tokens = None
        n_dec = plan.num_decode
        if self.draft is not None and n_dec:
            meta = self._meta(plan.draft_slot_mapping, plan.draft_query_start_loc, plan.draft_seq_lens,
                              plan.draft_page_tables, causal=False)
            h = self.draft(self.target.embed(self._t(plan.draft_input_ids)), self._t(plan.draft_positions), meta, self.kv)
            verify_rows = self._t(plan.verify_target_rows)  # the draft rows 1..B-1 of each block
            draft_tokens = self.target.compute_logits(h[verify_rows]).argmax(-1)
            input_ids = input_ids.index_put((verify_rows,), draft_tokens)

        positions = self._t(plan.positions)
        slots = self._t(plan.slot_mapping)
        meta = self._meta(plan.slot_mapping, plan.query_start_loc, plan.seq_lens, plan.page_tables, causal=True)
        hidden, taps = self.target(input_ids, positions, meta, self.kv, self.tap_layers)
        if self.draft is not None:
            # Every row's taps become draft context now, at its own slot (see module doc).
            self.draft.write_context(taps, positions, slots, self.kv)
        logits = self.target.compute_logits(hidden[self._t(plan.sample_rows)])
        sampled = self._sample(logits, st, all_greedy)

        accepted = torch.zeros(len(plan), dtype=torch.int64, device=self.device)
        if draft_tokens is not None:
            b = plan.block_rows
            rows = self._t(plan.sample_start[:n_dec])[:, None] + torch.arange(b, device=self.device)
            drafts = draft_tokens.view(n_dec, b - 1)
            if self.synthetic_rates is None:
                accepted[:n_dec] = accept(drafts, sampled[rows])
            else:
                bonus_rows = plan.query_start_loc[:n_dec]
                seeds = self._t(st["seed"][plan.sample_start[:n_dec]])
                accepted[:n_dec], sampled[rows] = synthetic_accept(
                    drafts, sampled[rows], seeds, self._t(plan.positions[bonus_rows]), self.synthetic_rates)
        out = torch.cat([accepted, sampled]).cpu().numpy()  # one device-to-host copy
        return out[:len(plan)], out[len(plan):]
