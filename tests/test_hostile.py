"""Hostile requests among normal ones (issue 8).

A seeded generator (``random.Random(SEED)``; set DFLASH_HOSTILE_SEED to explore other
seeds) mutates valid requests into hostile ones: wrong types, huge and negative numbers,
NaN / Infinity, out-of-vocabulary token ids, reused X-Request-Ids, oversized bodies, broken
JSON and UTF-8, abandoned streams and bodies. They are injected at random moments among
normal greedy requests on a DFlash server with a KV pool small enough to force preemption.
Every normal request must produce exactly its output when run alone; every hostile one a
4xx in OpenAI's error shape naming the field (or a clean 200 where its input is valid);
nothing a 5xx; and afterwards the pool drains to zero.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import pytest
import server_fixtures
from server_fixtures import MAX_MODEL_LEN, MODEL_NAME

from dflash_engine.sampling_params import INT64_MAX, INT64_MIN, MAX_TEMPERATURE
from dflash_engine.server import build_app

SEED = int(os.environ.get("DFLASH_HOSTILE_SEED", "8"))
N_NORMAL = 8
N_HOSTILE = 100
BODY_LIMIT = 64 * 1024  # this test's server: small, so oversized bodies stay cheap
POOL_PAGES = 24  # 16-token pages: 8 running requests cannot all fit, so some are preempted
SHARED_IDS = ["shared-a", "shared-b", "shared-c"]  # X-Request-Ids normal requests also send
# During the storm every engine step first sleeps this long, so that on a fast machine the
# requests (arriving over NORMAL_WINDOW / HOSTILE_WINDOW seconds) still overlap in the engine.
STEP_PAUSE = 0.015
NORMAL_WINDOW, HOSTILE_WINDOW = 0.3, 0.8
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()

# ---- generation --------------------------------------------------------------------------


@dataclass
class Case:
    kind: str
    path: str = "v1/completions"
    method: str = "POST"
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    # "4xx": refused (status, param: the exact status and `param` when known);
    # "200": must be served cleanly (the oracle found its input valid); "abandon": the client
    # hangs up, and any answer it saw must not be an error.
    expect: str = "4xx"
    status: int | None = None
    param: str | None = None
    stream: bool = False
    chunked: bool = False  # send the body without Content-Length
    hangup_after: int = 0  # abandon: SSE events to read first (-1: hang up mid-body)
    delay: float = 0.0
    expected_text: str | None = None  # normal requests: their output when run alone

    def describe(self) -> str:
        return f"[seed {SEED}] {self.kind} {self.method} /{self.path} {self.body[:200]!r}"


def _text(rng: random.Random, lo: int = 2, hi: int = 8) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _valid(rng: random.Random, vocab: int, max_tokens: int | None = None) -> tuple[str, dict]:
    """A valid greedy request: (path, body)."""
    mt = max_tokens if max_tokens is not None else rng.randint(1, 4)
    kind = rng.randrange(3)
    if kind == 0:
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": _text(rng), "max_tokens": mt}
        path = "v1/completions"
    elif kind == 1:
        ids = [rng.randrange(vocab) for _ in range(rng.randint(2, 12))]
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": mt}
        path = "v1/completions"
    else:
        body = {"model": MODEL_NAME, "max_tokens": mt,
                "messages": [{"role": "user", "content": _text(rng)}]}
        path = "v1/chat/completions"
    body["temperature"] = 0
    return path, body


FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]
INT_FIELDS = ["top_k", "seed", "n", "max_tokens"]
TYPED_FIELDS = {
    **{f: "float" for f in FLOAT_FIELDS}, **{f: "int" for f in INT_FIELDS},
    "stop": "stop", "stop_token_ids": "ids", "ignore_eos": "bool", "stream": "bool",
    "model": "str", "stream_options": "obj",
}


def _wrong_value(rng: random.Random, kind: str) -> Any:
    s = "".join(rng.choice("abc019.-e ") for _ in range(rng.randint(0, 6)))
    pools = {
        "float": [s, [rng.random()], {"v": rng.random()}, rng.random() < 0.5, str(rng.random())],
        "int": [s, rng.randint(-99, 99) + 0.5, [rng.randint(0, 9)], True, {}, str(rng.randint(0, 99))],
        "bool": [rng.randint(0, 1), "true", [], rng.random()],
        "str": [rng.randint(0, 9), [s], {"name": s}, True],
        "stop": [rng.randint(0, 9), [rng.randint(0, 9)], {"s": s}, [None], True],
        "ids": [s, [rng.random() + 0.5], [[rng.randint(0, 9)]], {"0": 1}, rng.randint(0, 9), [True]],
        "obj": [rng.randint(0, 9), s, {"include_usage": s}, [True]],
        "prompt": [rng.randint(0, 9), {"text": s}, [rng.random() + 0.5], True, [None]],
        "messages": [s, {"role": "user", "content": s}, [rng.randint(0, 9)], [{"content": s}],
                     [{"role": rng.randint(0, 9), "content": s}], [{"role": "user", "content": 7}]],
    }
    return rng.choice(pools[kind])


def wrong_type(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    fields = dict(TYPED_FIELDS)
    if "prompt" in body:
        fields["prompt"] = "prompt"
    else:
        fields.update(messages="messages", max_completion_tokens="int")
    name = rng.choice(sorted(fields))
    body[name] = _wrong_value(rng, fields[name])
    return Case("wrong-type", path, body=json.dumps(body).encode(), status=400, param=name)


def _number(rng: random.Random) -> int | float:
    sign = rng.choice([1, -1])
    return rng.choice([
        lambda: sign * (2 ** rng.randint(63, 200) + rng.randint(0, 999)),
        lambda: rng.choice([INT64_MAX, INT64_MAX + 1, INT64_MIN, INT64_MIN - 1, 2**64]),
        lambda: -rng.randint(1, 10**6),
        lambda: 0,
        lambda: sign * 10 ** rng.uniform(4.5, 308),
        lambda: rng.random(),
        lambda: rng.randint(1, 6),
    ])()


def _number_verdict(name: str, v: int | float) -> tuple[str, str | None]:
    """What the documented limits say about field `name` = `v`: ("200"|"4xx", param)."""
    is_int = isinstance(v, int)
    in_int64 = is_int and INT64_MIN <= v <= INT64_MAX
    if name == "temperature":
        return ("200" if 0 <= v <= MAX_TEMPERATURE else "4xx"), name
    if name == "top_p":
        return ("200" if 0 < v <= 1 else "4xx"), name
    if name == "min_p":
        return ("200" if 0 <= v <= 1 else "4xx"), name
    if name in ("presence_penalty", "frequency_penalty"):
        return ("200" if v == 0 else "4xx"), name  # unsupported unless 0
    if not in_int64:
        return "4xx", name  # a float, or an integer the engine cannot store
    if name == "top_k":
        return ("200" if v >= -1 else "4xx"), name  # above the vocabulary: clamped
    if name == "seed":
        return "200", name
    if name == "n":
        return ("200" if v == 1 else "4xx"), name
    # max_tokens / max_completion_tokens: every limit is reported as max_tokens
    return ("200" if 1 <= v <= 8 else "4xx"), "max_tokens"


def huge_number(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    names = FLOAT_FIELDS + INT_FIELDS + (["max_completion_tokens"] if "messages" in body else [])
    name = rng.choice(names)
    value = _number(rng)
    if name in ("max_tokens", "max_completion_tokens") and isinstance(value, int) and 8 < value <= MAX_MODEL_LEN:
        value = MAX_MODEL_LEN + value  # never a valid but long request (keeps the test short)
    body[name] = value
    verdict, param = _number_verdict(name, value)
    if verdict == "200":
        return Case("valid-number", path, body=json.dumps(body).encode(), expect="200")
    return Case("huge-number", path, body=json.dumps(body).encode(), status=400, param=param)


def nan_inf(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    name = rng.choice(FLOAT_FIELDS + INT_FIELDS + ["repetition_penalty"])
    body[name] = "__HOSTILE__"
    token = rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400"])
    raw = json.dumps(body).replace('"__HOSTILE__"', token).encode()
    return Case("nan-inf", path, body=raw, status=400, param=name)


def _bad_id(rng: random.Random, vocab: int) -> int:
    return rng.choice([
        lambda: vocab + rng.randint(0, 10 ** rng.randint(0, 25)),
        lambda: -rng.randint(1, 10 ** rng.randint(0, 25)),
        lambda: rng.choice([2**63, 2**64, 2**64 + 1, INT64_MAX]),
    ])()


def out_of_vocab(rng: random.Random, vocab: int) -> Case:
    which = rng.randrange(4)
    if which == 0:  # the prompt
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        ids[rng.randrange(len(ids))] = _bad_id(rng, vocab)
        prompt: Any = [ids] if rng.random() < 0.3 else ids
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}
        return Case("oov-prompt", "v1/completions", body=json.dumps(body).encode(),
                    status=400, param="prompt")
    if which == 1:  # stop_token_ids
        path, body = _valid(rng, vocab)
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        ids.insert(rng.randint(0, len(ids)), _bad_id(rng, vocab))
        body["stop_token_ids"] = ids
        return Case("oov-stop-ids", path, body=json.dumps(body).encode(), status=400,
                    param="stop_token_ids")
    if which == 2:  # valid stop ids: served
        path, body = _valid(rng, vocab)
        body["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        return Case("valid-stop-ids", path, body=json.dumps(body).encode(), expect="200")
    ids = [rng.randrange(vocab) for _ in range(3)] + [_bad_id(rng, vocab)]
    return Case("oov-detokenize", "detokenize", body=json.dumps({"tokens": ids}).encode(),
                status=400, param="tokens")


def duplicate_id(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    rid = rng.choice(SHARED_IDS)
    if rng.random() < 0.5:  # reuse the id, then walk away: must not touch the other request
        body.update(stream=True, max_tokens=rng.randint(40, 120), ignore_eos=True)
        return Case("duplicate-id-abandoned", path, body=json.dumps(body).encode(),
                    headers={"X-Request-Id": rid}, expect="abandon", stream=True,
                    hangup_after=rng.randint(0, 3))
    body["stream"] = rng.random() < 0.5
    return Case("duplicate-id", path, body=json.dumps(body).encode(),
                headers={"X-Request-Id": rid}, expect="200", stream=body["stream"])


def oversized(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    pad = BODY_LIMIT + rng.randint(1, 4 * BODY_LIMIT)
    body["padding"] = "x" * pad
    return Case("oversized", path, body=json.dumps(body).encode(), status=413,
                chunked=rng.random() < 0.5)


def _break_json(rng: random.Random, raw: bytes) -> bytes:
    ops = [
        lambda: raw[: rng.randrange(1, len(raw))],
        lambda: (lambda i: raw[:i] + raw[i + 1:])(rng.randrange(len(raw))),
        lambda: (lambda i: raw[:i] + rng.choice([b"{", b"}", b"[", b"]", b":", b",", b'"', b"\\"])
                 + raw[i:])(rng.randrange(len(raw))),
        lambda: raw + rng.choice([b"}", b"x", b",", b"{}"]),
        lambda: raw.replace(b'"', b"'", rng.randint(1, 3)),
        lambda: rng.choice([b"", b"{", b"nul", b"{'a': 1}", b"[" * rng.randint(1, 50_000)]),
    ]
    return rng.choice(ops)()


def broken_json(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    raw = json.dumps(body).encode()
    if rng.random() < 0.15:  # valid JSON, but not an object
        bad = rng.choice([b"[1, 2]", b'"a string"', b"3", b"null", b"true", b"[" * 600 + b"]" * 600])
        return Case("json-not-object", path, body=bad, status=400)
    while True:
        bad = _break_json(rng, raw)
        try:
            json.loads(bad)
        except (ValueError, RecursionError):
            return Case("broken-json", path, body=bad, status=400)


def broken_utf8(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    if "prompt" in body:
        body["prompt"] = _text(rng) + "@@" + _text(rng)
    else:
        body["messages"][0]["content"] = _text(rng) + "@@"
    bad = rng.choice([b"\xff", b"\xfe\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\x80", b"\xe6\x97",
                      b"\xf8\x88\x80\x80\x80", b"\\ud83d", b"\\udfff x"])
    return Case("broken-utf8", path, body=json.dumps(body).encode().replace(b"@@", bad, 1),
                status=400)


def abandoned(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab, max_tokens=rng.randint(60, 180))
    body["ignore_eos"] = True
    how = rng.randrange(3)
    if how == 0:  # a stream, dropped after a few events
        body["stream"] = True
        return Case("abandoned-stream", path, body=json.dumps(body).encode(), expect="abandon",
                    stream=True, hangup_after=rng.randint(0, 3))
    if how == 1:  # a non-streamed request, dropped while it runs
        return Case("abandoned-request", path, body=json.dumps(body).encode(), expect="abandon",
                    hangup_after=0)
    return Case("abandoned-body", path, body=json.dumps(body).encode(), expect="abandon",
                hangup_after=-1)


def misc(rng: random.Random, vocab: int) -> Case:
    path, body = _valid(rng, vocab)
    raw = json.dumps(body).encode()
    which = rng.randrange(4)
    if which == 0:
        rid = "".join(rng.choice("abcdef0123") for _ in range(rng.randint(129, 400)))
        return Case("long-request-id", path, body=raw, headers={"X-Request-Id": rid},
                    status=400, param="X-Request-Id")
    if which == 1:
        body["model"] = _text(rng, 1, 2)
        return Case("unknown-model", path, body=json.dumps(body).encode(), status=404,
                    param="model")
    if which == 2:
        return Case("unknown-path", "v1/" + rng.choice(["embeddings", "completion", "x"]),
                    body=raw, status=404)
    return Case("wrong-method", path, method="GET", status=405)


GENERATORS = [
    (wrong_type, 16), (huge_number, 16), (nan_inf, 10), (out_of_vocab, 12), (duplicate_id, 10),
    (oversized, 5), (broken_json, 12), (broken_utf8, 7), (abandoned, 8), (misc, 4),
]


def normal_case(rng: random.Random, vocab: int, i: int) -> Case:
    path, body = _valid(rng, vocab, max_tokens=rng.randint(6, 14))
    body["ignore_eos"] = True
    stream = rng.random() < 0.5
    if stream:
        body["stream"] = True
    headers = {"X-Request-Id": SHARED_IDS[i % len(SHARED_IDS)]} if i % 2 == 0 else {}
    return Case(f"normal-{i}", path, body=json.dumps(body).encode(), headers=headers,
                expect="200", stream=stream)


def generate_cases(vocab: int) -> tuple[list[Case], list[Case]]:
    rng = random.Random(SEED)
    normals = [normal_case(rng, vocab, i) for i in range(N_NORMAL)]
    gens, weights = zip(*GENERATORS)
    hostile = [rng.choices(gens, weights)[0](rng, vocab) for _ in range(N_HOSTILE)]
    for c in normals:
        c.delay = rng.uniform(0, NORMAL_WINDOW)
    for c in hostile:
        c.delay = rng.uniform(0, HOSTILE_WINDOW)
    return normals, hostile


# ---- sending -----------------------------------------------------------------------------


@dataclass
class Result:
    status: int | None
    headers: dict[str, str]
    body: bytes


async def _send(client: httpx.AsyncClient, server: Any, case: Case) -> Result:
    headers = {"content-type": "application/json", **case.headers}
    if case.chunked:
        async def chunks():
            for i in range(0, len(case.body), 8192):
                yield case.body[i:i + 8192]
        content: Any = chunks()
    else:
        content = case.body if case.method == "POST" else None
    r = await client.request(case.method, f"{server.url}/{case.path}", content=content,
                             headers=headers)
    return Result(r.status_code, dict(r.headers), r.content)


async def _abandon(server: Any, case: Case, rng: random.Random) -> Result:
    """Raw HTTP: send, read `hangup_after` SSE events (or nothing), hang up."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    head = (f"POST /{case.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + "".join(f"{k}: {v}\r\n" for k, v in case.headers.items())
            + f"Content-Length: {len(case.body)}\r\n\r\n").encode()
    seen = b""
    try:
        if case.hangup_after < 0:  # half the body, then gone
            writer.write(head + case.body[: len(case.body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
        else:
            writer.write(head + case.body)
            await writer.drain()
            if case.stream:
                while seen.count(b"data: ") < case.hangup_after:
                    try:
                        data = await asyncio.wait_for(reader.read(4096), 10)
                    except asyncio.TimeoutError:
                        break  # a slow machine: hang up now
                    if not data:
                        break
                    seen += data
            else:
                await asyncio.sleep(rng.uniform(0.01, 0.2))
    finally:
        writer.close()
    status = int(seen.split(b" ", 2)[1]) if seen.startswith(b"HTTP/1.1 ") else None
    return Result(status, {}, seen)


def _sse_events(body: bytes) -> list[Any]:
    events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", body[-300:]
    return [json.loads(e) for e in events[:-1]]


def _output_text(case: Case, res: Result) -> str:
    """The generated text of a 200 answer, checking its shape on the way."""
    chat = "chat" in case.path
    if case.stream:
        events = _sse_events(res.body)
        assert all("error" not in e for e in events), events
        assert events[-1]["choices"][0]["finish_reason"] is not None or events[-1]["usage"]
        if chat:
            return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])
    data = json.loads(res.body)
    choice = data["choices"][0]
    assert choice["finish_reason"] in ("stop", "length"), data
    return choice["message"]["content"] if chat else choice["text"]


def _check_id_echo(case: Case, res: Result) -> None:
    given = case.headers.get("X-Request-Id")
    if given is None:
        return
    assert res.headers.get("x-request-id") == given, (case.describe(), res.headers)
    prefix = "chatcmpl" if "chat" in case.path else "cmpl"
    ids = ({e["id"] for e in _sse_events(res.body)} if case.stream
           else {json.loads(res.body)["id"]})
    assert ids == {f"{prefix}-{given}"}, ids


def _check_hostile(case: Case, res: Result) -> None:
    what = f"{case.describe()} -> {res.status} {res.body[:300]!r}"
    assert res.status is None or res.status < 500, what  # never a server error
    if case.expect == "abandon":
        assert res.status in (None, 200) and b'"error"' not in res.body, what
        return
    if case.expect == "200":
        assert res.status == 200, what
        _output_text(case, res)
        _check_id_echo(case, res)
        return
    assert res.status is not None and 400 <= res.status < 500, what
    if case.status is not None:
        assert res.status == case.status, what
    err = json.loads(res.body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], what
    if case.param is not None:
        assert err["param"] == case.param, what


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(params=["dense", "hybrid"])
def hostile_server(fresh_server, monkeypatch, request):
    """The tiny Qwen3 target, or the tiny Qwen3.5 hybrid one (GDN state slots in the same pool,
    48-token pages: its POOL_PAGES hold two full-length requests, so 8 still preempt)."""
    monkeypatch.setattr(server_fixtures, "build_app", partial(build_app, max_body_bytes=BODY_LIMIT))
    return fresh_server(num_gpu_blocks_override=POOL_PAGES, hybrid=request.param == "hybrid")


def test_hostile_requests_among_normal_ones(hostile_server, monkeypatch):
    server = hostile_server
    vocab = server.async_engine.vocab_size
    assert vocab is not None
    normals, hostile = generate_cases(vocab)
    assert len({c.kind for c in hostile}) >= 15, sorted({c.kind for c in hostile})

    async def scenario() -> tuple[list[Result], list[Result]]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            # Each normal request alone first: the reference its storm run must equal.
            for c in normals:
                res = await _send(client, server, c)
                assert res.status == 200, (c.describe(), res.body)
                c.expected_text = _output_text(c, res)
            before = server.async_engine.stats()
            rng = random.Random(SEED + 1)
            real_step = server.engine.step

            def paused_step() -> Any:
                time.sleep(STEP_PAUSE)
                return real_step()

            monkeypatch.setattr(server.engine, "step", paused_step)

            async def run(c: Case) -> Result:
                await asyncio.sleep(c.delay)
                if c.expect == "abandon":
                    return await _abandon(server, c, random.Random(rng.random()))
                return await _send(client, server, c)

            results = await asyncio.gather(*(run(c) for c in normals + hostile))
            assert server.async_engine.stats().spec_num_drafts > before.spec_num_drafts
            return results[:len(normals)], results[len(normals):]

    normal_results, hostile_results = asyncio.run(scenario())

    for c, res in zip(normals, normal_results):
        assert res.status == 200, (c.describe(), res.status, res.body[:300])
        assert _output_text(c, res) == c.expected_text, c.describe()
        _check_id_echo(c, res)
    for c, res in zip(hostile, hostile_results):
        _check_hostile(c, res)

    # Everything drains: nothing running or waiting, every page back, no stream left.
    deadline = time.monotonic() + 60
    while True:
        text = httpx.get(f"{server.url}/metrics").text
        gauges = [_metric(text, f"vllm:{n}") for n in
                  ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if gauges == [0, 0, 0] and server.async_engine.num_in_flight == 0:
            break
        assert time.monotonic() < deadline, (gauges, server.async_engine.num_in_flight)
        time.sleep(0.05)
    # And it still serves.
    r = httpx.post(f"{server.base_url}/completions",
                   json={"model": MODEL_NAME, "prompt": "after", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.headers["x-request-id"].startswith("cmpl-")


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_failed_step_spares_its_innocent_requests_exactly(fresh_server, model):
    """A step that fails because of one request (here: any step holding the 'boom' prompt
    raises) is retried one request at a time by the engine: the culprit alone fails, and
    every innocent request of that step finishes with exactly its output when run alone
    (a hybrid target too: the retried requests read their committed state slots)."""
    server = fresh_server(hybrid=model == "hybrid")
    decode = server.engine.tokenizer.decode

    class Boom:
        def step(self, requests: list[Any]) -> None:
            if any("boom" in decode(r.prompt_token_ids) for r in requests):
                raise RuntimeError("injected step fault")

        def request(self, request: Any) -> None:
            pass

    bodies = [{"model": MODEL_NAME, "prompt": f"innocent {i} {WORDS[i]}", "max_tokens": 20,
               "temperature": 0, "ignore_eos": True} for i in range(5)]

    async def scenario() -> tuple[list[str], list[str], httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            url = f"{server.base_url}/completions"
            alone = [(await client.post(url, json=b)).json()["choices"][0]["text"] for b in bodies]
            server.engine.fault_injector = Boom()

            async def streamed(b: dict, started: asyncio.Event) -> str:
                text = ""
                async with client.stream("POST", url, json={**b, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            started.set()
                            event = json.loads(line[6:])
                            assert "error" not in event, event
                            text += event["choices"][0]["text"]
                return text

            started = [asyncio.Event() for _ in bodies]
            tasks = [asyncio.create_task(streamed(b, e)) for b, e in zip(bodies, started)]
            await asyncio.gather(*(e.wait() for e in started))  # all five are decoding
            boom = await client.post(url, json={**bodies[0], "prompt": "boom", "max_tokens": 8})
            return alone, await asyncio.gather(*tasks), boom

    alone, texts, boom = asyncio.run(scenario())
    assert boom.status_code == 500 and "injected step fault" in boom.json()["error"]["message"]
    assert texts == alone
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
