"""Python-side view of one request: text, stop strings, streaming deltas, timings.

Token-level state (committed, bonus, pages) lives in the Rust core; this only keeps what
the user sees.
"""

from __future__ import annotations

import time

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer, TextPieces, Tokenizer, find_stop


class RequestState:
    def __init__(
        self,
        request_id: str,
        handle: int,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        tokenizer: Tokenizer | None,
        final_only: bool = False,
        delta: bool = False,
    ):
        self.request_id = request_id
        self.handle = handle
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.seed = seed
        self.token_ids: list[int] = []
        self.final_only = final_only  # no per-step outputs: one when it finishes
        # Each output carries only what is new (RequestOutputKind.DELTA): no copy of the history,
        # so an output costs the same at token 10 and at token 10,000.
        self.delta = delta and not final_only
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (set by the engine)
        # Text released to the user (`text`); `_held` is decoded text not released yet (a stop
        # string could still be completing there); `_new_text` the text released since the last
        # output. Appending never copies what came before.
        self._released = TextPieces()
        self._held = ""
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer else None
        self._stopped_by_string = False
        self._new_ids: list[int] = []
        self._new_text = TextPieces()
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.token_times: list[float] = []

    def append(self, new_ids: list[int]) -> bool:
        """Add committed tokens; returns True when a stop string ended the text."""
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
        self.token_ids.extend(new_ids)
        self._new_ids.extend(new_ids)
        if self._detok is None or self._stopped_by_string:
            return False
        self._add_text(self._detok.add_tokens(new_ids), final=False)
        return self._stopped_by_string

    @property
    def text(self) -> str:
        """The text released so far."""
        return str(self._released)

    def _add_text(self, delta: str, final: bool) -> None:
        # Newly decoded text joins what is held back; while a stop string could still be
        # completing, its possible prefix (the last max-stop-length - 1 characters) stays held.
        # A stop match never starts in released text: what was released lies at least that far
        # before the end of the text decoded then, and a match must reach into the new text.
        pending = self._held + delta
        release = len(pending)
        stops = self.params.stop_list
        if stops:
            idx = find_stop(pending, stops, start=len(self._held))
            if idx is not None:
                self._stopped_by_string = True
                release = idx
            elif not final:
                release = max(0, release - (max(map(len, stops)) - 1))
        released, self._held = pending[:release], pending[release:]
        self._released.append(released)
        self._new_text.append(released)

    def output(self, finish_reason: str | None = None, error: str | None = None) -> RequestOutput:
        new_text = str(self._new_text)
        if self.delta:
            completion = CompletionOutput(0, new_text, self._new_ids, finish_reason)
        else:
            completion = CompletionOutput(0, self.text, list(self.token_ids), finish_reason)
        out = RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=finish_reason is not None,
            new_token_ids=self._new_ids,
            new_text=new_text,
            error=error,
            metrics={
                "arrival_time": self.arrival_time,
                "first_token_time": self.first_token_time,
                "token_times": self.token_times,
            },
            num_cached_tokens=self.num_cached_tokens,
        )
        self._new_ids, self._new_text = [], TextPieces()
        return out

    def finish(self, reason: str, error: str | None = None) -> RequestOutput:
        if self._detok is not None and not self._stopped_by_string:
            self._add_text(self._detok.flush(), final=True)
        return self.output(reason, error)
