"""HTTP body -> what the engine takes: parsed JSON, prompt token ids, SamplingParams.

Every handler parses its own body (size-capped, strict JSON) so that each bad input gets
OpenAI's error shape with a 4xx naming the field, and nothing reaches the engine until it
is known to be servable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ..sampling_params import InvalidSamplingParamError, RequestOutputKind, SamplingParams
from . import protocol as p

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

Body = TypeVar("Body", bound=BaseModel)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first error's message (with its full location) and the top-level field it is in."""
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return f"request body is not valid JSON: {err['msg']}", None
    loc = ".".join(str(x) for x in err["loc"]) or None
    param = str(err["loc"][0]) if err["loc"] else None
    return (f"{loc}: {err['msg']}" if loc else err["msg"]), param


async def read_json(request: Request, model: type[Body], limit: int) -> Body:
    """The body as ``model``: a 413 past ``limit`` bytes (read no further), a 400 if invalid."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise p.OpenAIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise p.OpenAIError(413, f"request body exceeds {limit} bytes",
                                    code="request_too_large")
    except ClientDisconnect:  # gone before the body was complete: nothing to answer
        raise p.OpenAIError(499, "client disconnected", type="invalid_request_error",
                            code="client_disconnected") from None
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as e:
        message, param = _validation_message(e)
        raise p.bad_request(message, param) from None


def default_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """What the request asked for, or the room left in the context (OpenAI's default). The
    limits themselves (prompt and completion within max_model_len and the page pool) are
    checked once, by the core, whose error names the parameter for the 400."""
    if requested is not None:
        return requested
    return max(1, max_model_len - prompt_len)


def sampling_params(req: p.SamplingFields, max_tokens: int, vocab_size: int) -> SamplingParams:
    """Every field checked against what the engine can represent (token ids against the
    vocabulary); a failure is a 400 naming the field."""
    try:
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            # Streamed or not, the server reads each output's news only (serving.py).
            output_kind=RequestOutputKind.DELTA,
        )
        params.validate(vocab_size=vocab_size)
    except InvalidSamplingParamError as e:
        raise p.bad_request(str(e), e.param) from None
    except ValueError as e:
        raise p.bad_request(str(e)) from None
    return params


async def render_chat(tok: Tokenizer, messages: list[p.ChatMessage], add_generation_prompt: bool) -> list[int]:
    """The chat template applied, then tokenised (off the event loop: long prompts are slow)."""
    try:
        text = tok.apply_chat_template([m.as_template_dict() for m in messages],
                                       add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise p.bad_request(str(e), "messages") from None
    return await asyncio.to_thread(tok.encode, text, add_special_tokens=False)


async def completion_prompt(
    req: p.CompletionRequest, tokenizer: Callable[[], Tokenizer]
) -> tuple[list[int], str | None]:
    """(prompt token ids, prompt text when given as text); ``tokenizer`` is asked for only
    when the prompt is text (it raises the 400 for a model without one)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise p.bad_request("batched prompts are not supported; send one prompt", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise p.bad_request("the prompt is empty", "prompt")
        ids = await asyncio.to_thread(tokenizer().encode, prompt)
        return ids, prompt
    # Token ids (range, vocabulary) are checked by the engine, which names the parameter.
    return list(prompt), None
