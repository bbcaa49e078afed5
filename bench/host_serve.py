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
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dflash_engine.engine import LLMEngine


def stub_engine(c: int, k: int, device_ms: float) -> LLMEngine:
    """The embedded engine with the device's work stubbed (module level: the engine process
    builds it by name)."""
    from dflash_engine.config import EngineConfig
    from dflash_engine.engine import LLMEngine
    from dflash_engine.worker.in_flight import InFlight

    spec = {"method": "dflash", "num_speculative_tokens": k, "draft_length": "fixed"} if k else "none"
    engine = LLMEngine(EngineConfig(model=None, speculative_config=spec, max_num_seqs=c, max_model_len=2048,
                                    device="cpu"))
    runner, rng = engine.runner, np.random.default_rng(0)
    vocab = engine.model_config.vocab_size

    def launch(plan, st, all_greedy):  # the device's work: ~2.6 drafts accepted a step
        accepted = np.minimum(rng.geometric(0.28, len(plan)) - 1, plan.num_drafts).astype(np.int64)
        sampled = rng.integers(100, vocab - 100, len(plan.sample_rows)).astype(np.int64)
        done_at = time.perf_counter() + device_ms / 1e3

        def wait():  # as a device copy: the GIL is free while the "device" runs
            if (left := done_at - time.perf_counter()) > 0:
                time.sleep(left)
            return accepted, sampled

        return InFlight(wait, runner.device)

    runner.launch = launch
    return engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--c", type=int, default=32)
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--port", type=int, default=8031)
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="the stub device's time per step (its results wait that long, GIL released)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the engine in a process of its own (serve's default) instead of a thread")
    ap.add_argument("--per-output", action="store_true",
                    help="hand each output to its stream's loop on its own (the delivery before the batched one)")
    args = ap.parse_args(argv)
    if args.per_output and args.engine_process:
        ap.error("--per-output patches the engine thread's delivery; the engine process batches per step")

    import uvicorn

    from dflash_engine.server.api_server import build_app
    from dflash_engine.server.async_engine import AsyncLLMEngine
    from dflash_engine.server.engine_process import EngineProcessClient

    if args.per_output:  # one hand-off per output: the batched delivery called once per output
        batched = AsyncLLMEngine._deliver
        AsyncLLMEngine._deliver = lambda self, outputs: [batched(self, [out]) for out in outputs] and None
    factory_kwargs = {"c": args.c, "k": args.k, "device_ms": args.device_ms}
    if args.engine_process:
        async_engine = EngineProcessClient.build(factory_kwargs, factory=stub_engine)
    else:
        async_engine = AsyncLLMEngine.build(lambda: stub_engine(**factory_kwargs))
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
    steps0 = sum(async_engine.stats().spec_draft_len_counts.values())
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dflash_engine.cli", "bench", "serve", "--port", str(args.port),
                        "--backend", "openai-chat", "--dataset-name", "humaneval", "--humaneval-output-len",
                        str(args.output_len), "--ignore-eos", "--num-prompts", str(args.prompts), "--concurrency",
                        str(args.c), "--result-dir", out, "--result-filename", "r.json", "--disable-tqdm"], check=True)
        wall = time.perf_counter() - t0
        rung = json.load(open(f"{out}/r.json"))["rungs"][0]
    time.sleep(0.1)  # the engine process's last stats
    n = sum(async_engine.stats().spec_draft_len_counts.values()) - steps0
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{args.port}/metrics").read().decode()
    ttft = {k: float(re.search(rf"^vllm:time_to_first_token_seconds_{k}{{[^}}]*}} (\S+)$", metrics, re.M).group(1))
            for k in ("sum", "count")}
    mode = "engine process" if args.engine_process else "engine thread"
    print(f"c={args.c} K={args.k} device {args.device_ms} ms, {mode}, "
          f"{'per-output' if args.per_output else 'batched'} delivery: {n} engine steps in {wall:.1f} s "
          f"({n / wall:.0f} steps/s, {wall / max(n, 1) * 1e3:.2f} ms a step); client output tok/s "
          f"{rung.get('output_throughput', rung.get('output_tok_s')):.0f}, TTFT client {rung.get('mean_ttft_ms', 0):.1f} ms "
          f"/ server {ttft['sum'] / max(ttft['count'], 1) * 1e3:.1f} ms (from add_request)")
    server.should_exit = True
    thread.join(timeout=10)
    async_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
