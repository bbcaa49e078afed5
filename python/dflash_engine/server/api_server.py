"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLMEngine, and `serve`.

The app is assembled here and nothing else: the routes live in routes_openai.py (/v1/*) and
routes_vllm.py (health, metrics, tokenize); the state they share is one ServerContext
(context.py) on ``app.state.ctx``; errors take OpenAI's shape through errors.py; request ids
and the ``X-Request-Id`` echo are request_ids.py's.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI

from . import routes_openai, routes_vllm
from .async_engine import AsyncLLMEngine
from .context import ServerContext
from .errors import install_error_handlers
from .metrics import ServerMetrics
from .request_ids import EchoRequestId

if TYPE_CHECKING:
    from ..engine import LLMEngine

MAX_BODY_BYTES = 4 * 1024 * 1024


def build_app(
    async_engine: AsyncLLMEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_model_len: int | None = None,
    model_root: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The app serving ``async_engine`` as ``served_model_name``; it starts the engine thread
    when the server starts and joins it when the server stops."""
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
        async_engine.shutdown()  # joins the engine thread: at most one step

    app = FastAPI(title="dflash-engine", lifespan=lifespan)
    app.state.ctx = ctx
    app.add_middleware(EchoRequestId)
    install_error_handlers(app)
    app.include_router(routes_vllm.router)
    app.include_router(routes_openai.router)
    return app


def _prefix_caching(engine: LLMEngine) -> str:
    """on / off, as the engine runs it (a hybrid target turns a requested cache off)."""
    if engine.runtime_config.enable_prefix_caching:
        return "on"
    return "off (not supported for hybrid targets)" if engine.config.enable_prefix_caching else "off"


def _startup_report(engine: LLMEngine) -> list[str]:
    """What `serve` prints before it listens: the model and speculation, the KV pool (pages x
    tokens, GiB, what sized it), the memory budget behind it (CUDA: the profile step), the
    full-length concurrency it allows (worker/memory.py), and the decode graphs."""
    spec = engine.config.speculative_config
    lines = [f"model: {engine.model_path}  max_model_len: {engine.max_model_len}  speculative: "
             + (f"dflash draft {spec.model}, {engine.num_speculative_tokens} tokens" if spec else "off")
             + f"  prefix caching: {_prefix_caching(engine)}"]
    lines += engine.runner.memory.lines()
    runners = engine.runner.graphs  # one decode-graph runner per verify block B; none on CPU
    if runners and all(g.enforce_eager for g in runners.values()):
        lines.append("decode step: eager (--enforce-eager)")
    elif runners:
        num_graphs = sum(len(g.graphs) for g in runners.values())
        seconds = sum(g.capture_seconds for g in runners.values())
        buckets = {b: g.capture_buckets for b, g in runners.items()}
        mixed = next(iter(runners.values())).token_buckets
        lines.append(f"decode step: {num_graphs} CUDA graphs (batch buckets per verify block B: {buckets}; mixed "
                     f"steps: prefill-token buckets {mixed or 'none, eager'}) captured in {seconds:.1f} s, "
                     f"{engine.runner.memory.graph_bytes / 2**20:.0f} MiB")
    return lines


def run_server(args: argparse.Namespace) -> None:
    """`dflash-engine serve`: build the engine from the flags, report capacity, serve."""
    import uvicorn

    from ..cli_args import engine_kwargs
    from ..engine import LLMEngine

    kwargs = engine_kwargs(args)
    async_engine = AsyncLLMEngine.build(lambda: LLMEngine.from_kwargs(**kwargs))  # built on its own thread
    engine = async_engine.engine
    for line in _startup_report(engine):
        print(line, flush=True)
    served = args.served_model_name or args.model_flag or args.model or engine.model_path.name
    app = build_app(async_engine, served, api_key=args.api_key,
                    model_root=str(engine.model_path),
                    max_body_bytes=args.max_request_body_bytes or MAX_BODY_BYTES)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
