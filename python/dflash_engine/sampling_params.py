"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

``validate`` is the one place that decides what the engine can represent: every field is
type-checked and bounded so that building a step's sampling tensors (int64 / float32)
can never fail because of what one request carries. A failure raises
``InvalidSamplingParamError`` naming the field (the server answers 400 with ``param``).
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# Far above any useful temperature (sampling is uniform long before), far below float32's max.
MAX_TEMPERATURE = 1e4
# Stop strings are searched in every new piece of text on the engine thread: keep it bounded.
MAX_STOP_STRINGS = 128


class InvalidSamplingParamError(ValueError):
    """A sampling parameter the engine cannot honour; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class RequestOutputKind(enum.IntEnum):
    """What each of a request's outputs carries (vLLM's names and values).

    - CUMULATIVE: every output holds the whole text and token ids so far (the default).
    - DELTA: each output's ``CompletionOutput`` holds only what is new since the previous
      output; the last one carries the finish reason. The per-step cost of a long stream stays
      flat: nothing is copied from the request's history (the server streams this way).
    - FINAL_ONLY: no output until the request finishes, then one with everything.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    detokenize: bool = True  # False: token ids only (output text ""; no stop strings)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_list: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        elif self.stop is None:
            self.stop_list = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop_list = list(self.stop)
        else:
            raise InvalidSamplingParamError(
                "stop", f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise InvalidSamplingParamError(
                "stop_token_ids",
                f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}")
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field; with ``vocab_size``, token ids must lie in [0, vocab_size).

        Normalises numeric types in place (numpy scalars become ``int`` / ``float``).
        Raises ``InvalidSamplingParamError`` (a ``ValueError``) with ``param`` set.
        """

        def bad(param: str, msg: str) -> InvalidSamplingParamError:
            return InvalidSamplingParamError(param, msg)

        def real(param: str, value: object, lo: float, hi: float, lo_open: bool = False) -> float:
            if not _is_real(value):
                raise bad(param, f"{param} must be a number, got {value!r}")
            v = float(value)  # type: ignore[arg-type]
            if not math.isfinite(v):
                raise bad(param, f"{param} must be a finite number, got {value!r}")
            if v < lo or v > hi or (lo_open and v == lo):
                rng = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
                raise bad(param, f"{param} must be in {rng}, got {value!r}")
            return v

        def integer(param: str, value: object, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
            if not _is_int(value):
                raise bad(param, f"{param} must be an integer, got {value!r}")
            v = int(value)  # type: ignore[arg-type]
            if not lo <= v <= hi:
                raise bad(param, f"{param} must be in [{lo}, {hi}], got {v}")
            return v

        self.temperature = real("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        self.top_p = real("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        top_k = integer("top_k", self.top_k)
        if top_k < -1:
            raise bad("top_k", f"top_k must be -1 or 0 (off) or >= 1, got {top_k}")
        self.top_k = top_k
        self.min_p = real("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None:
            self.max_tokens = integer("max_tokens", self.max_tokens, 1)
        if not _is_int(self.n) or self.n != 1:
            raise bad("n", f"only n=1 is supported, got n={self.n!r}")
        if len(self.stop_list) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop_list)}")
        if any(not isinstance(s, str) or s == "" for s in self.stop_list):
            raise bad("stop", "stop strings must be non-empty strings")
        hi = INT64_MAX if vocab_size is None else vocab_size - 1
        ids = self.stop_token_ids or []
        for t in ids:
            if not _is_int(t) or not 0 <= t <= hi:
                where = "" if vocab_size is None else f" (the vocabulary has {vocab_size} tokens)"
                raise bad("stop_token_ids", f"stop_token_ids must be integers in [0, {hi}]{where}, got {t!r}")
        self.stop_token_ids = [int(t) for t in ids]
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", f"detokenize must be a boolean, got {self.detokenize!r}")
        if not self.detokenize and self.stop_list:
            raise bad("stop", "stop strings need detokenize=True (they are matched in the text)")
        if self.seed is not None:
            self.seed = integer("seed", self.seed)
        if not _is_int(self.output_kind) or self.output_kind not in tuple(RequestOutputKind):
            names = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
            raise bad("output_kind", f"output_kind must be a RequestOutputKind: {names}; got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)

    def effective_top_k(self, vocab_size: int) -> int:
        """top_k as the sampler applies it: -1 / 0 (off) and anything above the vocabulary
        mean the whole vocabulary (as vLLM clamps it)."""
        if self.top_k <= 0:
            return vocab_size
        return min(self.top_k, vocab_size)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
