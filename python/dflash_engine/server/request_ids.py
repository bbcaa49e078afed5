"""Request ids: a fresh internal id per HTTP request; the client's ``X-Request-Id`` echoed.

Every HTTP request gets an internal id minted here (``cmpl-<uuid4 hex>`` /
``chatcmpl-<uuid4 hex>``); that id is what the engine sees, and a disconnect aborts only the
id of its own connection. A client's ``X-Request-Id`` is never used to look anything up: it
is only echoed back (response header, and the response's ``id`` field).
"""

from __future__ import annotations

import uuid

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import protocol as p

MAX_REQUEST_ID_CHARS = 128
_ECHO_ID = "dflash_x_request_id"  # request.state key: the id echoed in the response header


def client_request_id(request: Request) -> str | None:
    """The client's X-Request-Id, if any: only ever echoed back, never used as a key."""
    given = request.headers.get("x-request-id")
    if given is None:
        return None
    if not (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isprintable()):
        raise p.bad_request(f"X-Request-Id must be 1-{MAX_REQUEST_ID_CHARS} printable characters",
                            "X-Request-Id")
    return given


def request_ids(prefix: str, request: Request) -> tuple[str, str, str | None]:
    """(internal id, response id, client id). The internal id is always fresh; the response
    id (the body's ``id``) is ``<prefix>-<X-Request-Id>`` when the client sent one, as vLLM
    does, else the internal id."""
    internal = f"{prefix}-{uuid.uuid4().hex}"
    given = client_request_id(request)
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
                if echo is None:  # no handler minted one (a 404, a bad key): the client's, if sane
                    given = dict(scope.get("headers") or ()).get(b"x-request-id")
                    if given is not None and 0 < len(given) <= MAX_REQUEST_ID_CHARS:
                        text = given.decode("latin-1")
                        echo = text if text.isprintable() else None
                if echo is not None:
                    headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                    message = {**message, "headers": [*headers, (b"x-request-id", echo.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)
