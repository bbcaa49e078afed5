"""Flags of `dflash-engine serve`, `generate` and `bench serve`, named as vLLM names them.

Defaults that come from the environment are read through envs.py when the parser is built.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from . import envs
from .config import MAMBA_SSM_CACHE_DTYPES


def speculative_config_arg(text: str) -> dict[str, Any] | str:
    """--speculative-config: a JSON object, or auto / none."""
    if text.strip().lower() in ("auto", "none", "off"):
        return text.strip().lower()
    return _json_object(text)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be positive integers")
    return values


def _int_at_least(low: int):
    """An argparse type: an integer >= `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def add_batch_invariant_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                        help="exact CPU GEMMs: a row's bits never depend on its batch, so spec-on "
                             "output equals spec-off exactly (slower at one request); default: "
                             "$VLLM_BATCH_INVARIANT / $DFLASH_BATCH_INVARIANT, else off")


def add_cpu_weights_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-weights", default=None, choices=["auto", "none", "bf16", "int4"],
                        help="the fast CPU mode's GEMM weights: auto (default: int4 for a GGUF model "
                             "such as the bundled one at --dtype auto, bf16 for a bfloat16 model, else "
                             "none), none (the model's dtype), bf16, int4 (where a weight is on a 4-bit "
                             "grid, bf16 elsewhere); never used with --batch-invariant")


def add_tensor_parallel_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", "-tp", dest="tensor_parallel_size", type=_positive_int,
                        default=None,
                        help="split the target and the draft over N ranks (this process and N-1 worker "
                             "processes; N GPUs on CUDA, gloo on the CPU); default 1")
    parser.add_argument("--distributed-executor-backend", dest="distributed_executor_backend", default=None,
                        choices=["mp", "external_launcher"],
                        help="mp (default): this process starts the other ranks; external_launcher: torchrun "
                             "started them (`torchrun --nproc-per-node N -m dflash_engine.cli serve ... -tp N "
                             "--distributed-executor-backend external_launcher`: rank 0 serves, the others "
                             "are its workers)")


def add_state_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mamba-ssm-cache-dtype", default=None, choices=list(MAMBA_SSM_CACHE_DTYPES),
                        help="a hybrid (Qwen3.5) target's recurrent-state dtype: auto (default: the "
                             "checkpoint's mamba_ssm_dtype, float32 when absent), float32, bfloat16, float16 "
                             "(16-bit: half the state memory, more concurrent requests)")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model", nargs="?", default=None,
                        help="HF-style model directory or .gguf file (default: the bundled "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--model", dest="model_flag", default=None,
                        help="same as the positional MODEL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="name clients send as `model` (default: the model path)")
    parser.add_argument("--api-key", default=envs.server_api_key(),
                        help="require `Authorization: Bearer KEY` on /v1/* "
                             "(default: $DFLASH_API_KEY)")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one engine step (default: max(2048, (K+1) x "
                             "max-num-seqs), K the speculative tokens per step, 0 with speculation off)")
    parser.add_argument("--num-gpu-blocks-override", "--num-blocks", dest="num_gpu_blocks_override",
                        type=int, default=None, help="KV pool size in pages (skips memory sizing)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="share the KV of cached prompt prefixes (target and DFlash draft); "
                             "on by default, --no-enable-prefix-caching turns it off")
    parser.add_argument("--speculative-config", type=speculative_config_arg, default="auto",
                        help='JSON, e.g. \'{"method": "dflash", "model": DRAFT_DIR, "num_speculative_tokens": 15}\'; '
                             '"none": off; "auto" (default): the shipped DFlash draft when the model is the '
                             'embedded default (on a GPU or the CPU), off for other models; '
                             '\'{"method": "dflash"}\' alone: the shipped draft (embedded model only)')
    parser.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="GPU: run decode steps without CUDA graphs (same tokens, slower)")
    parser.add_argument("--max-mixed-graph-tokens", type=_non_negative_int, default=None,
                        help="GPU: the most prefill tokens a step beside decode rows may carry and "
                             "still replay a CUDA graph (captured at startup; default 512): while requests decode, "
                             "the scheduler holds a step's prefill to it; 0: no mixed graphs, such "
                             "steps run eagerly with no limit on their prefill")
    parser.add_argument("--tune-gemms", action=argparse.BooleanOptionalAction, default=None,
                        help="GPU: at startup, time the skinny Triton GEMM against cuBLAS for each "
                             "few-row GEMM shape of the step and use the faster (default: off, cuBLAS "
                             "everywhere; tuning adds 25-40 s to an 8B model's startup)")
    add_batch_invariant_arg(parser)
    add_cpu_weights_arg(parser)
    add_tensor_parallel_arg(parser)
    add_state_dtype_arg(parser)
    parser.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                        help="build each step's outputs after it, not while the GPU runs the next "
                             "(default: overlapped; also DFLASH_OVERLAP=0)")
    parser.add_argument("--disable-frontend-multiprocessing", action="store_true",
                        help="run the engine on a thread of the server's process (default: in a process "
                             "of its own, so HTTP and streaming never hold the GIL the engine's steps "
                             "need); torchrun's external_launcher always runs it in-process")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=4 * 1024 * 1024,
                        help="larger request bodies get a 413 (default: 4 MiB)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return parser


_ENGINE_FLAGS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                 "gpu_memory_utilization", "block_size", "speculative_config", "dtype", "device", "seed",
                 "enforce_eager", "max_mixed_graph_tokens", "tune_gemms", "batch_invariant", "overlap", "cpu_weights",
                 "tensor_parallel_size", "mamba_ssm_cache_dtype", "distributed_executor_backend")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from serve flags; unset flags keep the engine defaults."""
    kwargs = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name) is not None}
    kwargs["enable_prefix_caching"] = bool(args.enable_prefix_caching)
    kwargs["model"] = args.model_flag or args.model
    return kwargs


def _num_prompts(value: str) -> int | str:
    """N requests per rung, 'auto', or 'Kx' (K x the rung's concurrency)."""
    if value == "auto":
        return value
    per_seat = value.endswith("x")
    try:
        n = int(value[:-1] if per_seat else value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--num-prompts must be >= 1, 'auto' or 'Kx' (K >= 1), got {value!r}")
    return f"{n}x" if per_seat else n


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default=None,
                        help="server root, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend", choices=["openai", "openai-chat"], default="openai-chat",
                        help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=envs.client_api_key(),
                        help="sent as `Authorization: Bearer KEY` (default: $DFLASH_API_KEY, "
                             "else $OPENAI_API_KEY)")
    parser.add_argument("--dataset-name", choices=["random", "humaneval", "custom"], default="random",
                        help="custom: --dataset-path, a JSONL file with one {\"prompt\": ...} per line (as vLLM)")
    parser.add_argument("--dataset-path", default=None, help="the custom dataset's JSONL file")
    parser.add_argument("--custom-output-len", type=int, default=256)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=512)
    parser.add_argument("--humaneval-output-len", type=int, default=512)
    parser.add_argument("--num-prompts", type=_num_prompts, default=64,
                        help="requests per rung: N, 'Kx' (K x the rung's concurrency), or 'auto': 8 below "
                             "concurrency 4, 4 x concurrency from 4 on")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16, 32],
                        help="comma-separated concurrency ladder")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                        help="default: on for random, off for humaneval and custom")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None,
                        help="JSON name; the PNG gets the same stem (default: timestamped)")
    parser.add_argument("--label", default=None, help="free text recorded in the JSON and plot title")
    parser.add_argument("--disable-tqdm", action="store_true")
    return parser
