"""Sizing the KV pool: the profile step, vLLM's budget rule, and the report of every fact
behind the number of pages (logged at startup, printed by `serve`)."""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from .. import _core

GiB = float(1 << 30)


def kv_budget(total: int, in_use: int, peak_activation: int, utilization: float, graph_reserve: int = 0) -> int:
    """Device bytes left for the KV pool, vLLM's rule (may be negative):

        total * utilization - in_use - peak_activation - graph_reserve

    `in_use`: device memory in use once the weights are loaded and the profile step has run
    (weights, CUDA context, library workspaces, other processes); `peak_activation`: the
    allocator's growth during the profile step (the largest step's activations, freed
    between steps but needed at every step); `graph_reserve`: what CUDA-graph capture will
    take after the pool exists."""
    return int(total * utilization) - in_use - peak_activation - graph_reserve


def size_pool(total: int, in_use: int, peak_activation: int, utilization: float, bytes_per_page: int,
              graph_reserve: int = 0) -> int:
    """Pages (null page included) that fit in `kv_budget`; a negative budget is 0 pages."""
    return max(0, kv_budget(total, in_use, peak_activation, utilization, graph_reserve)) // bytes_per_page


def cpu_pool_pages(budget_bytes: int, bytes_per_page: int, max_num_seqs: int, pages_per_seq: int) -> int:
    """CPU: pages (null page included) in a byte budget (`DFLASH_CPU_KV_CACHE_GB`), capped by
    what `max_num_seqs` full-length requests can ever use (`pages_per_seq`: KV pages and, for a
    hybrid target, state slots of one)."""
    return min(budget_bytes // bytes_per_page, max_num_seqs * pages_per_seq + 1)


@dataclass
class MemoryReport:
    """Every sizing fact of the KV pool, in one place (logged at startup, printed by `serve`).
    Byte fields are None where they were not measured (CPU: no profile step)."""

    device: str
    num_pages: int  # in the pool, the null page included
    page_size: int  # tokens per page
    bytes_per_page: int  # target + draft K/V of one page
    max_model_len: int
    reserve_rows: int  # rows a decode step writes from `committed`: max(B, D)
    max_num_seqs: int
    source: str  # what decided num_pages (a flag, or the CPU byte budget)
    total_bytes: int | None = None  # device memory
    utilization: float | None = None  # --gpu-memory-utilization
    weights_bytes: int | None = None  # allocated by torch after loading target + draft
    in_use_bytes: int | None = None  # device memory in use after the profile step (weights included)
    peak_activation_bytes: int | None = None  # the profile step's peak growth
    graph_reserve_bytes: int = 0  # budgeted for CUDA graphs before capture
    graph_bytes: int = 0  # what capture took (measured after it)
    profile_tokens: int = 0  # the profile step: target rows ...
    profile_sample_rows: int = 0  # ... and sampled rows
    # A hybrid target: state slots (pages of the same pool, worker/state_pool.py) one decoding
    # request holds, and the bytes of one slot's state (unpadded; it lives inside one page).
    state_slots_per_seq: int = 0
    state_bytes_per_slot: int = 0

    @property
    def pages_per_seq(self) -> int:
        """Pages one request of max_model_len holds at most (the core's admission bound)."""
        return _core.pages_per_seq(self.max_model_len, self.reserve_rows, self.page_size)

    @property
    def seq_pages(self) -> int:
        """Pages of the pool one full-length request holds: KV pages and state slots."""
        return self.pages_per_seq + self.state_slots_per_seq

    @property
    def state_bound(self) -> bool:
        """Whether state slots, not KV, cap the concurrency (they are most of a request's pages)."""
        return self.state_slots_per_seq > self.pages_per_seq

    @property
    def usable_pages(self) -> int:
        return max(0, self.num_pages - 1)

    @property
    def num_tokens(self) -> int:
        return self.usable_pages * self.page_size

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def max_concurrency(self) -> float:
        """Full-length requests (max_model_len) the pool holds at once."""
        return self.usable_pages / self.seq_pages

    def check_holds_one_request(self) -> None:
        """Startup refuses a pool that cannot hold one request of max_model_len: such a request
        would be admitted by no scheduler, ever."""
        need = self.seq_pages
        if self.usable_pages >= need:
            return
        override = f"set --num-gpu-blocks-override to at least {need}"
        if self.source.startswith("--num-gpu-blocks-override"):
            fix = f"{override} or lower --max-model-len"
        elif self.device == "cpu":
            fix = f"raise DFLASH_CPU_KV_CACHE_GB, lower --max-model-len, or {override}"
        else:
            fix = f"raise --gpu-memory-utilization (now {self.utilization}), lower --max-model-len, or {override}"
        budget = self.budget_line()
        raise ValueError(
            f"the KV cache holds {self.usable_pages} pages ({self.num_tokens} tokens; {self.source}) but one "
            f"request of --max-model-len {self.max_model_len} needs {need} pages of {self.page_size} tokens "
            f"(verify block{' and state slots' if self.state_slots_per_seq else ''} included): {fix}"
            + (f". {budget}" if budget else ""))

    @property
    def budget_bytes(self) -> int | None:
        """What `size_pool` gave the KV cache (None: not measured, CPU)."""
        if self.total_bytes is None:
            return None
        return kv_budget(self.total_bytes, self.in_use_bytes, self.peak_activation_bytes, self.utilization,
                         self.graph_reserve_bytes)

    def budget_line(self) -> str:
        """CUDA: the budget arithmetic, with the profile step's numbers ("" on CPU)."""
        if self.total_bytes is None:
            return ""
        took = f"; CUDA graphs took {_size(self.graph_bytes)}" if self.graph_bytes else ""
        return (f"memory: {_size(self.total_bytes)} x {self.utilization:.2f} - in use {_size(self.in_use_bytes)} "
                f"(weights {_size(self.weights_bytes)}) - peak activation {_size(self.peak_activation_bytes)} "
                f"(profile step: {self.profile_tokens} tokens, {self.profile_sample_rows} sampled rows) "
                f"- CUDA graph reserve {_size(self.graph_reserve_bytes)} = KV budget {_size(self.budget_bytes)}"
                + took)

    def lines(self) -> list[str]:
        """The startup report: the pool, the memory budget behind it (CUDA), the concurrency."""
        lines = [
            f"KV pool: {self.usable_pages} pages x {self.page_size} tokens = {self.num_tokens} tokens, "
            f"{_size(self.kv_bytes)} ({_size(self.bytes_per_page)}/page, target + draft K/V); sized by {self.source}",
            self.budget_line(),
            f"max concurrency at --max-model-len {self.max_model_len}: {self.max_concurrency:.2f} requests "
            f"({self.seq_pages} pages each; --max-num-seqs {self.max_num_seqs})",
        ]
        if self.state_slots_per_seq:
            lines[1:1] = [
                f"state slots: pages of the same pool, {self.usable_pages} in all; one slot holds "
                f"{_size(self.state_bytes_per_slot)} of recurrent state (every GDN layer) in a "
                f"{_size(self.bytes_per_page)} page; a decoding request holds {self.state_slots_per_seq} slots "
                f"({_size(self.state_slots_per_seq * self.bytes_per_page)}) and {self.pages_per_seq} KV pages"]
            if self.state_bound:
                lines.append(f"concurrency is capped by state slots, not KV: {self.state_slots_per_seq} of the "
                             f"{self.seq_pages} pages a request holds are state slots (fewer speculative tokens "
                             "need fewer)")
        return [line for line in lines if line]


def _size(n: int | None) -> str:
    n = n or 0
    if abs(n) >= 1 << 30:
        return f"{n / GiB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if abs(n) >= 1 << 20 else f"{n / 1024:.1f} KiB"


# Budgeted for CUDA graphs on top of the measured decode step (module loads, workspaces).
GRAPH_SLACK_BYTES = 256 << 20
# And per graph captured at startup (its own device memory: kernel parameters, the executable
# graph). Run 36 (H100, SmolLM2 + draft): 63 mixed graphs took 144 MiB beside 7 decode graphs
# with the draft (2.3 MiB each), 68 MiB without it (1.1 MiB each).
GRAPH_BYTES_EACH = 4 << 20


def peak_bytes(device: torch.device, fn) -> int | None:
    """Run `fn`; on CUDA return how far the allocator's reserved memory (what it took from
    the device) rose above its level before (CPU: no allocator statistics, None)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_reserved(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_reserved(device) - base


def size_kv_pool(rc, bytes_per_page: int, profile, graphs: bool, state_bytes_per_slot: int = 0,
                 num_graphs: int = 0) -> MemoryReport:
    """Pages in the pool, null page included, and how they were decided.

    CUDA: `profile()` runs the largest steps and returns their peak growth (eager step,
    decode-graph step or None), then vLLM's budget (`size_pool`). CPU: a byte budget.
    `num_gpu_blocks_override` wins over both (the profile still runs on CUDA: it also proves
    at startup that the largest step fits). `rc`: the RuntimeConfig. A hybrid target's state
    slots are pages of the same pool (`state_bytes_per_slot`: what one holds, for the report)."""
    slots = _core.state_slots_per_seq(rc.num_speculative_tokens) if getattr(rc, "hybrid", False) else 0
    report = MemoryReport(device=rc.device.type, num_pages=0, page_size=rc.page_size, bytes_per_page=bytes_per_page,
                          max_model_len=rc.max_model_len, reserve_rows=rc.reserve_rows, max_num_seqs=rc.max_num_seqs,
                          source="", state_slots_per_seq=slots, state_bytes_per_slot=state_bytes_per_slot)
    if rc.device.type == "cuda":
        # Memory cached by torch for engines already dropped in this process counts as free.
        gc.collect()
        torch.cuda.empty_cache()
        report.weights_bytes = torch.cuda.memory_allocated(rc.device)
        step_peak, decode_peak = profile(report)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(rc.device)
        report.total_bytes, report.in_use_bytes = total, total - free
        report.utilization = rc.gpu_memory_utilization
        report.peak_activation_bytes = max(step_peak, decode_peak or 0)
        # The graphs' private pool holds about one decode step at the largest bucket (the
        # buckets share it, largest captured first); plus slack for what capture loads
        # (cuBLAS workspaces, Triton modules) and each graph's own memory (`num_graphs` at
        # startup). Checked against the real number after capture.
        report.graph_reserve_bytes = ((decode_peak or 0) + GRAPH_SLACK_BYTES + num_graphs * GRAPH_BYTES_EACH
                                      if graphs else 0)
        report.num_pages = size_pool(total, report.in_use_bytes, report.peak_activation_bytes,
                                     rc.gpu_memory_utilization, bytes_per_page, report.graph_reserve_bytes)
        report.source = f"--gpu-memory-utilization {rc.gpu_memory_utilization}"
    else:
        budget = rc.cpu_kv_cache_bytes
        report.num_pages = cpu_pool_pages(budget, bytes_per_page, rc.max_num_seqs, report.seq_pages)
        report.source = rc.cpu_kv_cache_source
        if report.num_pages < budget // bytes_per_page:
            report.source = f"--max-num-seqs {rc.max_num_seqs} full-length requests (within {report.source})"
    if rc.num_gpu_blocks_override is not None:
        report.num_pages = rc.num_gpu_blocks_override + 1
        report.source = f"--num-gpu-blocks-override {rc.num_gpu_blocks_override}"
    return report
