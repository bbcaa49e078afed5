"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine.

Every handler parses its own body (size-capped, strict JSON) so that each bad input gets
OpenAI's error shape with a 4xx, and nothing reaches the engine until it is known to be
servable. A streamed request is answered only once its first output (or its error)
exists, so an engine-side refusal is still a 400 rather than an error inside a 200.

Request ids: every HTTP request gets a fresh internal id minted here (``cmpl-<uuid4 hex>``
/ ``chatcmpl-<uuid4 hex>``); that id is what the engine sees, and a disconnect aborts only
the id of its own connection. A client's ``X-Request-Id`` is never used to look anything
up: it is only echoed back (response header, and the response's ``id`` field).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..outputs import RequestOutput
from ..sampling_params import InvalidSamplingParamError, SamplingParams
from . import protocol as p
from .async_engine import AsyncLLMEngine, EngineDead, RequestAborted, RequestFailed
from .metrics import CONTENT_TYPE, ServerMetrics

MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_REQUEST_ID_CHARS = 128
_ECHO_ID = "dflash_x_request_id"  # request.state key: the id echoed in the response header
_ENGINE_ERRORS = (ValueError, RequestFailed, EngineDead, RequestAborted)


# ---- errors --------------------------------------------------------------------------


def _error_response(err: p.OpenAIError) -> JSONResponse:
    return JSONResponse(p.ErrorResponse(error=err.info).model_dump(), status_code=err.status)


def _as_openai_error(e: BaseException) -> p.OpenAIError:
    if isinstance(e, p.OpenAIError):
        return e
    if isinstance(e, ValueError):  # the engine's "can never be served"
        param = getattr(e, "param", None)
        return p.bad_request(str(e), param if isinstance(param, str) else None)
    if isinstance(e, RequestFailed):
        return p.OpenAIError(500, str(e), type="server_error", code="request_failed")
    if isinstance(e, EngineDead):
        return p.OpenAIError(503, str(e), type="server_error", code="engine_unavailable")
    if isinstance(e, RequestAborted):
        return p.OpenAIError(499, "request aborted", type="server_error", code="aborted")
    return p.OpenAIError(500, f"internal error: {e!r}", type="server_error")


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """The first error's message (with its full location) and the top-level field it is in."""
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return f"request body is not valid JSON: {err['msg']}", None
    loc = ".".join(str(x) for x in err["loc"]) or None
    param = str(err["loc"][0]) if err["loc"] else None
    return (f"{loc}: {err['msg']}" if loc else err["msg"]), param


async def _read_json(request: Request, model: type[BaseModel], limit: int) -> Any:
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


# ---- request -> engine ------------------------------------------------------------------


def _default_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """What the request asked for, or the room left in the context (OpenAI's default). The
    limits themselves (prompt and completion within max_model_len and the page pool) are
    checked once, by the core, whose error names the parameter for the 400."""
    if requested is not None:
        return requested
    return max(1, max_model_len - prompt_len)


def _sampling_params(req: p.SamplingFields, max_tokens: int, vocab_size: int | None) -> SamplingParams:
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
        )
        params.validate(vocab_size=vocab_size)
    except InvalidSamplingParamError as e:
        raise p.bad_request(str(e), e.param) from None
    except ValueError as e:
        raise p.bad_request(str(e)) from None
    return params


def _client_request_id(request: Request) -> str | None:
    """The client's X-Request-Id, if any: only ever echoed back, never used as a key."""
    given = request.headers.get("x-request-id")
    if given is None:
        return None
    if not (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable()):
        raise p.bad_request(f"X-Request-Id must be 1-{MAX_REQUEST_ID_CHARS} printable characters",
                            "X-Request-Id")
    return given


def _request_ids(prefix: str, request: Request) -> tuple[str, str, str | None]:
    """(internal id, response id, client id). The internal id is always fresh; the response
    id (the body's ``id``) is ``<prefix>-<X-Request-Id>`` when the client sent one, as vLLM
    does, else the internal id."""
    internal = f"{prefix}-{uuid.uuid4().hex}"
    given = _client_request_id(request)
    setattr(request.state, _ECHO_ID, given if given is not None else internal)
    return internal, (internal if given is None else f"{prefix}-{given}"), given


class EchoRequestId:
    """ASGI middleware: every HTTP response carries ``X-Request-Id``: the client's own
    (when printable, 1-128 characters), else the internal id the handler minted."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                echo = state.get(_ECHO_ID)
                if echo is None:
                    given = dict(scope.get("headers") or ()).get(b"x-request-id")
                    if given is not None and 0 < len(given) <= MAX_REQUEST_ID_CHARS:
                        text = given.decode("latin-1")
                        echo = text if text.isprintable() else None
                if echo is not None:
                    headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                    message = {**message, "headers": [*headers, (b"x-request-id", echo.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


async def _abort_on_disconnect(request: Request, engine: AsyncLLMEngine, request_id: str) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(request_id)


# ---- engine output -> OpenAI shapes --------------------------------------------------------


def _sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump() if isinstance(obj, BaseModel) else obj
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(out: RequestOutput) -> p.UsageInfo:
    return p.UsageInfo.of(len(out.prompt_token_ids), len(out.outputs[0].token_ids), out.num_cached_tokens)


class _CompletionShape:
    prompt_param = "prompt"  # what a 400 about the prompt names

    def __init__(self, request_id: str, model: str, fingerprint: str) -> None:
        self.id, self.model = request_id, model
        self.fingerprint = fingerprint  # says "synthetic" when benchmark-only acceptance is on

    def head(self) -> list[BaseModel]:
        return []

    def chunk(self, text: str, finish: str | None, stop_reason: Any) -> BaseModel:
        choice = p.CompletionChoice(text=text, finish_reason=finish, stop_reason=stop_reason)
        return p.CompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint, choices=[choice])

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        return p.CompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint, choices=[], usage=_usage(out))

    def full(self, out: RequestOutput) -> BaseModel:
        c = out.outputs[0]
        choice = p.CompletionChoice(text=c.text, finish_reason=c.finish_reason,
                                    stop_reason=c.stop_reason)
        return p.CompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint, choices=[choice],
                                    usage=_usage(out))


class _ChatShape(_CompletionShape):
    prompt_param = "messages"

    def head(self) -> list[BaseModel]:
        delta = p.DeltaMessage(role="assistant", content="")
        return [p.ChatCompletionChunk(id=self.id, model=self.model, system_fingerprint=self.fingerprint,
                                      choices=[p.ChatChunkChoice(delta=delta)])]

    def chunk(self, text: str, finish: str | None, stop_reason: Any) -> BaseModel:
        choice = p.ChatChunkChoice(delta=p.DeltaMessage(content=text), finish_reason=finish,
                                   stop_reason=stop_reason)
        return p.ChatCompletionChunk(id=self.id, model=self.model, system_fingerprint=self.fingerprint, choices=[choice])

    def usage_chunk(self, out: RequestOutput) -> BaseModel:
        return p.ChatCompletionChunk(id=self.id, model=self.model, system_fingerprint=self.fingerprint, choices=[], usage=_usage(out))

    def full(self, out: RequestOutput) -> BaseModel:
        c = out.outputs[0]
        choice = p.ChatChoice(message=p.ChatResponseMessage(content=c.text),
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        return p.ChatCompletionResponse(id=self.id, model=self.model, system_fingerprint=self.fingerprint, choices=[choice],
                                        usage=_usage(out))


# ---- app ------------------------------------------------------------------------------------


def build_app(
    async_engine: AsyncLLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_model_len: int | None = None,
    model_root: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    max_model_len = max_model_len or async_engine.max_model_len
    synthetic = bool(getattr(async_engine.engine, "synthetic_acceptance", False))
    fingerprint = "dflash-engine-synthetic-acceptance" if synthetic else "dflash-engine"
    metrics = ServerMetrics(served_model_name, async_engine.stats, synthetic=synthetic)
    async_engine.metrics = metrics
    accepted_names = {served_model_name, model_root or served_model_name}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()  # joins the engine thread: at most one step

    async def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise p.OpenAIError(401, "missing or invalid API key (send Authorization: Bearer ...)",
                                code="invalid_api_key")

    app = FastAPI(title="dflash-engine", lifespan=lifespan)
    app.add_middleware(EchoRequestId)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.exception_handler(p.OpenAIError)
    async def _openai_error(_: Request, e: p.OpenAIError) -> JSONResponse:
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error_response(p.OpenAIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _any_error(_: Request, e: Exception) -> JSONResponse:
        return _error_response(_as_openai_error(e))

    def check_model(name: str | None) -> None:
        if name is not None and name not in accepted_names:
            raise p.OpenAIError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{served_model_name}`", param="model", code="model_not_found")

    def tokenizer() -> Any:
        if async_engine.tokenizer is None:
            raise p.bad_request("this model has no tokenizer; send token ids as the prompt")
        return async_engine.tokenizer

    vocab_size = async_engine.vocab_size

    async def render_chat(messages: list[p.ChatMessage], add_generation_prompt: bool) -> list[int]:
        tok = tokenizer()
        try:
            text = tok.apply_chat_template([m.as_template_dict() for m in messages],
                                           add_generation_prompt=add_generation_prompt)
        except ValueError as e:
            raise p.bad_request(str(e), "messages") from None
        return await asyncio.to_thread(tok.encode, text, add_special_tokens=False)

    async def completion_prompt(req: p.CompletionRequest) -> tuple[list[int], str | None]:
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

    async def serve(request: Request, request_id: str, client_id: str | None,
                    prompt_ids: list[int], prompt: str | None, params: SamplingParams,
                    req: p.SamplingFields, shape: _CompletionShape) -> Response:
        outputs = async_engine.generate(request_id, prompt_ids, params, prompt, client_id)
        watcher = asyncio.create_task(_abort_on_disconnect(request, async_engine, request_id))
        handed_over = False
        try:
            first = await anext(outputs)
            if req.stream:
                handed_over = True
                return StreamingResponse(stream(first, outputs, watcher, req.include_usage, shape),
                                         media_type="text/event-stream")
            final = first
            async for final in outputs:
                pass
            return JSONResponse(shape.full(final).model_dump())
        except _ENGINE_ERRORS as e:
            err = _as_openai_error(e)
            if shape.prompt_param != "prompt" and err.info.param == "prompt":
                err.info.param = shape.prompt_param  # a chat's prompt is its messages
            raise err from None
        finally:
            if not handed_over:
                watcher.cancel()
                await outputs.aclose()

    async def stream(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                     watcher: asyncio.Task, include_usage: bool,
                     shape: _CompletionShape) -> AsyncIterator[str]:
        try:
            for chunk in shape.head():
                yield _sse(chunk)
            out = first
            while True:
                c = out.outputs[0]
                if out.new_text or out.finished:
                    finish = c.finish_reason if out.finished else None
                    yield _sse(shape.chunk(out.new_text, finish, c.stop_reason if finish else None))
                if out.finished:
                    break
                out = await anext(outputs)
            if include_usage:
                yield _sse(shape.usage_chunk(out))
        except Exception as e:  # noqa: BLE001  (headers are sent: the error goes in the stream)
            yield _sse(p.ErrorResponse(error=_as_openai_error(e).info))
        finally:
            watcher.cancel()
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        rid, response_id, client_id = _request_ids("cmpl", request)
        req = await _read_json(request, p.CompletionRequest, max_body_bytes)
        check_model(req.model)
        if (why := req.unsupported()) is not None:
            raise p.bad_request(*why)
        prompt_ids, prompt = await completion_prompt(req)
        max_tokens = _default_max_tokens(req.max_tokens, len(prompt_ids), max_model_len)
        params = _sampling_params(req, max_tokens, vocab_size)
        return await serve(request, rid, client_id, prompt_ids, prompt, params, req,
                           _CompletionShape(response_id, served_model_name, fingerprint))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        rid, response_id, client_id = _request_ids("chatcmpl", request)
        req = await _read_json(request, p.ChatCompletionRequest, max_body_bytes)
        check_model(req.model)
        if (why := req.unsupported()) is not None:
            raise p.bad_request(*why)
        prompt_ids = await render_chat(req.messages, req.add_generation_prompt)
        max_tokens = _default_max_tokens(req.requested_max_tokens, len(prompt_ids), max_model_len)
        params = _sampling_params(req, max_tokens, vocab_size)
        return await serve(request, rid, client_id, prompt_ids, None, params, req,
                           _ChatShape(response_id, served_model_name, fingerprint))

    @v1.get("/models")
    async def models() -> dict:
        card = p.ModelCard(id=served_model_name, root=model_root or served_model_name,
                           max_model_len=max_model_len)
        return p.ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_healthy:
            return Response(status_code=200)
        return _error_response(_as_openai_error(EngineDead(
            f"engine is not running: {async_engine.dead_error!r}")))

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await _read_json(request, p.TokenizeRequest, max_body_bytes)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise p.bad_request("send exactly one of `prompt` or `messages`")
        if req.messages is not None:
            ids = await render_chat(req.messages, req.add_generation_prompt)
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await asyncio.to_thread(tokenizer().encode, req.prompt,
                                          add_special_tokens=add_special)
        return p.TokenizeResponse(count=len(ids), max_model_len=max_model_len,
                                  tokens=ids).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await _read_json(request, p.DetokenizeRequest, max_body_bytes)
        check_model(req.model)
        tok = tokenizer()
        if any(t < 0 or t >= tok.vocab_size for t in req.tokens):
            raise p.bad_request(f"token ids must be in [0, {tok.vocab_size})", "tokens")
        return p.DetokenizeResponse(prompt=tok.decode(req.tokens)).model_dump()

    app.include_router(v1)
    return app


def run_server(args: Any) -> None:
    """`dflash-engine serve`: build the engine from the flags, report capacity, serve."""
    import uvicorn

    from ..engine import LLMEngine
    from .cli_args import engine_kwargs

    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    spec = engine.config.speculative_config
    print(f"model: {engine.model_path}  max_model_len: {engine.max_model_len}  speculative: "
          + (f"dflash draft {spec.model}, {engine.num_speculative_tokens} tokens" if spec else "off")
          + f"  prefix caching: {'on' if engine.config.enable_prefix_caching else 'off'}")
    # KV pool (pages x tokens, GiB, what sized it), the memory budget behind it (CUDA: the
    # profile step), and the full-length concurrency it allows (kv_cache.MemoryReport).
    for line in engine.runner.memory.lines():
        print(line, flush=True)
    graphs = engine.runner.decode_graphs
    if graphs is not None:
        print("decode step: " + ("eager (--enforce-eager)" if graphs.enforce_eager else
              f"{len(graphs.graphs)} CUDA graphs (batch buckets {graphs.buckets}) captured in "
              f"{graphs.capture_seconds:.1f} s, {graphs.graph_bytes / 2**20:.0f} MiB"), flush=True)
    served = args.served_model_name or args.model_flag or args.model or engine.model_path.name
    app = build_app(AsyncLLMEngine(engine), served, api_key=args.api_key,
                    model_root=str(engine.model_path),
                    max_body_bytes=getattr(args, "max_request_body_bytes", None) or MAX_BODY_BYTES)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
