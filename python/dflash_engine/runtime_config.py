"""The one resolution of an `EngineConfig` into what the runtime runs with.

`resolve(cfg)` reads the model's and the draft's config.json, picks the device and dtype,
and decides every derived quantity once: K, the draft-length schedule, B, D, the KV reserve
bound, the page size, the CPU weight format, the exact mode, overlap, the token budget, the
memory budgets and the synthetic acceptance rates. The result is frozen; below it (worker/,
engine.py) nothing reads the environment or re-derives a default.

Vocabulary (one meaning per word): a *page* is KV memory (`page_size` tokens; vLLM's
`--block-size` at the edge); the *block* is DFlash's: B = K + 1 verify rows, D draft rows.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from . import _core, envs
from .config import EngineConfig, synthetic_rates
from .cpu import resolve_format
from .model_path import is_gguf_model, resolve_model_path
from .models import draft_vocab as _draft_vocab
from .models.config import DraftConfig, ModelConfig, resolve_dtype, validate_draft_against_target
from .models.loader import read_config, target_config
from .models.parallel import rank_config, shard_problems

logger = logging.getLogger(__name__)

# max_model_len when neither the user nor a smaller max_position_embeddings sets it.
MAX_MODEL_LEN_CAP = 8192
# The token budget's floor: max(DEFAULT_MAX_NUM_BATCHED_TOKENS, B * max_num_seqs).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The CPU KV pool's byte budget without DFLASH_CPU_KV_CACHE_GB.
DEFAULT_CPU_KV_BYTES = 1 << 30
# The K an adaptive policy chooses among (capped at num_speculative_tokens, which is always
# one): a graph runner per K on the GPU, so a handful; 0 is a plain decode step.
ADAPTIVE_CANDIDATES = (0, 1, 3, 7, 15)
# The fast CPU mode's default number of verified drafts. A CPU verify pass costs about
# linearly in its rows, so verifying 3 of the full draft block's 15 proposals pays best: the
# shipped draft, HumanEval, 2 cores: 1.53x spec-off at K = 3, 1.06x at 5, 1.20x at 7, 0.99x at
# 15 (docs/perf.md, "Shorter draft blocks"). The exact mode's GEMMs run 16-row blocks
# whatever K is, so it verifies the draft's full block.
CPU_NUM_SPECULATIVE_TOKENS = 3


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return dev


@dataclass(frozen=True)
class RuntimeConfig:
    model_path: Path
    model_config: ModelConfig
    draft_path: Path | None
    draft_config: DraftConfig | None
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int  # tokens per KV page
    num_speculative_tokens: int  # K: drafts verified per decode step (0: speculation off)
    draft_len_schedule: tuple[tuple[int, int], ...]  # (max decoding requests, k), ascending
    draft_len_policy: str  # "fixed" (always K), "schedule" (draft_len_schedule), "adaptive"
    draft_len_candidates: tuple[int, ...]  # the K an adaptive step may verify (0: no draft pass)
    draft_rows: int  # D: rows of the draft's block (0 without a draft)
    mask_token_id: int
    tap_layers: tuple[int, ...] | None  # target layers whose outputs feed the draft
    draft_vocab: np.ndarray | None  # the token ids a draft may propose (ascending; None: all)
    synthetic_rates: tuple[float, ...] | None  # benchmark-only synthetic acceptance
    batch_invariant: bool  # the exact mode: a row's bits never depend on its batch
    cpu_weights: str  # the fast CPU mode's packed format ("none" off the CPU / in the exact mode)
    overlap: bool  # build step N's outputs while the device runs step N+1
    enforce_eager: bool
    max_mixed_graph_tokens: int  # prefill tokens of a mixed step's graph (0: mixed steps eager)
    tune_gemms: bool  # GPU graphs: the skinny GEMM where it timed faster than cuBLAS (ops/gemm_tuning.py)
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    cpu_kv_cache_bytes: int
    cpu_kv_cache_source: str  # how the CPU budget was chosen, for the memory report
    seed: int
    # Tensor parallelism (distributed/): ranks, and the bounds on a rank's waits for the others.
    tensor_parallel_size: int = 1
    tp_launcher: str = "mp"  # EngineConfig.distributed_executor_backend
    tp_timeout_s: float = 300.0  # any one collective of a step
    tp_setup_timeout_s: float = 1800.0  # worker start-up and shard loading

    @property
    def block_rows(self) -> int:
        """B: rows of the largest verify block."""
        return self.num_speculative_tokens + 1

    @property
    def reserve_rows(self) -> int:
        """Rows a decode step writes from `committed`: max(B, D) (the core's `reserve_rows`;
        every KV reservation and page-table width is computed from it)."""
        return max(self.block_rows, self.draft_rows)

    def draft_rows_for(self, block_rows: int) -> int:
        """D of a step verifying `block_rows` rows (the core's rule; 0: no draft pass)."""
        return _core.draft_pass_rows(block_rows, self.draft_rows)

    @property
    def draft_lengths(self) -> list[int]:
        """Every K a step may verify (the largest first)."""
        ks = {self.num_speculative_tokens} | {k for _, k in self.draft_len_schedule} | set(self.draft_len_candidates)
        return sorted(ks, reverse=True)

    @property
    def hybrid(self) -> bool:
        """A hybrid target (GDN state slots from the KV pool; worker/state_pool.py)."""
        return hasattr(self.model_config, "gdn_layer_ids")

    @property
    def synthetic(self) -> bool:
        return self.synthetic_rates is not None


def check_tensor_parallel(size: int, mcfg: ModelConfig, dcfg: DraftConfig | None, device: torch.device,
                          cpu_weights: str, device_count: int | None = None, launcher: str = "mp") -> None:
    """Refuse, with every reason at once, a tensor-parallel split that cannot run: the fast CPU
    backend's packed formats (single-process only: TP runs the plain torch layers), more ranks
    than GPUs, sizes not divisible by the ranks (a hybrid target's GDN key and value heads too)."""
    if size == 1:
        return
    problems = []
    if cpu_weights in ("bf16", "int4"):
        problems.append(f"cpu_weights {cpu_weights!r} is the fast CPU backend's, which runs in one process only; "
                        "tensor parallelism runs the plain torch layers (cpu_weights 'auto' or 'none')")
    if device.type == "cuda" and launcher == "mp":  # (torchrun's ranks may span hosts: each has its own)
        n = torch.cuda.device_count() if device_count is None else device_count
        first = device.index or 0
        if first + size > n:
            problems.append(f"it needs {size} GPUs (cuda:{first}..cuda:{first + size - 1}) but {n} are visible")
    problems += shard_problems(mcfg, size, "the target")
    if dcfg is not None:
        problems += shard_problems(dcfg, size, "the draft", split_vocab=False)
    if problems:
        raise ValueError(f"tensor_parallel_size {size} cannot run: " + "; ".join(problems))


def resolve(cfg: EngineConfig) -> RuntimeConfig:
    model_path = Path(resolve_model_path(cfg.model))
    mcfg = target_config(read_config(model_path))
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, mcfg.torch_dtype, device)
    batch_invariant = envs.batch_invariant() if cfg.batch_invariant is None else bool(cfg.batch_invariant)
    max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, MAX_MODEL_LEN_CAP)
    cpu_weights = resolve_format(cfg.cpu_weights, device, batch_invariant, cfg.dtype, dtype, is_gguf_model(cfg.model))

    spec = cfg.speculative_config
    draft_path, dcfg, k, schedule, d, rates, draft_vocab = None, None, 0, (), 0, None, None
    policy, candidates = "fixed", ()
    if spec is not None:
        draft_path = Path(spec.model)
        dcfg = DraftConfig.from_dict(read_config(draft_path))
        validate_draft_against_target(dcfg, mcfg)
        k = spec.num_speculative_tokens
        if k is None:  # the draft's block, or fewer in the fast CPU mode (CPU_NUM_SPECULATIVE_TOKENS)
            k = dcfg.block_size - 1
            if (device.type == "cpu" and not batch_invariant and not spec.num_speculative_tokens_schedule
                    and not spec.synthetic):
                k = min(k, CPU_NUM_SPECULATIVE_TOKENS)
        if k >= dcfg.block_size:
            raise ValueError(f"num_speculative_tokens ({k}) must be < the draft's block_size ({dcfg.block_size})")
        schedule = tuple(spec.num_speculative_tokens_schedule or ())
        if any(s > k for _, s in schedule):  # (parse checks this against an explicit K)
            raise ValueError(f"num_speculative_tokens_schedule {list(schedule)}: every k must be <= "
                             f"num_speculative_tokens ({k})")
        # Every decode step drafts the draft's whole block and verifies K of its proposals.
        d = dcfg.block_size
        if schedule:
            policy = "schedule"
        elif spec.draft_length == "adaptive":
            policy = "adaptive"
            candidates = tuple(sorted({c for c in ADAPTIVE_CANDIDATES if c <= k} | {k}))
        if spec.draft_vocab_size is not None:
            if cfg.tensor_parallel_size > 1:
                raise ValueError("speculative_config.draft_vocab_size is not supported with tensor_parallel_size > 1")
            draft_vocab = _draft_vocab.load(draft_path, spec.draft_vocab_size, mcfg.vocab_size)
            logger.info("draft vocabulary: proposals among the %d most frequent of %d tokens (%s)",
                        len(draft_vocab), mcfg.vocab_size, draft_path / _draft_vocab.FILE)
        if spec.synthetic:
            rates = tuple(synthetic_rates(k, spec.synthetic_acceptance_length, spec.synthetic_acceptance_rates))
            expected = sum(float(np.prod(rates[:i])) for i in range(len(rates) + 1))
            logger.warning("SYNTHETIC acceptance (benchmark only): per-position rates %s, expected "
                           "acceptance length %.2f; outputs are NOT the target's", [round(r, 4) for r in rates],
                           expected)

    tp = cfg.tensor_parallel_size
    # An explicit packed format that would apply is refused; "auto" quietly becomes "none".
    check_tensor_parallel(tp, mcfg, dcfg, device, cpu_weights if cfg.cpu_weights == cpu_weights else "none",
                          launcher=cfg.distributed_executor_backend)
    if tp > 1 and cpu_weights != "none":
        logger.info("tensor parallelism: the fast CPU backend is single-process; the plain torch layers run")
        cpu_weights = "none"

    page_size, prefix_caching = cfg.block_size, cfg.enable_prefix_caching
    if hasattr(mcfg, "gdn_layer_ids"):  # a hybrid target: one page must hold a state slot
        from .worker.state_pool import hybrid_page_size

        if cfg.mamba_ssm_cache_dtype != "auto":  # the state pool's dtype (its layout reads mcfg)
            mcfg = replace(mcfg, mamba_ssm_dtype=cfg.mamba_ssm_cache_dtype)

        # Every rank's pages have this many tokens: sized from the rank's config view (its state
        # slot and KV chunks are its heads'; the views are the same on every rank).
        page_size = hybrid_page_size(rank_config(mcfg, tp), None if dcfg is None else rank_config(dcfg, tp),
                                     cfg.block_size, dtype)
        if page_size != cfg.block_size:
            logger.info("hybrid target: pages of %d tokens (raised from %d) so that one page holds one recurrent "
                        "state slot", page_size, cfg.block_size)
        if prefix_caching:
            logger.info("hybrid target: prefix caching disabled (the recurrent state of a cached prefix is not "
                        "stored)")
            prefix_caching = False

    gb = envs.cpu_kv_cache_gb()
    return RuntimeConfig(
        model_path=model_path, model_config=mcfg, draft_path=draft_path, draft_config=dcfg, device=device,
        dtype=dtype, max_model_len=max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                                                 (k + 1) * cfg.max_num_seqs),
        page_size=page_size, num_speculative_tokens=k, draft_len_schedule=schedule, draft_rows=d,
        draft_len_policy=policy, draft_len_candidates=candidates,
        mask_token_id=dcfg.mask_token_id if dcfg else 0,
        tap_layers=tuple(dcfg.target_layer_ids) if dcfg else None, draft_vocab=draft_vocab, synthetic_rates=rates,
        batch_invariant=batch_invariant, cpu_weights=cpu_weights,
        overlap=envs.overlap() if cfg.overlap is None else bool(cfg.overlap),
        enforce_eager=cfg.enforce_eager, enable_prefix_caching=prefix_caching,
        max_mixed_graph_tokens=cfg.max_mixed_graph_tokens, tune_gemms=bool(cfg.tune_gemms),
        gpu_memory_utilization=cfg.gpu_memory_utilization, num_gpu_blocks_override=cfg.num_gpu_blocks_override,
        cpu_kv_cache_bytes=int(gb * (1 << 30)) or DEFAULT_CPU_KV_BYTES,
        cpu_kv_cache_source=f"DFLASH_CPU_KV_CACHE_GB={gb:g}" if gb else "DFLASH_CPU_KV_CACHE_GB (default 1)",
        seed=cfg.seed, tensor_parallel_size=tp, tp_launcher=cfg.distributed_executor_backend,
        tp_timeout_s=envs.tp_step_timeout_s(),
        tp_setup_timeout_s=envs.tp_setup_timeout_s(),
    )
