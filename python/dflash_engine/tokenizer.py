"""Tokenizer wrapper: tokenizer.json + tokenizer_config.json (chat template, special tokens).

The chat template is looked up as ``transformers`` does for a tokenizer: a
``chat_template.jinja`` file (how current Hugging Face tooling saves it) overrides the
``chat_template`` entry of tokenizer_config.json; a legacy processor
``chat_template.json`` (``{"chat_template": ...}``) is used when neither has one.

Mirrors the parts of Hugging Face's ``PreTrainedTokenizerFast`` the engine needs, without
depending on ``transformers``: encode/decode, EOS ids, chat-template rendering, and an
incremental detokenizer for streaming.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


CHAT_TEMPLATE_FILE = "chat_template.jinja"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_chat_template(path: Path, config: dict[str, Any]) -> Any:
    """The template (a string, or HF's list of named templates) for the directory ``path``
    whose tokenizer_config.json is ``config``, in transformers' order of precedence."""
    jinja_file = path / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():  # transformers: "take priority over ... the tokenizer config"
        return jinja_file.read_text(encoding="utf-8")
    if config.get("chat_template") is not None:
        return config["chat_template"]
    legacy = _read_json(path / LEGACY_CHAT_TEMPLATE_FILE)
    return legacy.get("chat_template")


def _token_content(tok: Any) -> str | None:
    """Special tokens in tokenizer_config.json are either strings or AddedToken dicts."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class Tokenizer:
    def __init__(
        self,
        tokenizer: _HFTokenizer,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        model_config: dict[str, Any] | None = None,
        special_tokens_map: dict[str, Any] | None = None,
    ) -> None:
        self._tok = tokenizer
        config = dict(config or {})
        # tokenizer_config.json wins over special_tokens_map.json, as in HF.
        for key, value in (special_tokens_map or {}).items():
            config.setdefault(key, value)
        self.config = config
        self.chat_template: str | None = self._pick_chat_template(config.get("chat_template"))
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))

        eos_ids: list[int] = []
        if (tid := self._id_of(self.eos_token)) is not None:
            eos_ids.append(tid)
        eos_ids += _as_id_list((generation_config or {}).get("eos_token_id"))
        eos_ids += _as_id_list((model_config or {}).get("eos_token_id"))
        # Primary EOS: the tokenizer's own, else the first one the configs name.
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self.eos_token_ids: set[int] = set(eos_ids)
        if self.bos_token_id is None:
            bos = _as_id_list((generation_config or {}).get("bos_token_id")) or _as_id_list(
                (model_config or {}).get("bos_token_id")
            )
            self.bos_token_id = bos[0] if bos else None
            if self.bos_token is None and self.bos_token_id is not None:
                self.bos_token = self._tok.id_to_token(self.bos_token_id)
        self._template_cache: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        config = _read_json(path / "tokenizer_config.json")
        template = _read_chat_template(path, config)
        if template is not None:
            config = {**config, "chat_template": template}
        return cls(
            _HFTokenizer.from_file(str(tj)),
            config=config,
            generation_config=_read_json(path / "generation_config.json"),
            model_config=_read_json(path / "config.json"),
            special_tokens_map=_read_json(path / "special_tokens_map.json"),
        )

    @staticmethod
    def _pick_chat_template(tpl: Any) -> str | None:
        # Some configs store a list of named templates; HF uses the one named "default".
        if isinstance(tpl, list):
            named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
            return named.get("default")
        return tpl if isinstance(tpl, str) else None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The tokenizer.json post-processor (if any) is disabled so that BOS/EOS follow the
        # config flags exactly, which is what HF's fast tokenizers do for Llama-style configs.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                if not ids or ids[0] != self.bos_token_id:
                    ids = [self.bos_token_id] + ids
            if self.add_eos_token and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (none in chat_template.jinja, "
                "tokenizer_config.json or chat_template.json); send a plain prompt instead"
            )
        if self._template_cache is None:
            self._template_cache = _jinja_env().from_string(self.chat_template)
        return self._template_cache

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        _validate_messages(messages)
        template = self._compiled_template()
        try:
            text = template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e
        if tokenize:
            # The template already places BOS where it belongs.
            return self.encode(text, add_special_tokens=False)
        return text


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{i}] has unknown role {role!r}; allowed: {sorted(CHAT_ROLES)}"
            )
        # Assistant turns that only carry tool calls may have no content.
        if "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson: unlike jinja's built-in, it does not HTML-escape.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment HF's ``apply_chat_template`` renders in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class TextPieces:
    """Text built by appending: the pieces are joined only when the whole is read, so appending
    never copies what came before (a long stream costs the same per token at its end as at
    its start)."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[str] = []

    def append(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)

    def __str__(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


class IncrementalDetokenizer:
    """Per-request streaming detokenizer.

    Decodes a sliding window (prefix offset .. end) and emits only the text past the part
    already emitted. A trailing U+FFFD means a multi-byte character is still split across
    tokens, so that output is held back until a later token completes it. ``text`` always
    equals ``decode(all ids)`` once the stream ends (call ``flush`` to release a dangling
    incomplete character at the end).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._emitted = TextPieces()
        # Start the window a few prompt tokens back so the first token decodes in context
        # (e.g. SentencePiece leading-space handling); those tokens are never emitted.
        # `_all` = those context tokens + every generated id, extended in place: a step
        # decodes two short windows of it, never copying the whole history.
        self._all: list[int] = list(prompt_ids[-5:]) if prompt_ids else []
        self._num_ctx = len(self._all)
        self._prefix = 0  # window start (index into _all)
        self._read = self._num_ctx  # everything before this index has been emitted

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return str(self._emitted)

    @property
    def ids(self) -> list[int]:
        """The generated ids fed so far (a copy)."""
        return self._all[self._num_ctx:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_ids: list[int]) -> str:
        """Feed newly generated token ids; return the newly completed text."""
        all_ids = self._all
        all_ids.extend(new_ids)
        prefix_text = self._decode(all_ids[self._prefix : self._read])
        full = self._decode(all_ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self._prefix, self._read = self._read, len(all_ids)
            self._emitted.append(delta)
            return delta
        return ""

    def flush(self) -> str:
        """End of stream: emit whatever is still held back (may contain U+FFFD)."""
        all_ids = self._all
        prefix_text = self._decode(all_ids[self._prefix : self._read])
        full = self._decode(all_ids[self._prefix :])
        delta = full[len(prefix_text) :]
        self._prefix, self._read = self._read, len(all_ids)
        self._emitted.append(delta)
        return delta


def find_stop(text: str, stop_strings: list[str], start: int = 0) -> int | None:
    """Index of the earliest stop string in ``text`` that ends at or after ``start``.

    ``start`` is where new text begins; a new match may straddle the boundary, so the
    search begins ``len(stop) - 1`` characters earlier. Returns None if nothing matches.
    """
    best: int | None = None
    for stop in stop_strings:
        if not stop:
            continue
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best
