"""The OpenAI-compatible HTTP server: a FastAPI app over an EngineClient, and `serve`.

The app is assembled here and nothing else: the routes live in routes_openai.py (/v1/*) and
routes_vllm.py (health, metrics, tokenize); the state they share is one ServerContext
(context.py) on ``app.state.ctx``; errors take OpenAI's shape through errors.py; request ids
and the ``X-Request-Id`` echo are request_ids.py's.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from . import routes_openai, routes_vllm
from .async_engine import AsyncLLMEngine, EngineClient
from .context import ServerContext
from .errors import install_error_handlers
from .metrics import ServerMetrics
from .request_ids import EchoRequestId

MAX_BODY_BYTES = 4 * 1024 * 1024


def build_app(
    async_engine: EngineClient,
    served_model_name: str,
    api_key: str | None = None,
    max_model_len: int | None = None,
    model_root: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app serving ``async_engine`` as ``served_model_name``; it starts the engine when
    the server starts and stops it when the server stops."""
    synthetic = async_engine.synthetic_acceptance
    metrics = ServerMetrics(served_model_name, async_engine.stats, synthetic=synthetic)
    async_engine.metrics = metrics  # latency histograms are observed as outputs arrive
    ctx = ServerContext(
        engine=async_engine,
        metrics=metrics,
        served_model_name=served_model_name,
        model_root=model_root or served_model_name,
        max_model_len=max_model_len or async_engine.max_model_len,
        max_body_bytes=max_body_bytes,
        api_key=api_key,
        fingerprint="dflash-engine-synthetic-acceptance" if synthetic else "dflash-engine",
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        async_engine.shutdown()  # the engine stops after at most one step

    app = FastAPI(title="dflash-engine", lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(EchoRequestId)
    install_error_handlers(app)
    app.include_router(routes_vllm.router)
    app.include_router(routes_openai.router)
    return app


def run_server(args: argparse.Namespace) -> None:
    """`dflash-engine serve`: build the engine from the flags, report capacity, serve."""
    import uvicorn

    from ..cli_args import engine_kwargs
    from .engine_process import EngineProcessClient

    kwargs = engine_kwargs(args)
    async_engine: EngineClient
    if args.disable_frontend_multiprocessing or kwargs.get("distributed_executor_backend") == "external_launcher":
        # One process: the engine on a thread of its own (built there; torchrun's rank 0 must
        # keep the engine in the process torchrun started).
        from ..engine import LLMEngine

        async_engine = AsyncLLMEngine.build(lambda: LLMEngine.from_kwargs(**kwargs))
    else:
        async_engine = EngineProcessClient.build(kwargs)
    for line in async_engine.startup_report():
        print(line, flush=True)
    served = args.served_model_name or args.model_flag or args.model or Path(async_engine.model_path).name
    app = build_app(async_engine, served, api_key=args.api_key,
                    model_root=async_engine.model_path,
                    max_body_bytes=args.max_request_body_bytes or MAX_BODY_BYTES)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
