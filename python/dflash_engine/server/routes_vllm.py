"""The endpoints vLLM serves beside OpenAI's: /health, /metrics, /tokenize, /detokenize.

None of them needs the API key: like vLLM, the server checks it only under /v1.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from . import protocol as p
from .async_engine import EngineDead
from .context import Ctx
from .errors import as_openai_error, error_response
from .metrics import CONTENT_TYPE
from .request_parsing import read_json, render_chat

router = APIRouter()


@router.get("/health")
async def health(ctx: Ctx) -> Response:
    """200 while the engine thread runs; 503 (saying why) once it has died."""
    if ctx.engine.is_healthy:
        return Response(status_code=200)
    return error_response(as_openai_error(EngineDead(f"engine is not running: {ctx.engine.dead_error!r}")))


@router.get("/metrics")
async def metrics(ctx: Ctx) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


@router.post("/tokenize")
async def tokenize(request: Request, ctx: Ctx) -> dict:
    req = await read_json(request, p.TokenizeRequest, ctx.max_body_bytes)
    ctx.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise p.bad_request("send exactly one of `prompt` or `messages`")
    if req.messages is not None:
        ids = await render_chat(ctx.tokenizer(), req.messages, req.add_generation_prompt)
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await asyncio.to_thread(ctx.tokenizer().encode, req.prompt, add_special_tokens=add_special)
    return p.TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids).model_dump()


@router.post("/detokenize")
async def detokenize(request: Request, ctx: Ctx) -> dict:
    req = await read_json(request, p.DetokenizeRequest, ctx.max_body_bytes)
    ctx.check_model(req.model)
    tok = ctx.tokenizer()
    if any(t < 0 or t >= tok.vocab_size for t in req.tokens):
        raise p.bad_request(f"token ids must be in [0, {tok.vocab_size})", "tokens")
    return p.DetokenizeResponse(prompt=tok.decode(req.tokens)).model_dump()
