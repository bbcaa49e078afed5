"""What `serve` prints before it listens: computed where the engine lives (the engine
process, or the server's own process with --disable-frontend-multiprocessing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import LLMEngine


def _prefix_caching(engine: LLMEngine) -> str:
    """on / off, as the engine runs it (a hybrid target turns a requested cache off)."""
    if engine.runtime_config.enable_prefix_caching:
        return "on"
    return "off (not supported for hybrid targets)" if engine.config.enable_prefix_caching else "off"


def startup_report(engine: LLMEngine) -> list[str]:
    """What `serve` prints before it listens: the model and speculation, the KV pool (pages x
    tokens, GiB, what sized it), the memory budget behind it (CUDA: the profile step), the
    full-length concurrency it allows (worker/memory.py), and the decode graphs."""
    spec = engine.config.speculative_config
    lines = [f"model: {engine.model_path}  max_model_len: {engine.max_model_len}  speculative: "
             + (f"dflash draft {spec.model}, {engine.num_speculative_tokens} tokens" if spec else "off")
             + f"  prefix caching: {_prefix_caching(engine)}"]
    lines += engine.runner.memory.lines()
    runners = engine.runner.graphs  # one decode-graph runner per verify block B; none on CPU
    if runners and all(g.enforce_eager for g in runners.values()):
        lines.append("decode step: eager (--enforce-eager)")
    elif runners:
        num_graphs = sum(len(g.graphs) for g in runners.values())
        seconds = sum(g.capture_seconds for g in runners.values())
        buckets = {b: g.capture_buckets for b, g in runners.items()}
        mixed = next(iter(runners.values())).token_buckets
        lines.append(f"decode step: {num_graphs} CUDA graphs (batch buckets per verify block B: {buckets}; mixed "
                     f"steps: prefill-token buckets {mixed or 'none, eager'}) captured in {seconds:.1f} s, "
                     f"{engine.runner.memory.graph_bytes / 2**20:.0f} MiB")
        lines.append(_few_row_gemms(engine))
    return lines


def _few_row_gemms(engine: LLMEngine) -> str:
    """Which kernel the step's few-row GEMMs run (ops/gemm_tuning.py's startup timing)."""
    if not engine.runtime_config.tune_gemms:
        return "few-row GEMMs: cuBLAS (--tune-gemms times the skinny Triton GEMM against it)"
    picks = engine.runner.gemm_picks
    skinny = {f"{k.n}x{k.k}@{k.m}" for k, cfg in picks.items() if cfg is not None}
    return (f"few-row GEMMs: the skinny Triton GEMM for {len(skinny)} of {len(picks)} (N x K @ M) shapes, "
            f"cuBLAS for the rest (timed at startup)" + (f": {', '.join(sorted(skinny))}" if skinny else ""))
