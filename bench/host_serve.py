"""The server's host time with the device taken out (issue 22, item 4).

Usage: python bench/host_serve.py [--c 32] [--k 15] [--prompts 96] [--output-len 256]

`dflash-engine serve`'s app (the embedded SmolLM2 engine on the CPU, its shipped draft, K
fixed) with the runner's `launch` replaced by a stub that returns at once (random acceptance,
random non-EOS tokens, as in bench/host_step.py), served by uvicorn in this process, and
`dflash-engine bench serve` as the client in another process (HumanEval prompts on the chat
endpoint, streaming). With the device's time gone, the output tok/s is what the host alone
allows: the engine thread's steps and the event loop's streaming, sharing one GIL. Prints the
client's table and the engine's steps per second. Compare before / after on one machine.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--c", type=int, default=32)
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--per-output", action="store_true",
                    help="hand each output to its stream's loop on its own (the delivery before the batched one)")
    args = ap.parse_args(argv)

    import uvicorn

    from dflash_engine.config import EngineConfig
    from dflash_engine.engine import LLMEngine
    from dflash_engine.server.api_server import build_app
    from dflash_engine.server.async_engine import AsyncLLMEngine
    from dflash_engine.worker.in_flight import InFlight

    if args.per_output:  # one hand-off per output: the batched delivery called once per output
        batched = AsyncLLMEngine._deliver
        AsyncLLMEngine._deliver = lambda self, outputs: [batched(self, [out]) for out in outputs] and None
    steps = [0]
    spec = {"method": "dflash", "num_speculative_tokens": args.k, "draft_length": "fixed"} if args.k else "none"

    def factory() -> LLMEngine:
        engine = LLMEngine(EngineConfig(model=None, speculative_config=spec, max_num_seqs=args.c, max_model_len=2048,
                                        device="cpu"))
        runner, rng = engine.runner, np.random.default_rng(0)
        vocab = engine.model_config.vocab_size

        def launch(plan, st, all_greedy):  # the device's work, done at once; ~2.6 drafts accepted a step
            steps[0] += 1
            accepted = np.minimum(rng.geometric(0.28, len(plan)) - 1, plan.num_drafts).astype(np.int64)
            sampled = rng.integers(100, vocab - 100, len(plan.sample_rows)).astype(np.int64)
            return InFlight(lambda: (accepted, sampled), runner.device)

        runner.launch = launch
        return engine

    async_engine = AsyncLLMEngine.build(factory)
    app = build_app(async_engine, "host-serve")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    steps0 = steps[0]
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dflash_engine.cli", "bench", "serve", "--port", str(args.port),
                        "--backend", "openai-chat", "--dataset-name", "humaneval", "--humaneval-output-len",
                        str(args.output_len), "--ignore-eos", "--num-prompts", str(args.prompts), "--concurrency",
                        str(args.c), "--result-dir", out, "--result-filename", "r.json", "--disable-tqdm"], check=True)
        wall = time.perf_counter() - t0
        rung = json.load(open(f"{out}/r.json"))["rungs"][0]
    n = steps[0] - steps0
    print(f"c={args.c} K={args.k} {'per-output' if args.per_output else 'batched'} delivery: {n} engine steps in {wall:.1f} s ({n / wall:.0f} steps/s, {wall / max(n, 1) * 1e3:.2f} ms a step); "
          f"client output tok/s {rung.get('output_throughput', rung.get('output_tok_s'))}")
    server.should_exit = True
    thread.join(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
