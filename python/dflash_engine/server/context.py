"""ServerContext: the state every route shares, built once by ``build_app``.

Routes are module-level functions; they reach the engine, metrics and settings through
``app.state.ctx`` (the ``Ctx`` dependency below) rather than through a closure, so each
route file reads on its own and a test can build a context without a server.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from . import protocol as p
from .async_engine import EngineClient
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer


@dataclass(frozen=True)
class ServerContext:
    engine: EngineClient
    metrics: ServerMetrics
    served_model_name: str  # what /v1/models lists and responses name
    model_root: str  # the model's path; clients may send it as `model` too
    max_model_len: int
    max_body_bytes: int  # larger request bodies get a 413
    api_key: str | None  # when set, /v1/* needs `Authorization: Bearer <api_key>`
    fingerprint: str  # `system_fingerprint`: says "synthetic" when benchmark-only acceptance is on

    def check_model(self, name: str | None) -> None:
        """A request naming another model is a 404 (as OpenAI answers); no name is fine."""
        if name is not None and name not in (self.served_model_name, self.model_root):
            raise p.OpenAIError(404, f"the model `{name}` does not exist; this server serves "
                                f"`{self.served_model_name}`", param="model", code="model_not_found")

    def tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise p.bad_request("this model has no tokenizer; send token ids as the prompt")
        return self.engine.tokenizer


def server_context(request: Request) -> ServerContext:
    return request.app.state.ctx


Ctx = Annotated[ServerContext, Depends(server_context)]


async def check_api_key(request: Request, ctx: Ctx) -> None:
    """Router dependency of /v1/*: 401 unless the bearer token matches (constant time)."""
    if ctx.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), ctx.api_key.encode()):
        raise p.OpenAIError(401, "missing or invalid API key (send Authorization: Bearer ...)",
                            code="invalid_api_key")
