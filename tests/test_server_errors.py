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
    ("n-two", "completions", {**OK_CMPL, "n": 2}, 400, None),
    ("batched-prompts", "completions", {**OK_CMPL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("bad-top-p", "completions", {**OK_CMPL, "top_p": 1.5}, 400, None),
    ("negative-temperature", "chat/completions", {**OK_CHAT, "temperature": -1}, 400, None),
    ("bad-top-k", "completions", {**OK_CMPL, "top_k": -7}, 400, None),
    ("empty-stop-string", "completions", {**OK_CMPL, "stop": [""]}, 400, None),
    ("logprobs", "completions", {**OK_CMPL, "logprobs": 3}, 400, None),
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


def _raw_stream_then_hang_up(server, body: dict, chunks_to_read: int) -> None:
    """Open a streaming request on a raw socket, read a few SSE events, and hang up."""
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
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
