"""Engine and speculative-decoding configuration (names follow vLLM)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# How tensor-parallel ranks start (EngineConfig.distributed_executor_backend).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "external_launcher")
# A hybrid target's recurrent-state dtypes (EngineConfig.mamba_ssm_cache_dtype).
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "rejection_sample_method",
              "synthetic_acceptance_length", "synthetic_acceptance_rates", "num_speculative_tokens_schedule",
              "draft_length", "draft_vocab_size"}


def _parse_draft_length(value: Any, k: int | None, schedule: Any) -> str | int:
    """"adaptive" (each step's K chosen from live acceptance and measured step cost, up to
    num_speculative_tokens), "fixed" (always num_speculative_tokens), or an int K (fixed at K).
    Unset: adaptive, unless num_speculative_tokens or a schedule is given (then what they say,
    as in vLLM)."""
    if value is None:
        return "fixed" if k is not None or schedule else "adaptive"
    if isinstance(value, bool) or not (value in ("adaptive", "fixed") or (isinstance(value, int) and value >= 0)):
        raise ValueError(f"speculative_config.draft_length must be 'adaptive', 'fixed' or a non-negative integer, "
                         f"got {value!r}")
    if isinstance(value, int) and k is not None and value != k:
        raise ValueError(f"speculative_config.draft_length ({value}) and num_speculative_tokens ({k}) disagree")
    if value == "adaptive" and schedule:
        raise ValueError("speculative_config: draft_length 'adaptive' and num_speculative_tokens_schedule are "
                         "two draft-length policies; give one")
    return value


def _parse_schedule(value: Any) -> list[tuple[int, int]] | None:
    if value is None:
        return None
    ok = isinstance(value, list) and value and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                            for x in p) for p in value)
    pairs = [(int(a), int(b)) for a, b in value] if ok else []
    if not ok or any(a >= b for (a, _), (b, _) in zip(pairs, pairs[1:])):
        raise ValueError("speculative_config.num_speculative_tokens_schedule must be a list of "
                         "[max_decoding_requests, num_speculative_tokens] pairs of positive integers, "
                         f"ascending in max_decoding_requests; got {value!r}")
    return pairs


def synthetic_rates(k: int, length: float | None, rates: list[float] | None) -> list[float]:
    """Per-draft-position acceptance probabilities (each given all earlier ones accepted).
    From a mean acceptance length L: the constant p with 1 + p + ... + p^k = L."""
    if rates is not None:
        if len(rates) < k:
            raise ValueError(f"synthetic_acceptance_rates has {len(rates)} entries, need num_speculative_tokens={k}")
        return [float(r) for r in rates[:k]]
    assert length is not None
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length must be in [1, num_speculative_tokens + 1 = {k + 1}], "
                         f"got {length}")
    lo, hi = 0.0, 1.0
    for _ in range(100):  # bisection: the sum grows with p
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < length else (lo, mid)
    return [(lo + hi) / 2] * k


def auto_speculative_config(model: str | None, device: str) -> tuple[dict[str, Any] | None, str]:
    """What speculative_config="auto" (the default) means, and why: DFlash with the shipped
    draft when the target is the embedded SmolLM2-135M-Instruct (on a GPU or the CPU); off
    for any other model (no draft is known for it)."""
    from .model_path import is_default_model

    if not is_default_model(model):
        return None, "no draft is known for this model (pass --speculative-config with one)"
    return {"method": "dflash"}, "the shipped SmolLM2 draft"


@dataclass
class SpeculativeConfig:
    model: str
    method: str = "dflash"
    num_speculative_tokens: int | None = None  # default: the draft's block_size - 1
    # Benchmark-only (random weights accept nothing): "synthetic" draws each step's accepted
    # count from a seeded RNG instead of comparing drafts with the target (vLLM's keys).
    rejection_sample_method: str = "strict"
    synthetic_acceptance_length: float | None = None
    synthetic_acceptance_rates: list[float] | None = None
    # Shorter draft blocks as the batch grows (verify work is batch x block rows):
    # [[max_decoding_requests, k], ...]; off (always num_speculative_tokens) unless given.
    num_speculative_tokens_schedule: list[tuple[int, int]] | None = None
    # "adaptive": each step verifies the K (0 included) that maximises expected committed
    # tokens per second (live acceptance x measured step cost); "fixed": num_speculative_tokens.
    draft_length: str = "adaptive"
    # Proposals among the target's N most frequent tokens only (the draft's draft_vocab.json
    # ranking; models/draft_vocab.py): a smaller logits GEMM in every draft pass, still lossless.
    draft_vocab_size: int | None = None

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None, target_model: str | None = None
              ) -> SpeculativeConfig | None:
        """A dict / JSON object (vLLM's keys), or "none" (off). Without "model", the draft
        shipped for the embedded target (only when the target is that model)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and value.strip().lower() in ("none", "off"):
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        unknown = set(value) - _SPEC_KEYS
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} (known: {sorted(_SPEC_KEYS)})")
        method = value.get("method", "dflash")
        if method != "dflash":
            raise ValueError(f"speculative_config.method {method!r} is not supported (only 'dflash')")
        if not value.get("model"):
            from .model_path import is_default_model, shipped_draft_dir

            if not is_default_model(target_model):
                raise ValueError("speculative_config.model (path to the DFlash draft) is required "
                                 "(a draft ships only for the embedded default model)")
            value = {**value, "model": str(shipped_draft_dir())}
        n = value.get("num_speculative_tokens")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"speculative_config.num_speculative_tokens must be a positive integer, got {n!r}")
        rsm = value.get("rejection_sample_method", "strict")
        if rsm not in ("strict", "synthetic"):
            raise ValueError(f"speculative_config.rejection_sample_method must be 'strict' or 'synthetic', got {rsm!r}")
        length, rates = value.get("synthetic_acceptance_length"), value.get("synthetic_acceptance_rates")
        if rsm == "synthetic":
            if (length is None) == (rates is None):
                raise ValueError("synthetic acceptance needs exactly one of synthetic_acceptance_length "
                                 "and synthetic_acceptance_rates")
            if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))
                                       or not math.isfinite(length)):
                raise ValueError(f"synthetic_acceptance_length must be a number, got {length!r}")
            if rates is not None and (not isinstance(rates, list) or not all(
                    isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0 for r in rates)):
                raise ValueError("synthetic_acceptance_rates must be a list of probabilities in [0, 1]")
        elif length is not None or rates is not None:
            raise ValueError("synthetic_acceptance_* keys need rejection_sample_method='synthetic'")
        schedule = _parse_schedule(value.get("num_speculative_tokens_schedule"))
        if schedule and n is not None and max(k for _, k in schedule) > n:
            raise ValueError(f"num_speculative_tokens_schedule {schedule}: every k must be <= "
                             f"num_speculative_tokens ({n})")
        vocab = value.get("draft_vocab_size")
        if vocab is not None and (not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1):
            raise ValueError(f"speculative_config.draft_vocab_size must be a positive integer, got {vocab!r}")
        draft_length = _parse_draft_length(value.get("draft_length"), n, value.get("num_speculative_tokens_schedule"))
        if isinstance(draft_length, int):
            n, draft_length = draft_length, "fixed"
        if n == 0:
            raise ValueError("a draft length of 0 is speculation off: use speculative_config 'none'")
        if draft_length == "adaptive" and rsm == "synthetic" and n is None:
            draft_length = "fixed"  # benchmark runs measure one K unless asked otherwise
        return cls(model=str(value["model"]), method=method, num_speculative_tokens=n, draft_length=draft_length,
                   rejection_sample_method=rsm, synthetic_acceptance_length=length,
                   synthetic_acceptance_rates=rates, num_speculative_tokens_schedule=schedule,
                   draft_vocab_size=vocab)


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded SmolLM2
    # "auto" (default): see auto_speculative_config; None or "none": off; else a dict / JSON.
    speculative_config: SpeculativeConfig | dict | str | None = "auto"
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192 (runtime_config)
    max_num_batched_tokens: int | None = None  # default: max(2048, (K + 1) * max_num_seqs) (runtime_config)
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # GPU: no CUDA graphs (same shapes and tokens, slower)
    # GPU: the most prefill tokens a step that also carries decode rows may hold and still replay
    # a CUDA graph (bucketed; captured at startup). 0: such mixed steps run eagerly.
    max_mixed_graph_tokens: int = 512
    # GPU: before capturing the graphs, time the skinny Triton GEMM against cuBLAS for every
    # few-row (M <= 64) GEMM shape the step runs, and use it where it is faster (ops/gemm_tuning.py).
    # Off by default: on an H100 (run 45) it won only o_proj at M <= 8 (0.6% of a spec-off step)
    # for 25-40 s more startup on the Qwen3-8B shape.
    tune_gemms: bool = False
    served_model_name: str | None = None
    # Share the KV (target and draft) of cached prompt prefixes, as vLLM's --enable-prefix-caching.
    enable_prefix_caching: bool = True
    # CPU GEMMs in the exact mode: a row's bits never depend on its batch, so spec-on equals
    # spec-off exactly (slower at one request). None: $VLLM_BATCH_INVARIANT / $DFLASH_BATCH_INVARIANT
    # (decided in runtime_config.resolve, like every other default).
    batch_invariant: bool | None = None
    # Build step N's outputs (detokenise, stream hand-off) while the device runs step N+1.
    # None: on unless $DFLASH_OVERLAP=0.
    overlap: bool | None = None
    # The fast CPU backend's GEMM weights (cpu/weights.py): "none" (the model's dtype),
    # "bf16", "int4" (int4 where a weight is on a 4-bit grid, bf16 elsewhere), or "auto": int4
    # for a GGUF model (the embedded default) at dtype "auto", bf16 for a bfloat16 model, else none.
    cpu_weights: str = "auto"
    # Ranks the target and the draft are split over (vLLM's --tensor-parallel-size): this
    # process is rank 0 and starts ranks 1..N-1 as worker processes (distributed/). 1: no split.
    tensor_parallel_size: int = 1
    # How the ranks start (vLLM's --distributed-executor-backend): "mp" (this process spawns
    # ranks 1..N-1) or "external_launcher" (torchrun started N processes: RANK / WORLD_SIZE /
    # MASTER_ADDR / MASTER_PORT from its environment; rank 0 runs the engine, ranks >= 1 serve
    # as its workers inside LLM(...) / serve and exit when rank 0's engine closes).
    distributed_executor_backend: str = "mp"
    # A hybrid (Qwen3.5) target's recurrent-state dtype (vLLM's --mamba-ssm-cache-dtype):
    # "auto" (the checkpoint's mamba_ssm_dtype, float32 when absent), "float32", "bfloat16",
    # "float16". A 16-bit state halves a state slot (more concurrent requests per GPU).
    mamba_ssm_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if isinstance(spec, str) and spec.strip().lower() == "auto":
            spec, why = auto_speculative_config(self.model, self.device)
            logger.info("speculative decoding %s (auto: %s)", "on" if spec else "off", why)
        self.speculative_config = SpeculativeConfig.parse(spec, self.model)
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        v = self.max_mixed_graph_tokens
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"max_mixed_graph_tokens must be a non-negative integer, got {v!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, "
                             f"got {self.distributed_executor_backend!r}")
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype must be one of {', '.join(MAMBA_SSM_CACHE_DTYPES)}, "
                             f"got {self.mamba_ssm_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        from .cpu.weights import FORMATS

        if self.cpu_weights not in FORMATS:
            raise ValueError(f"cpu_weights must be one of {', '.join(FORMATS)}, got {self.cpu_weights!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "half", "float"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
