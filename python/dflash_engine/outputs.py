"""Request outputs, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # Tokens and text added since the previous output of this request (for streaming).
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    # Prompt tokens whose KV came from the prefix cache (as vLLM reports it).
    num_cached_tokens: int = 0
