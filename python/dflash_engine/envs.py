"""The one reader of the process environment (vLLM keeps the same rule in its envs.py).

Every variable the package honours is named here, with its default and meaning. Values are
read when asked for, never at import time, so a test (or a process holding two engines) can
change them between engines. Nothing below the configuration resolution (config.py) reads
these for decisions that `EngineConfig` / `RuntimeConfig` already carry.
"""
from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def batch_invariant() -> bool:
    """`VLLM_BATCH_INVARIANT=1` (vLLM's name) or `DFLASH_BATCH_INVARIANT=1`: the exact mode is
    the default of engines and models built without an explicit `batch_invariant=`."""
    return _flag("VLLM_BATCH_INVARIANT") or _flag("DFLASH_BATCH_INVARIANT")


def overlap() -> bool:
    """`DFLASH_OVERLAP=0` turns the host/device overlap off for engines built without `overlap=`."""
    return os.environ.get("DFLASH_OVERLAP", "1").strip() != "0"


def cpu_kv_cache_gb() -> float:
    """`DFLASH_CPU_KV_CACHE_GB`: the CPU KV pool's byte budget in GiB (0 or unset: the default)."""
    return float(os.environ.get("DFLASH_CPU_KV_CACHE_GB", "0") or 0)


def engine_cache() -> str | None:
    """`DFLASH_ENGINE_CACHE`: where converted models live (default ~/.cache/dflash-engine)."""
    return os.environ.get("DFLASH_ENGINE_CACHE") or None


def reference_ops_on_gpu() -> bool:
    """`DFLASH_REFERENCE_OPS=1`: the torch reference ops on the GPU too (debugging)."""
    return os.environ.get("DFLASH_REFERENCE_OPS", "") == "1"


def triton_interpreter() -> bool:
    """`TRITON_INTERPRET=1` (Triton's own variable): kernels run under Triton's interpreter,
    which cannot execute launch attributes such as PDL (kernels/pdl.py)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def kernels_on_cpu() -> bool:
    """`DFLASH_KERNELS_ON_CPU=1` (with `TRITON_INTERPRET=1`): the Triton kernel path on CPU
    tensors, for the kernel tests."""
    return os.environ.get("DFLASH_KERNELS_ON_CPU", "") == "1"


SWITCH_INTERVAL_MS_DEFAULT = 0.5


def switch_interval_ms() -> float:
    """`DFLASH_SWITCH_INTERVAL_MS`: the server's GIL switch interval (0: Python's default)."""
    return float(os.environ.get("DFLASH_SWITCH_INTERVAL_MS", SWITCH_INTERVAL_MS_DEFAULT) or 0)


def server_api_key() -> str | None:
    """`DFLASH_API_KEY`: the server's default `--api-key`."""
    return os.environ.get("DFLASH_API_KEY") or None


def client_api_key() -> str | None:
    """`DFLASH_API_KEY`, else `OPENAI_API_KEY`: the benchmark client's default `--api-key`."""
    return os.environ.get("DFLASH_API_KEY") or os.environ.get("OPENAI_API_KEY") or None


def tp_step_timeout_s() -> float:
    """`DFLASH_TP_TIMEOUT_S` (default 300): under tensor parallelism, the longest any one
    collective of a step may wait for the other ranks before the engine fails with an error (a
    rank that died is reported within seconds, by its process sentinel; this bounds a hung one)."""
    return float(os.environ.get("DFLASH_TP_TIMEOUT_S", "300") or 300)


def tp_setup_timeout_s() -> float:
    """`DFLASH_TP_SETUP_TIMEOUT_S` (default 1800): under tensor parallelism, the longest the
    engine waits for its worker ranks to start and load their shards."""
    return float(os.environ.get("DFLASH_TP_SETUP_TIMEOUT_S", "1800") or 1800)


TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")


def torchrun() -> dict[str, str]:
    """What torchrun sets for each rank it starts (distributed_executor_backend
    "external_launcher"): the keys of TORCHRUN_KEYS that are set and non-empty."""
    return {k: os.environ[k] for k in TORCHRUN_KEYS if os.environ.get(k)}
