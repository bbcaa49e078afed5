"""Live servers for the server tests: real uvicorn on 127.0.0.1, real engine, tiny models.

Servers are cached per configuration for the whole session (pytest would otherwise build
one per importing module); tests that break or rewire an engine ask for a fresh one.
"""
from __future__ import annotations

import atexit
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from tiny_models import make_tiny_dflash_draft, make_tiny_qwen3

from dflash_engine.server import AsyncLLMEngine, build_app

MODEL_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 256
NUM_SPEC_TOKENS = 4


class LiveServer:
    def __init__(self, engine: Any, api_key: str | None = None, async_engine: AsyncLLMEngine | None = None) -> None:
        """`async_engine`: one built already (AsyncLLMEngine.build), else one around `engine`."""
        self.async_engine = async_engine or AsyncLLMEngine(engine)
        self.engine = self.async_engine.engine
        app = build_app(self.async_engine, MODEL_NAME, api_key=api_key, model_root="/models/tiny")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """Wait until the engine holds no request; return its stats then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.async_engine.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


_dirs: dict[str, Path] = {}
_servers: dict[str, LiveServer] = {}


def tiny_model_dirs(root: Path) -> tuple[Path, Path]:
    if not _dirs:
        # Room past MAX_MODEL_LEN for the humaneval bench test's longer prompts.
        target = make_tiny_qwen3(root / "target", max_position_embeddings=4096)
        _dirs["target"] = target
        _dirs["draft"] = make_tiny_dflash_draft(root / "draft", target, block_size=NUM_SPEC_TOKENS + 1)
    return _dirs["target"], _dirs["draft"]


def tiny_hybrid_dirs(root: Path) -> tuple[Path, Path]:
    """A tiny Qwen3.5 hybrid target (GDN + attention) and an untrained draft for it."""
    if "hybrid_target" not in _dirs:
        from tiny_hybrid import make_tiny_hybrid_draft, make_tiny_qwen3_5
        from tiny_models import make_tiny_tokenizer

        target, _ = make_tiny_qwen3_5(root / "hybrid_target")
        make_tiny_tokenizer(target, 300)
        _dirs["hybrid_target"] = target
        _dirs["hybrid_draft"] = make_tiny_hybrid_draft(root / "hybrid_draft", target, block_size=NUM_SPEC_TOKENS + 1)
    return _dirs["hybrid_target"], _dirs["hybrid_draft"]


def make_engine(root: Path, spec: bool, hybrid: bool = False, **overrides: Any) -> Any:
    """hybrid: the tiny Qwen3.5 target (recurrent-state slots in the pool) instead of the tiny Qwen3."""
    from dflash_engine.engine import LLMEngine

    target, draft = tiny_hybrid_dirs(root) if hybrid else tiny_model_dirs(root)
    spec_cfg = ({"method": "dflash", "model": str(draft), "num_speculative_tokens": NUM_SPEC_TOKENS}
                if spec else None)
    kwargs = dict(model=str(target), speculative_config=spec_cfg, max_num_seqs=8,
                  max_model_len=MAX_MODEL_LEN, dtype="float32", device="cpu", num_gpu_blocks_override=128)
    return LLMEngine.from_kwargs(**{**kwargs, **overrides})


def shared_server(root: Path, spec: bool) -> LiveServer:
    key = f"spec={spec}"
    if key not in _servers:
        _servers[key] = LiveServer(make_engine(root, spec))
    return _servers[key]


@atexit.register
def _stop_all() -> None:
    for server in _servers.values():
        server.stop()


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_server_models")


@pytest.fixture()
def spec_off_server(models_root: Path) -> LiveServer:
    return shared_server(models_root, spec=False)


@pytest.fixture()
def spec_on_server(models_root: Path) -> LiveServer:
    return shared_server(models_root, spec=True)


@pytest.fixture()
def fresh_server(models_root: Path):
    """A server of its own (spec on) for tests that rewire or break its engine."""
    servers: list[LiveServer] = []

    def start(**kwargs: Any) -> LiveServer:
        api_key = kwargs.pop("api_key", None)
        servers.append(LiveServer(make_engine(models_root, spec=True, **kwargs), api_key=api_key))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()
