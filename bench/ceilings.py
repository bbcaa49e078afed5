"""Hardware ceilings and the floor of one decode / draft+verify step (shared/design/GPU.md).

    python bench/ceilings.py [--device cuda|cpu] [--json]

prints the two ceilings measured on this device, the device-to-device copy bandwidth
(bytes read + written per second) and the bf16 `torch.matmul` rate, then the step floors of
the Qwen3-8B shape (+ its 5-layer DFlash draft, block 16) at those rates. On a machine
without a GPU it runs the same code on tiny sizes on the CPU, labelled as such: those numbers
are a smoke run, not a ceiling of anything that matters.

The step benchmark imports `copy_bandwidth_gbs`, `gemm_tflops` and `step_floor_ms`.

The floor of a step is max(bytes / copy rate, FLOPs / GEMM rate), counting:
- target bytes: every target weight read once (lm_head included, tied or not; the
  embedding is only gathered, B rows, and not counted), the KV cache read over the
  context (context_len tokens per request) and written for the new rows;
- target FLOPs: 2 x matmul weights (q, k, v, o, gate, up, down of every layer and the
  lm_head) per row, plus attention 4 x q_heads x head_dim per (row, key) pair, causal within
  the new rows (row i of a request sees context_len + i + 1 keys);
- with a draft pass (B = rows_per_request block rows per request): the draft weights (fc,
  hidden_norm, layers, norm) and the target lm_head re-read for the draft logits; draft KV
  read over the context and written for the B block rows and the B context rows (GPU.md
  writes all B rows); FLOPs of the draft layers on B rows, non-causal attention (every block
  row sees context_len + B keys), the lm_head on rows 1..B-1, and the context update fc +
  k/v projections of every draft layer on B rows.
Norms, RoPE, sampling and activations are left out (they are the slack above the floor).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

# ----------------------------------------------------------------------------- measuring


def _device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _time_ms(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Per-call times in ms: CUDA events around each call on a GPU, perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def copy_bandwidth_gbs(device: str | torch.device | None = None, nbytes: int | None = None,
                       repeats: int = 20, warmup: int = 3) -> float:
    """Device-to-device copy rate in GB/s (10^9 bytes/s), counting bytes read + written, median
    of `repeats` copies. Default size: 1 GiB on a GPU (far beyond L2), 32 MiB on the CPU."""
    dev = _device(device)
    if nbytes is None:
        nbytes = 2**30 if dev.type == "cuda" else 32 * 2**20
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    ms = statistics.median(_time_ms(lambda: dst.copy_(src), dev, repeats, warmup))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def gemm_tflops(device: str | torch.device | None = None,
                shapes: list[tuple[int, int, int]] | None = None,
                dtype: torch.dtype = torch.bfloat16, repeats: int = 20, warmup: int = 3) -> float:
    """bf16 `torch.matmul` rate in TFLOP/s (2*m*n*k per product): the best, over the (m, n, k)
    shapes, of the median of `repeats` products. Default shapes: large square-ish ones on a GPU,
    one 256^3 product on the CPU."""
    dev = _device(device)
    if shapes is None:
        shapes = [(8192, 8192, 8192), (16384, 8192, 8192)] if dev.type == "cuda" else [(256, 256, 256)]
    best = 0.0
    for m, n, k in shapes:
        a = torch.randn(m, k, device=dev).to(dtype)
        b = torch.randn(k, n, device=dev).to(dtype)
        out = torch.empty(m, n, dtype=dtype, device=dev)
        ms = statistics.median(_time_ms(lambda: torch.matmul(a, b, out=out), dev, repeats, warmup))
        best = max(best, 2 * m * n * k / (ms * 1e-3) / 1e12)
        a = b = out = None  # free before the next shape
    return best


# ----------------------------------------------------------------------------- the floor


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass(frozen=True)
class _Shape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, cfg: Any) -> _Shape:
        heads = _get(cfg, "num_attention_heads")
        hidden = _get(cfg, "hidden_size")
        return cls(
            layers=_get(cfg, "num_hidden_layers"), hidden=hidden, q_heads=heads,
            kv_heads=_get(cfg, "num_key_value_heads") or heads,
            head_dim=_get(cfg, "head_dim") or hidden // heads,
            intermediate=_get(cfg, "intermediate_size"), vocab=_get(cfg, "vocab_size"),
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        h, q, kv, i = self.hidden, self.q_heads * self.head_dim, self.kv_width, self.intermediate
        return h * q + 2 * h * kv + q * h + 3 * h * i

    @property
    def layer_norm_params(self) -> int:
        return 2 * self.hidden + 2 * self.head_dim  # input/post-attention norms, q_norm, k_norm

    def kv_elems_per_token(self, layers: int) -> int:
        return layers * 2 * self.kv_width


def _draft_taps(draft: Any) -> int:
    dflash = _get(draft, "dflash_config") or {}
    taps = dflash.get("target_layer_ids") if isinstance(dflash, dict) else None
    taps = taps if taps is not None else _get(draft, "target_layer_ids")
    return len(taps) if taps else _get(draft, "num_hidden_layers")


@dataclass(frozen=True)
class StepFloor:
    bytes: float
    flops: float
    copy_gbs: float
    gemm_tflops: float

    @property
    def bytes_ms(self) -> float:
        return self.bytes / (self.copy_gbs * 1e9) * 1e3

    @property
    def flops_ms(self) -> float:
        return self.flops / (self.gemm_tflops * 1e12) * 1e3

    @property
    def floor_ms(self) -> float:
        return max(self.bytes_ms, self.flops_ms)

    @property
    def bound(self) -> str:
        return "bytes" if self.bytes_ms >= self.flops_ms else "flops"


def step_floor(target: Any, draft: Any = None, *, batch_size: int, context_len: int,
               rows_per_request: int = 1, draft_pass: bool = False, copy_gbs: float,
               gemm_tflops: float, weight_bytes: int = 2, kv_bytes: int = 2,
               draft_vocab: int | None = None) -> StepFloor:
    """Bytes and FLOPs of one step (see the module docstring for what is counted).
    `target` / `draft`: config.json dicts or ModelConfig / DraftConfig objects.
    rows_per_request: 1 for a spec-off decode, B (the block size) for a verify step.
    draft_pass: a DFlash draft pass runs in this step (needs `draft`), over B = rows_per_request rows.
    draft_vocab: the draft's logits over this many rows of the lm_head (None: all of them)."""
    if draft_pass and draft is None:
        raise ValueError("draft_pass needs the draft config")
    t = _Shape.of(target)
    n, ctx, rows = batch_size, context_len, rows_per_request
    lm_head = t.vocab * t.hidden
    # target pass
    weights = t.layers * (t.layer_matmul_params + t.layer_norm_params) + t.hidden + lm_head
    nbytes = weights * weight_bytes
    nbytes += n * t.kv_elems_per_token(t.layers) * (ctx + rows) * kv_bytes  # read context, write rows
    flops = 2 * (t.layers * t.layer_matmul_params + lm_head) * n * rows
    keys_causal = rows * ctx + rows * (rows + 1) // 2  # (row, key) pairs per request
    flops += 4 * t.q_heads * t.head_dim * keys_causal * t.layers * n
    if draft_pass:
        d = _Shape.of(draft)
        b = rows
        fc = _draft_taps(draft) * d.hidden * d.hidden
        d_weights = fc + d.hidden + d.layers * (d.layer_matmul_params + d.layer_norm_params) + d.hidden
        d_head = lm_head if draft_vocab is None else draft_vocab * t.hidden
        nbytes += (d_weights + d_head) * weight_bytes
        nbytes += n * d.kv_elems_per_token(d.layers) * (ctx + 2 * b) * kv_bytes
        flops += 2 * d.layers * d.layer_matmul_params * n * b  # block rows through the layers
        flops += 4 * d.q_heads * d.head_dim * b * (ctx + b) * d.layers * n  # non-causal attention
        flops += 2 * d_head * n * (b - 1)  # draft logits, rows 1..B-1
        flops += 2 * (fc + d.layers * 2 * d.hidden * d.kv_width) * n * b  # context update
    return StepFloor(bytes=float(nbytes), flops=float(flops), copy_gbs=copy_gbs, gemm_tflops=gemm_tflops)


def step_floor_ms(target: Any, draft: Any = None, *, batch_size: int, context_len: int,
                  rows_per_request: int = 1, draft_pass: bool = False, copy_gbs: float,
                  gemm_tflops: float, weight_bytes: int = 2, kv_bytes: int = 2) -> float:
    """The floor of one step in ms: max(bytes / copy rate, FLOPs / GEMM rate)."""
    return step_floor(target, draft, batch_size=batch_size, context_len=context_len,
                      rows_per_request=rows_per_request, draft_pass=draft_pass, copy_gbs=copy_gbs,
                      gemm_tflops=gemm_tflops, weight_bytes=weight_bytes, kv_bytes=kv_bytes).floor_ms


# ----------------------------------------------------------------------------- script


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--context-len", type=int, default=1024)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    dev = _device(args.device)
    if dev.type == "cuda":
        label = f"{torch.cuda.get_device_name(dev)} (cuda)"
    else:
        label = "CPU (no GPU: tiny sizes, a smoke run, not a GPU ceiling)"
    copy = copy_bandwidth_gbs(dev)
    gemm = gemm_tflops(dev)

    from dflash_engine.random_checkpoint import DRAFT_LAYERS, draft_config, target_config

    tcfg = target_config("qwen3-8b")
    dcfg = draft_config(tcfg, DRAFT_LAYERS["qwen3-8b"])
    block = dcfg["block_size"]
    floors = []
    for c in (1, 8, 32):
        off = step_floor(tcfg, batch_size=c, context_len=args.context_len, copy_gbs=copy, gemm_tflops=gemm)
        on = step_floor(tcfg, dcfg, batch_size=c, context_len=args.context_len, rows_per_request=block,
                        draft_pass=True, copy_gbs=copy, gemm_tflops=gemm)
        floors.append({"concurrency": c, "decode": {**asdict(off), "floor_ms": off.floor_ms, "bound": off.bound},
                       "draft_verify": {**asdict(on), "floor_ms": on.floor_ms, "bound": on.bound}})
    if args.json:
        print(json.dumps({"device": label, "copy_gbs": copy, "gemm_tflops": gemm,
                          "context_len": args.context_len, "qwen3_8b_floors": floors}, indent=2))
        return 0
    print(f"device: {label}")
    print(f"copy bandwidth (device to device, read + written): {copy:,.1f} GB/s")
    print(f"bf16 GEMM (torch.matmul): {gemm:,.1f} TFLOP/s")
    print(f"step floors, Qwen3-8B shape + 5-layer DFlash draft (block {block}), context {args.context_len}, "
          f"at these ceilings:")
    print("| c | decode (spec off) | draft + verify |")
    print("|---|---|---|")
    for f in floors:
        d, v = f["decode"], f["draft_verify"]
        print(f"| {f['concurrency']} | {d['floor_ms']:.2f} ms ({d['bound']}) | {v['floor_ms']:.2f} ms ({v['bound']}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
