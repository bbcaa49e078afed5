"""Every bad input gets a 4xx in OpenAI's error shape and leaves the engine untouched;
a client that goes away mid-stream frees its request at once."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_fixtures import MAX_MODEL_LEN, MODEL_NAME

OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OK_CMPL = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}

BAD = [
    # (id, path, raw body, expected status, expected param or None)
    ("malformed-json", "completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not-an-object", "completions", b"[1, 2]", 400, None),
    ("invalid-utf8", "completions", b'{"prompt": "\xff\xfe bad", "max_tokens": 2}', 400, None),
    ("lone-surrogate", "chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("unknown-model", "completions", {**OK_CMPL, "model": "gpt-9"}, 404, "model"),
    ("unknown-model-chat", "chat/completions", {**OK_CHAT, "model": "gpt-9"}, 404, "model"),
    ("max-tokens-string", "completions", {**OK_CMPL, "max_tokens": "4"}, 400, "max_tokens"),
    ("max-tokens-float", "completions", {**OK_CMPL, "max_tokens": 4.5}, 400, "max_tokens"),
    ("temperature-string", "chat/completions", {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("stream-int", "completions", {**OK_CMPL, "stream": 1}, 400, "stream"),
    ("messages-not-list", "chat/completions", {**OK_CHAT, "messages": "hi"}, 400, "messages"),
    ("prompt-number", "completions", {**OK_CMPL, "prompt": 42}, 400, None),
    ("missing-prompt", "completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("negative-max-tokens", "completions", {**OK_CMPL, "max_tokens": -5}, 400, "max_tokens"),
    ("zero-max-tokens", "chat/completions", {**OK_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("absurd-max-tokens", "completions", {**OK_CMPL, "max_tokens": 10**15}, 400, "max_tokens"),
    ("absurd-max-completion-tokens", "chat/completions",
     {**OK_CHAT, "max_completion_tokens": 2**62}, 400, "max_tokens"),
    ("prompt-plus-max-over-len", "completions",
     {**OK_CMPL, "prompt": "a" * (MAX_MODEL_LEN - 8), "max_tokens": 16}, 400, "max_tokens"),
    ("prompt-alone-over-len", "completions",
     {**OK_CMPL, "prompt": "a" * (MAX_MODEL_LEN + 5), "max_tokens": None}, 400, "prompt"),
    ("empty-prompt", "completions", {**OK_CMPL, "prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", "completions", {**OK_CMPL, "prompt": []}, 400, "prompt"),
    ("negative-token-id", "completions", {**OK_CMPL, "prompt": [1, -3]}, 400, "prompt"),
    ("empty-messages", "chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("unknown-role", "chat/completions",
     {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("n-two", "completions", {**OK_CMPL, "n": 2}, 400, "n"),
    ("batched-prompts", "completions", {**OK_CMPL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("bad-top-p", "completions", {**OK_CMPL, "top_p": 1.5}, 400, "top_p"),
    ("negative-temperature", "chat/completions", {**OK_CHAT, "temperature": -1}, 400, "temperature"),
    ("bad-top-k", "completions", {**OK_CMPL, "top_k": -7}, 400, "top_k"),
    ("empty-stop-string", "completions", {**OK_CMPL, "stop": [""]}, 400, "stop"),
    # issue 8: every field bounded by what the engine can represent, named in `param`
    ("top-k-over-int64", "completions", {**OK_CMPL, "top_k": 10**20}, 400, "top_k"),
    ("stop-token-id-over-uint64", "completions",
     {**OK_CMPL, "stop_token_ids": [18446744073709551616]}, 400, "stop_token_ids"),
    ("stop-token-id-out-of-vocab", "chat/completions",
     {**OK_CHAT, "stop_token_ids": [5, 10**6]}, 400, "stop_token_ids"),
    ("stop-token-id-negative", "completions", {**OK_CMPL, "stop_token_ids": [-1]}, 400,
     "stop_token_ids"),
    ("temperature-nan", "completions",
     b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400, "temperature"),
    ("temperature-infinity", "chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400,
     "temperature"),
    ("temperature-minus-infinity", "completions",
     b'{"prompt": "hi", "temperature": -Infinity}', 400, "temperature"),
    ("temperature-overflow", "completions", b'{"prompt": "hi", "temperature": 1e999}', 400,
     "temperature"),
    ("temperature-huge", "completions", {**OK_CMPL, "temperature": 1e300}, 400, "temperature"),
    ("top-p-nan", "completions", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    ("min-p-infinity", "completions", b'{"prompt": "hi", "min_p": Infinity}', 400, "min_p"),
    ("seed-over-int64", "completions", {**OK_CMPL, "seed": 2**64}, 400, "seed"),
    ("seed-under-int64", "completions", {**OK_CMPL, "seed": -(2**63) - 1}, 400, "seed"),
    ("n-over-int64", "completions", {**OK_CMPL, "n": 10**30}, 400, "n"),
    ("max-tokens-over-int64", "completions", {**OK_CMPL, "max_tokens": 2**70}, 400, "max_tokens"),
    ("prompt-id-over-int64", "completions", {**OK_CMPL, "prompt": [1, 2**64]}, 400, "prompt"),
    ("prompt-id-out-of-vocab", "completions", {**OK_CMPL, "prompt": [1, 10**6]}, 400, "prompt"),
    ("too-many-stop-strings", "completions", {**OK_CMPL, "stop": ["s"] * 129}, 400, "stop"),
    ("bool-temperature", "completions", {**OK_CMPL, "temperature": True}, 400, "temperature"),
    ("logprobs", "completions", {**OK_CMPL, "logprobs": 3}, 400, "logprobs"),
    ("frequency-penalty", "chat/completions", {**OK_CHAT, "frequency_penalty": 0.5}, 400,
     "frequency_penalty"),
    ("tools", "chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("best-of", "completions", {**OK_CMPL, "best_of": 3}, 400, "best_of"),
    ("oversized-body", "completions", {**OK_CMPL, "prompt": "x" * (5 * 1024 * 1024)}, 413, None),
]


def _post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}/{path}", content=content,
                      headers={"content-type": "application/json"}, timeout=30)


def _assert_openai_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(spec_off_server, name, path, body, status, param):
    before = spec_off_server.async_engine.stats()
    _assert_openai_error(_post(spec_off_server, path, body), status, param)
    if isinstance(body, dict) and not isinstance(body.get("stream"), int):
        # The same input, streamed, is refused the same way before any SSE starts.
        r = _post(spec_off_server, path, {**body, "stream": True})
        _assert_openai_error(r, status, param)
    after = spec_off_server.wait_idle()
    assert after.prompt_tokens == before.prompt_tokens  # nothing reached the engine


def test_oversized_chunked_body_without_length(spec_off_server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"y" * 65536
        yield b'"}'

    r = httpx.post(f"{spec_off_server.base_url}/completions", content=chunks(), timeout=30)
    _assert_openai_error(r, 413, None)


def test_unknown_route_and_method(spec_off_server):
    _assert_openai_error(httpx.get(f"{spec_off_server.base_url}/nothing"), 404, None)
    _assert_openai_error(httpx.get(f"{spec_off_server.base_url}/completions"), 405, None)


def test_bad_detokenize(spec_off_server):
    r = httpx.post(f"{spec_off_server.url}/detokenize", json={"tokens": [10**9]})
    _assert_openai_error(r, 400, "tokens")


def test_server_still_serves_after_bad_inputs(spec_off_server):
    r = _post(spec_off_server, "chat/completions", OK_CHAT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def _raw_stream_then_hang_up(server, body: dict, chunks_to_read: int,
                             headers: dict | None = None) -> None:
    """Open a streaming request on a raw socket, read a few SSE events, and hang up."""
    payload = json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + extra + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        seen = b""
        while seen.count(b"data: ") < chunks_to_read:
            data = sock.recv(4096)
            assert data, "server closed the stream early"
            seen += data


def test_disconnect_mid_stream_aborts_and_frees_pages(spec_off_server):
    max_tokens = MAX_MODEL_LEN - 16
    before = spec_off_server.async_engine.stats().generation_tokens
    _raw_stream_then_hang_up(spec_off_server, {**OK_CMPL, "max_tokens": max_tokens, "stream": True,
                                               "ignore_eos": True}, chunks_to_read=2)
    stats = spec_off_server.wait_idle(timeout=5)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0
    assert stats.generation_tokens - before < max_tokens  # stopped early, not run to the end


def test_disconnect_non_streamed_aborts(spec_off_server):
    max_tokens = MAX_MODEL_LEN - 16
    before = spec_off_server.async_engine.stats().generation_tokens
    body = json.dumps({**OK_CMPL, "max_tokens": max_tokens, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", spec_off_server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 5
        while spec_off_server.async_engine.stats().generation_tokens == before:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    stats = spec_off_server.wait_idle(timeout=5)
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    assert stats.generation_tokens - before < max_tokens


# ---- issue 8: the five reproductions, and the limits around them --------------------------

VOCAB = 300  # the tiny target's vocabulary (tests/tiny_models.py)


def _alone(server, path: str, body: dict) -> str:
    r = httpx.post(f"{server.base_url}/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _stream_lines(server, path: str, body: dict, headers: dict | None = None):
    """An open SSE request: (context manager, iterator over its `data:` payloads)."""
    client = httpx.Client(timeout=60)
    cm = client.stream("POST", f"{server.base_url}/{path}", json={**body, "stream": True},
                       headers=headers or {})
    return client, cm


def _collect(events) -> tuple[str, set[str]]:
    text, ids = "", set()
    for e in events:
        ids.add(e["id"])
        assert "error" not in e, e
        if e["choices"]:
            c = e["choices"][0]
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text, ids


def _data(lines) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def test_vocab_is_what_the_tests_assume(spec_on_server):
    assert spec_on_server.async_engine.vocab_size == VOCAB


def test_huge_top_k_is_refused_alone_while_others_run(spec_on_server):
    """Reproduction 1: a top_k past int64 used to fail the whole step (a 500 for all seven)."""
    bodies = [{**OK_CMPL, "prompt": f"six normal requests {i}", "max_tokens": 24,
               "temperature": 0, "ignore_eos": True} for i in range(6)]
    expected = [_alone(spec_on_server, "completions", b) for b in bodies]
    opened = [_stream_lines(spec_on_server, "completions", b) for b in bodies]
    responses = [cm.__enter__() for _, cm in opened]
    try:
        lines = [r.iter_lines() for r in responses]
        firsts = [next(it) for it in lines]  # every stream has produced output: all running
        hostile = httpx.post(f"{spec_on_server.base_url}/completions", timeout=60,
                             json={"prompt": "abc", "max_tokens": 16, "top_k": 100000000000000000000})
        _assert_openai_error(hostile, 400, "top_k")
        texts = [_collect(_data([first, *it]))[0] for first, it in zip(firsts, lines)]
    finally:
        for (client, cm), _r in zip(opened, responses):
            cm.__exit__(None, None, None)
            client.close()
    assert texts == expected
    stats = spec_on_server.wait_idle()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0


def test_top_k_above_the_vocabulary_is_clamped(spec_on_server):
    """top_k is clamped to the vocabulary as in vLLM: any top_k >= vocab (up to int64) is
    the same as off; top_k=1 is greedy."""
    base = {**OK_CMPL, "prompt": "clamp me", "max_tokens": 12, "temperature": 1.0, "seed": 7,
            "ignore_eos": True}
    off = _alone(spec_on_server, "completions", {**base, "top_k": -1})
    for k in (0, VOCAB, VOCAB + 1, 2**62, 2**63 - 1):
        assert _alone(spec_on_server, "completions", {**base, "top_k": k}) == off, k
    greedy = _alone(spec_on_server, "completions", {**base, "temperature": 0})
    assert _alone(spec_on_server, "completions", {**base, "top_k": 1}) == greedy


def test_reused_request_id_touches_no_other_request(spec_on_server):
    """Reproduction 2: a second request with A's X-Request-Id used to get a 400 and abort A
    (499). Now ids are minted by the server; X-Request-Id is only echoed back."""
    server = spec_on_server
    body_a = {**OK_CMPL, "prompt": "request A", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    expected_a = _alone(server, "completions", body_a)
    client, cm = _stream_lines(server, "completions", body_a, {"X-Request-Id": "dup1"})
    with client, cm as resp_a:
        assert resp_a.status_code == 200 and resp_a.headers["x-request-id"] == "dup1"
        lines = resp_a.iter_lines()
        first = next(lines)  # A is running
        # B: same id, served normally, and echoed back.
        b = httpx.post(f"{server.base_url}/completions", headers={"X-Request-Id": "dup1"},
                       json={**OK_CMPL, "max_tokens": 3, "temperature": 0}, timeout=60)
        assert b.status_code == 200, b.text
        assert b.headers["x-request-id"] == "dup1" and b.json()["id"] == "cmpl-dup1"
        # C: same id, a stream its client abandons: its disconnect aborts only C.
        _raw_stream_then_hang_up(server, {**OK_CMPL, "max_tokens": 40, "stream": True},
                                 chunks_to_read=1, headers={"X-Request-Id": "dup1"})
        text_a, ids = _collect(_data([first, *lines]))
    assert text_a == expected_a and ids == {"cmpl-dup1"}
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.kv_cache_usage == 0


def test_request_ids_are_minted_and_echoed(spec_off_server):
    seen = set()
    for path, body in (("completions", OK_CMPL), ("chat/completions", OK_CHAT)) * 2:
        r = httpx.post(f"{spec_off_server.base_url}/{path}", json=body, timeout=60)
        rid = r.headers["x-request-id"]
        assert r.status_code == 200 and r.json()["id"] == rid
        assert rid.startswith("chatcmpl-" if "chat" in path else "cmpl-") and rid not in seen
        seen.add(rid)
    # An error still echoes the client's id; an unusable one is refused, naming the header.
    r = httpx.post(f"{spec_off_server.base_url}/completions", headers={"X-Request-Id": "e1"},
                   json={**OK_CMPL, "top_k": -5})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e1"
    r = httpx.post(f"{spec_off_server.base_url}/completions", headers={"X-Request-Id": "x" * 129},
                   json=OK_CMPL)
    _assert_openai_error(r, 400, "X-Request-Id")
    assert "x-request-id" not in r.headers


def test_stop_token_ids_within_the_vocabulary(spec_off_server):
    """Reproduction 3: stop_token_ids [2**64] used to be a 500 (OverflowError)."""
    url = f"{spec_off_server.base_url}/completions"
    for ids in ([18446744073709551616], [VOCAB], [0, -1]):
        _assert_openai_error(httpx.post(url, json={**OK_CMPL, "stop_token_ids": ids}), 400,
                             "stop_token_ids")
    r = httpx.post(url, json={**OK_CMPL, "stop_token_ids": [0, VOCAB - 1]})
    assert r.status_code == 200, r.text


def test_temperature_must_be_finite(spec_off_server):
    """Reproduction 4: NaN and Infinity temperatures used to be accepted."""
    for token in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        body = b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + token + b"}"
        _assert_openai_error(_post(spec_off_server, "completions", body), 400, "temperature")


def test_chat_template_in_jinja_file_is_served(fresh_server, models_root, tmp_path):
    """Reproduction 5: a model directory whose template lives in chat_template.jinja (as
    current Hugging Face tooling saves it) used to refuse every chat."""
    import shutil

    from server_fixtures import tiny_model_dirs

    target, _ = tiny_model_dirs(models_root)
    model = tmp_path / "jinja-target"
    shutil.copytree(target, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").write_text(template)
    server = fresh_server(model=str(model))
    r = httpx.post(f"{server.base_url}/chat/completions", json=OK_CHAT, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/tokenize", json={"messages": OK_CHAT["messages"]})
    assert r.status_code == 200 and r.json()["count"] > 1


# ---- SamplingParams.validate: the one definition of what the engine can represent ---------


def test_sampling_params_validate_names_the_field():
    import math

    import numpy as np

    from dflash_engine.sampling_params import InvalidSamplingParamError, SamplingParams

    bad = [
        ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
        ({"temperature": -0.1}, "temperature"), ({"temperature": 1e5}, "temperature"),
        ({"temperature": True}, "temperature"), ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"), ({"top_p": math.nan}, "top_p"), ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"), ({"top_k": 2**63}, "top_k"), ({"top_k": 1.0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2**63}, "max_tokens"),
        ({"seed": 2**63}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"), ({"stop": ["a"] * 129}, "stop"),
        ({"ignore_eos": 1}, "ignore_eos"), ({"n": 2}, "n"),
    ]
    for kwargs, param in bad:
        with pytest.raises(InvalidSamplingParamError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param and isinstance(e.value, ValueError), kwargs
    # With the vocabulary known, stop ids must lie inside it.
    sp = SamplingParams(stop_token_ids=[0, 299])
    sp.validate(vocab_size=300)
    with pytest.raises(InvalidSamplingParamError) as e:
        SamplingParams(stop_token_ids=[300]).validate(vocab_size=300)
    assert e.value.param == "stop_token_ids" and "300" in str(e.value)
    # numpy scalars are accepted and normalised; int64 bounds are inclusive.
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), seed=-(2**63),
                        max_tokens=np.int32(3), stop_token_ids=[np.int64(7)])
    assert type(sp.temperature) is float and type(sp.top_k) is int and type(sp.max_tokens) is int
    assert sp.stop_token_ids == [7] and type(sp.stop_token_ids[0]) is int
    assert SamplingParams(seed=2**63 - 1, top_k=2**63 - 1).seed == 2**63 - 1


def test_effective_top_k_clamps_to_the_vocabulary():
    from dflash_engine.sampling_params import SamplingParams

    assert [SamplingParams(top_k=k).effective_top_k(300) for k in (-1, 0, 1, 299, 300, 301, 2**63 - 1)] \
        == [300, 300, 1, 299, 300, 300, 300]


def test_engine_refuses_what_the_edge_refuses(models_root):
    """The engine validates with its vocabulary too (LLMEngine.add_request), so offline
    callers get the same typed error and nothing is added."""
    from server_fixtures import make_engine

    from dflash_engine.sampling_params import InvalidSamplingParamError, SamplingParams

    engine = make_engine(models_root, spec=False)
    for params, param in ((SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
                          (SamplingParams(), "temperature")):
        if param == "temperature":
            params.temperature = float("nan")  # set after construction: only add_request sees it
        with pytest.raises(InvalidSamplingParamError) as e:
            engine.add_request("r", [1, 2, 3], params)
        assert e.value.param == param
    assert not engine.has_unfinished_requests()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))  # the id was never taken


def test_max_request_body_bytes_flag():
    import argparse

    from dflash_engine.cli_args import add_serve_args

    parser = add_serve_args(argparse.ArgumentParser())
    assert parser.parse_args([]).max_request_body_bytes == 4 * 1024 * 1024
    assert parser.parse_args(["--max-request-body-bytes", "1000"]).max_request_body_bytes == 1000
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-request-body-bytes", "0"])
