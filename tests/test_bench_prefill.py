"""bench/bench_prefill.py: its FLOP count by hand, and the script's flow on the CPU (a device
call that finds it broken costs minutes of scarce GPU time)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load():
    sys.path.insert(0, str(BENCH))  # bench_prefill imports its neighbour ceilings
    try:
        spec = importlib.util.spec_from_file_location("bench_prefill_under_test", BENCH / "bench_prefill.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


bench_prefill = _load()

# 1 layer, hidden 4, 2 query heads / 1 KV head of width 2, MLP 8, vocab 10 (test_bench_floor.py's).
TARGET = dict(num_hidden_layers=1, hidden_size=4, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
              intermediate_size=8, vocab_size=10)


def test_prefill_flops_by_hand():
    # matmul weights a row: q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate/up/down 3 x 4x8 = 144 -> 2 x 144 x 3 rows = 864;
    # causal attention over 3 rows: 1 + 2 + 3 = 6 (row, key) pairs x 4 x 2 heads x 2 dims = 96;
    # the logits of the last row: 2 x 4 x 10 = 80.
    assert bench_prefill.target_flops(TARGET, 3) == 864 + 96 + 80
    # head_dim defaults to hidden / heads, KV heads to the query heads (a config without them).
    plain = {k: v for k, v in TARGET.items() if k not in ("head_dim", "num_key_value_heads")}
    assert bench_prefill.target_flops(plain, 1) == 2 * (4 * 2 * 6 + 16 + 96) + 4 * 2 * 2 * 1 + 80


def test_the_script_times_both_modes_alone_and_beside_decoders_on_the_cpu(qwen3_dir, random_draft_dir, tmp_path,
                                                                           capsys):
    out = tmp_path / "prefill.json"
    rc = bench_prefill.main(["--target", str(qwen3_dir), "--draft", str(random_draft_dir), "--lengths", "24,40",
                             "--k", "3", "--beside", "0,2", "--repeats", "1", "--profile", "--top", "3",
                             "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["beside"], r["length"]) for r in rows] == [
        (m, n, length) for m in ("off", "on") for n in (0, 2) for length in (24, 40)]
    assert all(r["steps"] >= 1 for r in rows)
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in rows if r["beside"] == 0)  # (a marginal may be noise)
    printed = capsys.readouterr().out
    assert printed.count("| kernel | ms | launches | share |") == 8
    assert printed.count("beside 2 decoding") == 4


def test_mode_on_needs_a_draft(qwen3_dir):
    with pytest.raises(SystemExit):
        bench_prefill.main(["--target", str(qwen3_dir), "--modes", "on"])


def test_kernel_totals_sum_device_time_per_kernel_name():
    """profile_step.kernel_totals (shared with bench_prefill; profile_step itself needs a GPU):
    device self time and calls summed per name up to its argument list; zero-time entries dropped."""
    from types import SimpleNamespace

    import profile_step  # bench/, imported by bench_prefill

    def ev(key, device_us, cpu_us, count):
        return SimpleNamespace(key=key, self_device_time_total=device_us, self_cpu_time_total=cpu_us, count=count)

    events = [ev("gemm(a, b)", 10.0, 1.0, 2), ev("gemm(c)", 5.0, 2.0, 1), ev("norm", 3.0, 0.0, 4), ev("cpu_only", 0, 7.0, 1)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert profile_step.kernel_totals(prof) == ({"gemm": 15.0, "norm": 3.0}, {"gemm": 3, "norm": 4})
    assert profile_step.kernel_totals(prof, device=False) == ({"gemm": 3.0, "cpu_only": 7.0}, {"gemm": 3, "cpu_only": 1})
