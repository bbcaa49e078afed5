"""`dflash-engine {serve,generate,chat,convert,make-random-checkpoint,train-draft,draft-vocab,bench serve}`."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _generate(args: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    llm = LLM(
        model=args.model, speculative_config=args.speculative_config, device=args.device or "auto",
        dtype=args.dtype or "auto", max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant, cpu_weights=args.cpu_weights or "auto",
        tensor_parallel_size=args.tensor_parallel_size or 1,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype or "auto",
        distributed_executor_backend=args.distributed_executor_backend or "mp",
    )
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        if args.chat:
            outs = llm.chat([{"role": "user", "content": p} for p in args.prompts][:1], params, use_tqdm=False)
        else:
            outs = llm.generate(list(args.prompts), params, use_tqdm=False)
        for out in outs:
            print(json.dumps({"prompt": out.prompt, "text": out.outputs[0].text,
                              "finish_reason": out.outputs[0].finish_reason}, ensure_ascii=False))
        st = llm.stats()
        if st.spec_num_drafts:
            print(f"# DFlash: drafts={st.spec_num_drafts} accepted={st.spec_num_accepted_tokens} "
                  f"tau={st.mean_acceptance_length:.2f}", file=sys.stderr)
    finally:
        llm.engine.close()  # the ranks and their groups stop now, not in the interpreter's teardown
    if args.distributed_executor_backend == "external_launcher":
        # A torchrun rank 0 leaves as its other ranks do (distributed/worker.py): done and
        # flushed, without the interpreter's teardown, where gloo's threads can abort the
        # process after the work is done (exit -6; distributed/groups.py, Groups.shutdown).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .cli_args import (
        add_batch_invariant_arg,
        add_bench_args,
        add_cpu_weights_arg,
        add_serve_args,
        add_state_dtype_arg,
        add_tensor_parallel_arg,
        speculative_config_arg,
    )

    ap = argparse.ArgumentParser(prog="dflash-engine", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))

    g = sub.add_parser("generate", help="generate from prompts offline and print JSON lines")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--model", default=None, help="HF directory or .gguf (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--chat", action="store_true", help="wrap the first prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--speculative-config", type=speculative_config_arg, default="auto",
                   help="JSON object, auto (default) or none; see `serve --help`")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    add_batch_invariant_arg(g)
    add_cpu_weights_arg(g)
    add_tensor_parallel_arg(g)
    add_state_dtype_arg(g)

    sub.add_parser("convert", help="convert a llama GGUF into a Hugging Face directory", add_help=False)
    sub.add_parser("make-random-checkpoint", add_help=False,
                   help="write a random-weight Qwen3 / Qwen3.5 target (and DFlash draft) in the Hugging Face format")
    sub.add_parser("train-draft", add_help=False,
                   help="train a DFlash draft for a target (data written by the target itself)")
    sub.add_parser("draft-vocab", add_help=False,
                   help="rank the target's tokens for a reduced draft vocabulary (speculative_config draft_vocab_size)")
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    add_bench_args(bsub.add_parser("serve", help="load generator against an OpenAI-compatible server"))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "convert":
        from .gguf_convert import main as convert_main

        return convert_main(argv[1:])
    if argv and argv[0] == "train-draft":  # dispatched early: its own flags, no server packages
        from .train.cli import main as train_draft_main

        return train_draft_main(argv[1:])
    if argv and argv[0] == "draft-vocab":  # dispatched early: its own flags
        from .train.draft_vocab import main as draft_vocab_main

        return draft_vocab_main(argv[1:])
    if argv and argv[0] == "make-random-checkpoint":  # dispatched early: needs no server packages
        from .random_hybrid import main as random_checkpoint_main  # Qwen3 and Qwen3.5 shapes

        return random_checkpoint_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from .server.api_server import run_server

        run_server(args)
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench":
        from .bench_serve import main as bench_main

        return bench_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
