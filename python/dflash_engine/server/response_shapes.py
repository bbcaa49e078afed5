"""Engine output -> OpenAI's bodies: one shape for completions, one for chat completions.

A shape knows the response id, the model name and the fingerprint, and builds the whole
response, a stream chunk, or the final usage chunk from a ``RequestOutput`` (the last one)
and what serving.py gathered from the request's outputs (they are deltas: the text and the
completion token count); serving.py drives it without knowing which endpoint it serves.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from ..outputs import RequestOutput
from . import protocol as p


def sse(obj: BaseModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as JSON (a model: pydantic-core's serializer,
    compact, without the dict round trip; every streamed chunk of every request goes here)."""
    if isinstance(obj, BaseModel):
        return f"data: {obj.model_dump_json()}\n\n"
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(out: RequestOutput, completion_tokens: int) -> p.UsageInfo:
    return p.UsageInfo.of(len(out.prompt_token_ids), completion_tokens, out.num_cached_tokens)


class CompletionShape:
    prompt_param = "prompt"  # what a 400 about the prompt names

    def __init__(self, request_id: str, model: str, fingerprint: str) -> None:
        self.id, self.model = request_id, model
        self.fingerprint = fingerprint  # says "synthetic" when benchmark-only acceptance is on

    def head(self) -> list[BaseModel]:
        """Chunks sent before the first output (none for completions)."""
        return []

    def chunk(self, text: str, finish: str | None, stop_reason: Any) -> BaseModel:
        choice = p.CompletionChoice(text=text, finish_reason=finish, stop_reason=stop_reason)
        return p.CompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                    choices=[choice])

    def usage_chunk(self, out: RequestOutput, completion_tokens: int) -> BaseModel:
        return p.CompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                    choices=[], usage=_usage(out, completion_tokens))

    def full(self, out: RequestOutput, text: str, completion_tokens: int) -> BaseModel:
        c = out.outputs[0]
        choice = p.CompletionChoice(text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return p.CompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                    choices=[choice], usage=_usage(out, completion_tokens))


class ChatShape(CompletionShape):
    prompt_param = "messages"

    def head(self) -> list[BaseModel]:
        """OpenAI's first chat chunk: the assistant role, no content yet."""
        delta = p.DeltaMessage(role="assistant", content="")
        return [p.ChatCompletionChunk(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                      choices=[p.ChatChunkChoice(delta=delta)])]

    def chunk(self, text: str, finish: str | None, stop_reason: Any) -> BaseModel:
        choice = p.ChatChunkChoice(delta=p.DeltaMessage(content=text), finish_reason=finish,
                                   stop_reason=stop_reason)
        return p.ChatCompletionChunk(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                     choices=[choice])

    def usage_chunk(self, out: RequestOutput, completion_tokens: int) -> BaseModel:
        return p.ChatCompletionChunk(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                     choices=[], usage=_usage(out, completion_tokens))

    def full(self, out: RequestOutput, text: str, completion_tokens: int) -> BaseModel:
        c = out.outputs[0]
        choice = p.ChatChoice(message=p.ChatResponseMessage(content=text),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return p.ChatCompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                        choices=[choice], usage=_usage(out, completion_tokens))
