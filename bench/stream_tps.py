"""One streamed chat completion at a time against a running server: output tok/s per round.

    python bench/stream_tps.py [--port 8000] [--max-tokens 128] [--rounds 4]

Greedy, EOS ignored, the same chat prompt as bench/bench_cpu_decode.py; tok/s = max_tokens /
wall time of the request (first byte to [DONE]).
"""
from __future__ import annotations

import argparse
import json
import time

import httpx

PROMPT = "Write a short story about a robot who learns to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    base = f"http://{args.host}:{args.port}"
    with httpx.Client(timeout=600) as c:
        model = args.model or c.get(f"{base}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        for r in range(args.rounds):
            t0, tokens = time.perf_counter(), None
            with c.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        usage = json.loads(line[6:]).get("usage")
                        if usage:
                            tokens = usage["completion_tokens"]
            dt = time.perf_counter() - t0
            print(f"round {r}: {tokens} tokens in {dt:.2f}s -> {tokens / dt:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
