"""The console script as a user runs it: generate, convert errors, and serve in a subprocess."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx

CLI = [sys.executable, "-m", "dflash_engine.cli"]


def test_generate_prints_json_lines(qwen3_dir):
    out = subprocess.run(
        CLI + ["generate", "hello", "--model", str(qwen3_dir), "--max-tokens", "4", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["prompt"] == "hello" and line["finish_reason"] in ("stop", "length")


def test_convert_rejects_a_missing_file(tmp_path):
    out = subprocess.run(CLI + ["convert", str(tmp_path / "nope.gguf"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "nope.gguf" in (out.stderr + out.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_starts_reports_the_pool_and_answers(qwen3_dir, random_draft_dir):
    port = _free_port()
    spec = json.dumps({"method": "dflash", "model": str(random_draft_dir), "draft_length": "fixed"})
    proc = subprocess.Popen(
        CLI + ["serve", str(qwen3_dir), "--port", str(port), "--device", "cpu", "--max-model-len", "128",
               "--speculative-config", spec, "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert "KV pool" in output and "pages" in output and "max concurrency" in output
