"""OpenAI-compatible HTTP server: async engine loop, routes, metrics, CLI flags."""

from .api_server import build_app, run_server
from .async_engine import AsyncLLMEngine

__all__ = ["AsyncLLMEngine", "build_app", "run_server"]
