"""OpenAI's endpoints under /v1: completions, chat completions, models (API key checked)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from . import protocol as p
from .context import Ctx, check_api_key
from .request_ids import request_ids
from .request_parsing import completion_prompt, default_max_tokens, read_json, render_chat, sampling_params
from .response_shapes import ChatShape, CompletionShape
from .serving import serve

router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


@router.post("/completions")
async def completions(request: Request, ctx: Ctx) -> Response:
    rid, response_id, client_id = request_ids("cmpl", request)
    req = await read_json(request, p.CompletionRequest, ctx.max_body_bytes)
    ctx.check_model(req.model)
    if (why := req.unsupported()) is not None:
        raise p.bad_request(*why)
    prompt_ids, prompt = await completion_prompt(req, ctx.tokenizer)
    max_tokens = default_max_tokens(req.max_tokens, len(prompt_ids), ctx.max_model_len)
    params = sampling_params(req, max_tokens, ctx.engine.vocab_size)
    return await serve(ctx.engine, request, rid, client_id, prompt_ids, prompt, params, req,
                       CompletionShape(response_id, ctx.served_model_name, ctx.fingerprint))


@router.post("/chat/completions")
async def chat_completions(request: Request, ctx: Ctx) -> Response:
    rid, response_id, client_id = request_ids("chatcmpl", request)
    req = await read_json(request, p.ChatCompletionRequest, ctx.max_body_bytes)
    ctx.check_model(req.model)
    if (why := req.unsupported()) is not None:
        raise p.bad_request(*why)
    prompt_ids = await render_chat(ctx.tokenizer(), req.messages, req.add_generation_prompt)
    max_tokens = default_max_tokens(req.requested_max_tokens, len(prompt_ids), ctx.max_model_len)
    params = sampling_params(req, max_tokens, ctx.engine.vocab_size)
    return await serve(ctx.engine, request, rid, client_id, prompt_ids, None, params, req,
                       ChatShape(response_id, ctx.served_model_name, ctx.fingerprint))


@router.get("/models")
async def models(ctx: Ctx) -> dict:
    card = p.ModelCard(id=ctx.served_model_name, root=ctx.model_root, max_model_len=ctx.max_model_len)
    return p.ModelList(data=[card]).model_dump()
