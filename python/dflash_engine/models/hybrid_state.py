"""Recurrent state of a hybrid target's GDN layers, and which slots a step reads and writes.

    HybridState (the pool)                          StateMetadata (one step)
    per GDN layer l, per state slot s:              read[r]  : slot request r's state is read from
      conv[l][s]      [conv_dim, K-1]  act dtype               (< 0: fresh request, zeros)
      recurrent[l][s] [H_v, d_k, d_v]  state dtype  write[t] : slot that gets the state after row t
                                                               (< 0: not kept)

A slot is a whole state (conv window and recurrent state), so committing speculation is an
index update and never a copy. The contract:
- prefill / plain decode: read[r] = c[r], write = c[r] at the request's last row only;
- verification of B rows: read[r] = c[r], write[t] = the request's t-th state slot; after
  accepting rows [0, a], the engine sets c[r] = the slot of row a. Every later step reads
  through c[r]; reading a fixed slot after a multi-token acceptance is the stale-state bug.
- a freshly allocated slot is never read (read[r] = -1): slots are recycled.
Every state of a step is read before any is written, so write slots may include c[r].
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..ops.gdn import per_token_sequences
from .qwen3_5_config import HybridConfig


@dataclass
class HybridState:
    conv: list[Tensor]  # per GDN layer, in layer order: [num_slots, conv_dim, K-1], activation dtype
    recurrent: list[Tensor]  # per GDN layer: [num_slots, H_v, d_k, d_v], cfg.state_dtype (float32)

    @property
    def num_slots(self) -> int:
        return self.recurrent[0].shape[0] if self.recurrent else 0

    @staticmethod
    def shapes(cfg: HybridConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per slot and GDN layer: (conv window shape, recurrent state shape)."""
        return ((cfg.conv_dim, cfg.linear_conv_kernel_dim - 1),
                (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim))

    @classmethod
    def bytes_per_slot(cls, cfg: HybridConfig, dtype: torch.dtype) -> int:
        """One slot across every GDN layer (what one non-speculating sequence holds)."""
        conv, rec = cls.shapes(cfg)
        act = torch.empty((), dtype=dtype).element_size()
        state = torch.empty((), dtype=cfg.state_dtype).element_size()
        per_layer = conv[0] * conv[1] * act + rec[0] * rec[1] * rec[2] * state
        return per_layer * len(cfg.gdn_layer_ids)

    @classmethod
    def allocate(cls, cfg: HybridConfig, num_slots: int, dtype: torch.dtype, device="cpu") -> HybridState:
        conv, rec = cls.shapes(cfg)
        layers = cfg.gdn_layer_ids
        return cls(
            conv=[torch.zeros((num_slots, *conv), dtype=dtype, device=device) for _ in layers],
            recurrent=[torch.zeros((num_slots, *rec), dtype=cfg.state_dtype, device=device) for _ in layers],
        )


@dataclass
class StateMetadata:
    read: Tensor  # [R] int64
    write: Tensor  # [T] int64
    read_cpu: list[int] | None = None
    write_cpu: list[int] | None = None
    # Every request of the step is a decode/verify block (the recurrent form, whatever its
    # rows): set by the CUDA-graph runner, whose steps read nothing back to the host.
    all_per_token: bool = False

    def host_lists(self) -> tuple[list[int], list[int]]:
        if self.read_cpu is None or self.write_cpu is None:
            self.read_cpu, self.write_cpu = self.read.tolist(), self.write.tolist()
        return self.read_cpu, self.write_cpu

    def per_token(self, query_start_loc: Sequence[int]) -> list[bool]:
        """Per request: the per-token recurrence (True) or the chunked form; decided once
        per step (ops.gdn.per_token_sequences) and shared by every GDN layer."""
        if self.all_per_token:
            return [True] * (len(query_start_loc) - 1)
        cached = self.__dict__.get("_per_token")
        if cached is None or cached[0] != list(query_start_loc):
            cached = (list(query_start_loc), per_token_sequences(query_start_loc, self.host_lists()[1]))
            self.__dict__["_per_token"] = cached
        return cached[1]

    @classmethod
    def from_lists(cls, read: Sequence[int], write: Sequence[int], device="cpu") -> StateMetadata:
        return cls(read=torch.tensor(list(read), dtype=torch.int64, device=device),
                   write=torch.tensor(list(write), dtype=torch.int64, device=device),
                   read_cpu=[int(s) for s in read], write_cpu=[int(s) for s in write])

    @classmethod
    def final(cls, query_start_loc: Sequence[int], read: Sequence[int], slots: Sequence[int],
              device="cpu") -> StateMetadata:
        """Prefill / plain decode: request r keeps only its state after its last row, at slots[r]."""
        write = [-1] * query_start_loc[-1]
        for r, slot in enumerate(slots):
            if query_start_loc[r + 1] > query_start_loc[r]:
                write[query_start_loc[r + 1] - 1] = slot
        return cls.from_lists(read, write, device)
