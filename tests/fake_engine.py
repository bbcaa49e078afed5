"""A stand-in for LLMEngine that follows docs/INTERFACES.md (server development only)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from dflash_engine.outputs import CompletionOutput, RequestOutput
from dflash_engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=lambda: [0, 0, 0])
    prompt_tokens: int = 0
    generation_tokens: int = 0


class NoFaults:
    def step(self, request_ids):
        pass

    def request(self, request_id):
        pass


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: object
    prompt: str | None
    detok: IncrementalDetokenizer
    out_ids: list[int] = field(default_factory=list)
    text: str = ""


class FakeEngine:
    PAGE, PAGES = 16, 64

    def __init__(self, tokenizer_dir, max_model_len=256, max_num_seqs=4):
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.config = SimpleNamespace(max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        self.fault_injector = NoFaults()
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self._stats = FakeStats()

    def add_request(self, request_id, prompt_token_ids, params, prompt=None):
        if len(prompt_token_ids) + (params.max_tokens or 0) > self.config.max_model_len:
            raise ValueError("too long")
        if any(t >= self.tokenizer.vocab_size for t in prompt_token_ids):
            raise ValueError("token id out of range")
        self.waiting.append(_Req(request_id, prompt_token_ids, params, prompt,
                                 IncrementalDetokenizer(self.tokenizer, prompt_token_ids)))

    def abort_request(self, request_id):
        self.waiting = [r for r in self.waiting if r.rid != request_id]
        self.running = [r for r in self.running if r.rid != request_id]

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def _out(self, r, new_ids, new_text, finish=None, error=None):
        return RequestOutput(r.rid, r.prompt, r.prompt_ids,
                             [CompletionOutput(0, r.text, list(r.out_ids), finish)],
                             finished=finish is not None, new_token_ids=new_ids,
                             new_text=new_text, error=error)

    def step(self):
        time.sleep(0.003)  # a step takes time, as a real one does
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            r = self.waiting.pop(0)
            self._stats.prompt_tokens += len(r.prompt_ids)
            self.running.append(r)
        outs = []
        try:
            self.fault_injector.step([r.rid for r in self.running])
        except Exception as e:
            outs = [self._out(r, [], "", "error", repr(e)) for r in self.running]
            self.running = []
            return outs
        for r in list(self.running):
            try:
                self.fault_injector.request(r.rid)
            except Exception as e:
                self.running.remove(r)
                outs.append(self._out(r, [], "", "error", repr(e)))
                continue
            last = (r.prompt_ids + r.out_ids)[-1]
            tok = 97 + (last * 7 + len(r.out_ids) * 3) % 26
            if len(r.out_ids) % 5 == 4:
                tok = 32
            r.out_ids.append(tok)
            self._stats.generation_tokens += 1
            delta = r.detok.add_tokens([tok])
            start = len(r.text)
            r.text += delta
            finish = None
            if tok in r.params.stop_token_ids:
                finish = "stop"
            elif (idx := find_stop(r.text, r.params.stop_list, start)) is not None:
                delta = r.text[start:idx] if idx >= start else ""
                r.text = r.text[:idx]
                finish = "stop"
            elif len(r.out_ids) >= r.params.max_tokens:
                finish = "length"
            if finish:
                self.running.remove(r)
            outs.append(self._out(r, [tok], delta, finish))
        return outs

    def stats(self):
        s = self._stats
        s.num_running, s.num_waiting = len(self.running), len(self.waiting)
        pages = sum(math.ceil((len(r.prompt_ids) + len(r.out_ids)) / self.PAGE) for r in self.running)
        s.kv_cache_usage = pages / self.PAGES
        return FakeStats(**vars(s))
