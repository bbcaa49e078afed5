"""OpenAI-compatible HTTP server: the engine client (in-process thread or engine process),
routes, metrics, CLI flags."""

from .api_server import build_app, run_server
from .async_engine import AsyncLLMEngine, EngineClient
from .engine_process import EngineProcessClient

__all__ = ["AsyncLLMEngine", "EngineClient", "EngineProcessClient", "build_app", "run_server"]
