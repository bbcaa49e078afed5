"""dflash-engine: LLM serving with DFlash speculative decoding, lossless at every concurrency."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "__version__"]

if TYPE_CHECKING:
    from .engine import LLMEngine
    from .llm import LLM


def __getattr__(name: str):
    # torch is imported only when the engine is used, so `import dflash_engine` stays light.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "LLMEngine":
        from .engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'dflash_engine' has no attribute {name!r}")
