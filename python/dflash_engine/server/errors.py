"""Every failure as OpenAI's error body: one mapping from exception to status and shape.

Handlers raise ``protocol.OpenAIError`` (or let an engine exception through); the handlers
installed here turn whatever escapes a route, including Starlette's own 404/405, into
``{"error": {...}}`` with the matching status, so a client never sees another shape.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as p
from .async_engine import EngineDead, RequestAborted, RequestFailed

# What the engine side may raise for one request; everything else is a server bug (500).
ENGINE_ERRORS = (ValueError, RequestFailed, EngineDead, RequestAborted)


def error_response(err: p.OpenAIError) -> JSONResponse:
    return JSONResponse(p.ErrorResponse(error=err.info).model_dump(), status_code=err.status)


def as_openai_error(e: BaseException) -> p.OpenAIError:
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


async def _openai_error(_: Request, e: Exception) -> JSONResponse:
    return error_response(as_openai_error(e))


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if e.status_code < 500 else "server_error"
    return error_response(p.OpenAIError(e.status_code, str(e.detail), type=kind))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(p.OpenAIError, _openai_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _openai_error)
