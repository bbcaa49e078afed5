"""The skinny GEMM (kernels/skinny_gemm.py) against torch's linear: every tile, split and operand
order, ragged shapes (M, N, K not multiples of the tiles), bias, split-K with empty
trailing splits, and row invariance within an M bucket (a row's bits do not depend on the
other rows of the call). Under Triton's interpreter on CPU without a GPU (float32)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_engine.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, skinny_matmul

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CONFIGS = [
    SkinnyConfig(block_n=32, block_k=32, split_k=1, swap_ab=True),
    SkinnyConfig(block_n=32, block_k=32, split_k=3, swap_ab=True),
    SkinnyConfig(block_n=16, block_k=64, split_k=2, swap_ab=False),
    SkinnyConfig(block_n=64, block_k=16, split_k=1, swap_ab=False),
    SkinnyConfig(block_n=32, block_k=32, split_k=8, swap_ab=True),  # more splits than K blocks: empty splits
    SkinnyConfig(block_n=32, block_k=32, split_k=3, swap_ab=True, fold_reduce=True),
    SkinnyConfig(block_n=16, block_k=32, split_k=8, swap_ab=False, fold_reduce=True),
]


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.label())
@pytest.mark.parametrize("m,n,k", [(1, 48, 40), (5, 70, 100), (16, 64, 96), (17, 33, 130)])
def test_matches_linear(cfg: SkinnyConfig, m: int, n: int, k: int) -> None:
    x, w, b = _rand(m, k, seed=1), _rand(n, k, seed=2), _rand(n, seed=3)
    for bias in (None, b):
        got = skinny_matmul(x, w, bias, cfg)
        want = F.linear(x, w, bias)
        assert got.shape == (m, n) and got.dtype == x.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_row_bits_do_not_depend_on_the_other_rows() -> None:
    cfg = SkinnyConfig(block_n=32, block_k=32, split_k=2)
    x, w = _rand(12, 96, seed=4), _rand(40, 96, seed=5)
    full = skinny_matmul(x, w, None, cfg)
    for lo, hi in [(0, 1), (3, 9), (11, 12)]:  # same M bucket (16 rows): same tiles, same sums
        assert torch.equal(skinny_matmul(x[lo:hi].contiguous(), w, None, cfg), full[lo:hi])


def test_out_buffer_and_edges() -> None:
    x, w = _rand(3, 64, seed=6), _rand(20, 64, seed=7)
    out = torch.full((3, 20), float("nan"), device=DEV)
    assert skinny_matmul(x, w, None, SkinnyConfig(block_n=16, block_k=32, split_k=2), out=out) is out
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert skinny_matmul(x[:0], w).shape == (0, 20)
    b = _rand(20, seed=8)
    torch.testing.assert_close(skinny_matmul(x[:, :0], w[:, :0], b), b.expand(3, 20))


def test_bad_input_is_refused() -> None:
    w = _rand(8, 16, seed=9)
    with pytest.raises(ValueError, match="at most"):
        skinny_matmul(_rand(MAX_ROWS + 1, 16, seed=10), w)
    with pytest.raises(ValueError, match="do not multiply"):
        skinny_matmul(_rand(2, 15, seed=11), w)
    with pytest.raises(ValueError, match="dtype"):
        skinny_matmul(_rand(2, 16, seed=12).double(), w)
    with pytest.raises(ValueError, match="bad config"):
        skinny_matmul(_rand(2, 16, seed=12), w, cfg=SkinnyConfig(split_k=0))


@pytest.mark.skipif(DEV == "cuda", reason="the GPU sweep is a device benchmark (bench/bench_skinny_gemm.py)")
def test_bench_smoke_runs_and_checks_every_config(tmp_path) -> None:
    import json

    import bench_skinny_gemm

    out = tmp_path / "sk.json"
    assert bench_skinny_gemm.main(["--rows", "3", "--shapes", "tiny_a", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["rows"] == 3 and row["best_cfg"] and row["cublas_us"] > 0
    assert all("us" in t for t in row["tried"]), row["tried"]  # every config ran and matched F.linear


def test_folded_reduce_gives_the_reduce_kernels_bits_in_one_launch(monkeypatch) -> None:
    """The last split of each tile sums the partials (same order, same bits as the reduce
    kernel), no second launch, and the ticket counters are zero again after each call."""
    from dflash_engine.kernels import skinny_gemm

    x, w, b = _rand(7, 200, seed=13), _rand(70, 200, seed=14), _rand(70, seed=15)
    for split in (2, 3, 8):
        plain = SkinnyConfig(block_n=16, block_k=32, split_k=split)
        want = skinny_matmul(x, w, b, plain)
        monkeypatch.setattr(skinny_gemm, "_reduce_kernel", None)  # a reduce launch would fail
        for _ in range(2):  # the second call reuses the counters the first left at zero
            got = skinny_matmul(x, w, b, SkinnyConfig(block_n=16, block_k=32, split_k=split, fold_reduce=True))
            assert torch.equal(got, want), split
        monkeypatch.undo()
        assert not skinny_gemm._fold_counter_buffers[x.device].any()
