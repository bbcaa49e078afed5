"""One request through the engine: generate, watch for a disconnect, answer whole or streamed.

The engine sends each output's news only (RequestOutputKind.DELTA, set by request_parsing):
a whole answer gathers the text and counts the tokens as they come, so no output copies the
request's history. A streamed request is answered only once its first output (or its error)
exists, so an engine-side refusal is still a 400 rather than an error inside a 200. Once the stream's
headers are sent, an error travels inside the stream as an error event. A client that
disconnects aborts its own request (by the internal id its connection minted), nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from . import protocol as p
from .async_engine import EngineClient
from .errors import ENGINE_ERRORS, as_openai_error
from .response_shapes import CompletionShape, sse


async def _abort_on_disconnect(request: Request, engine: EngineClient, request_id: str) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(request_id)


async def serve(engine: EngineClient, request: Request, request_id: str, client_id: str | None,
                prompt_ids: list[int], prompt: str | None, params: SamplingParams,
                req: p.SamplingFields, shape: CompletionShape) -> Response:
    """Run the request and answer it; until the stream takes over, this owns the cleanup."""
    outputs = engine.generate(request_id, prompt_ids, params, prompt, client_id)
    watcher = asyncio.create_task(_abort_on_disconnect(request, engine, request_id))
    handed_over = False
    try:
        first = await anext(outputs)
        if req.stream:
            handed_over = True
            return StreamingResponse(_stream(first, outputs, watcher, req.include_usage, shape),
                                     media_type="text/event-stream")
        final, texts, n = first, [first.new_text], len(first.new_token_ids)
        async for final in outputs:  # the outputs are deltas: gather the text, count the tokens
            texts.append(final.new_text)
            n += len(final.new_token_ids)
        return JSONResponse(shape.full(final, "".join(texts), n).model_dump())
    except ENGINE_ERRORS as e:
        err = as_openai_error(e)
        if shape.prompt_param != "prompt" and err.info.param == "prompt":
            err.info.param = shape.prompt_param  # a chat's prompt is its messages
        raise err from None
    finally:
        if not handed_over:
            watcher.cancel()
            await outputs.aclose()


async def _stream(first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None],
                  watcher: asyncio.Task[None], include_usage: bool,
                  shape: CompletionShape) -> AsyncIterator[str]:
    try:
        for chunk in shape.head():
            yield sse(chunk)
        out, n = first, 0
        while True:
            n += len(out.new_token_ids)
            c = out.outputs[0]
            if out.new_text or out.finished:
                finish = c.finish_reason if out.finished else None
                yield sse(shape.chunk(out.new_text, finish, c.stop_reason if finish else None))
            if out.finished:
                break
            out = await anext(outputs)
        if include_usage:
            yield sse(shape.usage_chunk(out, n))
    except Exception as e:  # noqa: BLE001  (headers are sent: the error goes in the stream)
        yield sse(p.ErrorResponse(error=as_openai_error(e).info))
    finally:
        watcher.cancel()
        await outputs.aclose()
    yield "data: [DONE]\n\n"
