"""`dflash-engine bench serve` against a live server writes JSON + PNG; failures make VOID rungs."""
from __future__ import annotations

import argparse
import json

import pytest

from dflash_engine import bench_serve
from dflash_engine.cli_args import add_bench_args

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _args(server, tmp_path, *extra: str) -> argparse.Namespace:
    return add_bench_args(argparse.ArgumentParser()).parse_args([
        "--base-url", server.base_url, "--result-dir", str(tmp_path), "--result-filename", "run.json",
        "--disable-tqdm", *extra])


def _read(tmp_path) -> dict:
    assert (tmp_path / "run.png").read_bytes().startswith(PNG_MAGIC)
    return json.loads((tmp_path / "run.json").read_text())


def test_random_ladder_writes_json_and_png(spec_on_server, tmp_path):
    args = _args(spec_on_server, tmp_path, "--concurrency", "1,4", "--num-prompts", "4",
                 "--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "8",
                 "--backend", "openai")
    assert bench_serve.main(args) == 0
    result = _read(tmp_path)
    assert [r["concurrency"] for r in result["rungs"]] == [1, 4]
    for rung in result["rungs"]:
        assert rung["status"] == "OK" and rung["ok"] == 4 and rung["failed"] == 0
        assert rung["mean_output_tokens"] == 8 and rung["mean_prompt_tokens"] == 24
        assert rung["output_throughput"] > 0 and rung["total_token_throughput"] > rung["output_throughput"]
        assert rung["mean_ttft_ms"] > 0 and rung["p99_ttft_ms"] >= rung["mean_ttft_ms"] * 0.999
        assert rung["mean_tpot_ms"] > 0 and rung["mean_itl_ms"] > 0
        assert rung["p99_tpot_ms"] >= rung["mean_tpot_ms"] * 0.999
        assert 1.0 <= rung["tau"]  # spec on: τ read from the server's /metrics
    assert result["config"]["model"] == "tiny-qwen3" and "api_key" not in result["config"]


def test_auto_prompt_counts_follow_the_ladder_rule(spec_on_server, tmp_path):
    """--num-prompts auto: 8 requests below concurrency 4, 4 x concurrency from 4 on."""
    assert [bench_serve.rung_prompts("auto", c) for c in (1, 2, 4, 8, 32)] == [8, 8, 16, 32, 128]
    args = _args(spec_on_server, tmp_path, "--concurrency", "2,4", "--num-prompts", "auto",
                 "--random-input-len", "8", "--random-output-len", "2")
    assert bench_serve.main(args) == 0
    assert [r["ok"] for r in _read(tmp_path)["rungs"]] == [8, 16]


def test_per_seat_prompt_counts_and_the_rung_lines_as_they_end(spec_on_server, tmp_path, capsys):
    """--num-prompts 2x: two waves of each rung's concurrency; with --disable-tqdm each rung's
    line is printed when the rung ends (a killed ladder keeps its finished rungs in the JSON)."""
    assert [bench_serve.rung_prompts("2x", c) for c in (1, 3, 32)] == [2, 6, 64]
    args = _args(spec_on_server, tmp_path, "--concurrency", "1,3", "--num-prompts", "2x",
                 "--random-input-len", "8", "--random-output-len", "2")
    assert bench_serve.main(args) == 0
    assert [r["ok"] for r in _read(tmp_path)["rungs"]] == [2, 6]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["conc", "status"] and lines[1].split()[:2] == ["1", "OK"]
    assert lines[2].split()[:2] == ["3", "OK"]
    for bad in ("0x", "x", "-2", "two"):
        with pytest.raises(SystemExit):
            _args(spec_on_server, tmp_path, "--num-prompts", bad)


def test_humaneval_chat(fresh_server, tmp_path):
    server = fresh_server(max_model_len=2048, num_gpu_blocks_override=256)  # room for one 2048-token request
    args = _args(server, tmp_path, "--concurrency", "2", "--num-prompts", "2",
                 "--dataset-name", "humaneval", "--humaneval-output-len", "6", "--backend", "openai-chat")
    assert bench_serve.main(args) == 0
    (rung,) = _read(tmp_path)["rungs"]
    assert rung["status"] == "OK" and rung["mean_prompt_tokens"] > 50


def test_custom_dataset_jsonl(spec_on_server, tmp_path):
    """--dataset-name custom --dataset-path FILE (vLLM's names): one {"prompt": ...} per line,
    cycled to the rung's requests; EOS honoured unless --ignore-eos."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Name three colours."}\n\n{"prompt": "Count to five.", "note": 1}\n')
    assert bench_serve.custom_prompts(str(data), 5) == ["Name three colours.", "Count to five."] * 2 + [
        "Name three colours."]
    args = _args(spec_on_server, tmp_path, "--concurrency", "2", "--num-prompts", "3", "--dataset-name", "custom",
                 "--dataset-path", str(data), "--custom-output-len", "5", "--ignore-eos")
    assert bench_serve.main(args) == 0
    (rung,) = _read(tmp_path)["rungs"]
    assert rung["status"] == "OK" and rung["ok"] == 3 and rung["mean_output_tokens"] == 5


@pytest.mark.parametrize("content, message", [
    (None, "needs --dataset-path"), ("missing", "No such file"), ('{"text": "x"}\n', "line 1"),
    ('{"prompt": ""}\n', "non-empty"), ("\n", "no prompts")])
def test_custom_dataset_errors_name_the_problem(tmp_path, content, message):
    path = None
    if content is not None:
        path = tmp_path / "p.jsonl"
        if content != "missing":
            path.write_text(content)
        path = str(path)
    with pytest.raises(SystemExit, match=message):
        bench_serve.custom_prompts(path, 2)


class PoisonOnce:
    """Fails the first request it sees once armed."""

    def __init__(self) -> None:
        self.armed = False

    def step(self, requests):
        pass

    def request(self, request):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected bench fault")


def test_failed_request_makes_the_rung_void(fresh_server, tmp_path, monkeypatch):
    server = fresh_server()
    server.engine.fault_injector = injector = PoisonOnce()
    real_send, sent = bench_serve._send, []

    async def send(*args):
        sent.append(1)
        if len(sent) == 2:  # after the warm-up: the first rung loses exactly one request
            injector.armed = True
        return await real_send(*args)

    monkeypatch.setattr(bench_serve, "_send", send)
    args = _args(server, tmp_path, "--concurrency", "1,2", "--num-prompts", "3",
                 "--random-input-len", "8", "--random-output-len", "4")
    assert bench_serve.main(args) == 1
    void, ok = _read(tmp_path)["rungs"]
    assert void["status"] == "VOID" and void["failed"] == 1 and void["ok"] == 2
    assert "injected bench fault" in void["error"] and "output_throughput" not in void
    assert ok["status"] == "OK" and ok["ok"] == 3
