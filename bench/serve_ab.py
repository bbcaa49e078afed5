"""A/B of `dflash-engine serve` configurations through the HTTP server, alternated in rounds so
that a machine whose speed drifts (a shared CPU) hits every configuration alike (issue 20:
"the default serve on a fresh CPU machine is never slower than --speculative-config none on
chat prompts").

    python bench/serve_ab.py [--model M] [--configs default,none] [--rounds 3] [--concurrency 1]
        [--set chat|humaneval] [--num-prompts 16] [--output-len 128] [--json out.json] [-- serve flags]

Each round starts one server per configuration in turn (`--speculative-config` is the
configuration; `default` passes none: the engine's default), runs `dflash-engine bench serve`
(`--dataset-name custom`, greedy, EOS honoured) against it, and stops it. Reported per
configuration: output tok/s of every round and the median; the ratio of each configuration's
median to the first one's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"server not healthy within {timeout:g} s")


def one(config: str, args, data: str, out_dir: str, tag: str, serve_flags: list[str]) -> float:
    cmd = [sys.executable, "-m", "dflash_engine.cli", "serve", *([args.model] if args.model else []),
           "--port", str(args.port), "--max-num-seqs", str(max(args.concurrency, 1)), *serve_flags]
    if config != "default":
        cmd += ["--speculative-config", config]
    log = open(Path(out_dir) / f"server_{tag}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(args.port, proc, args.start_timeout)
        name = f"{tag}.json"
        subprocess.run([sys.executable, "-m", "dflash_engine.cli", "bench", "serve", "--port", str(args.port),
                        "--backend", "openai-chat", "--dataset-name", "custom", "--dataset-path", data,
                        "--custom-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                        "--concurrency", str(args.concurrency), "--result-dir", out_dir, "--result-filename", name,
                        "--disable-tqdm"], check=True, stdout=subprocess.DEVNULL)
        (rung,) = json.loads((Path(out_dir) / name).read_text())["rungs"]
        if rung["status"] != "OK":
            raise SystemExit(f"{config}: rung {rung['status']} ({rung['failed']} failed)")
        return float(rung["output_throughput"])
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--configs", default="default,none",
                    help="comma-separated --speculative-config values (JSON has commas: use ';' then)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--set", choices=["chat", "humaneval"], default="chat")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import eval_draft

    configs = args.configs.split(";" if ";" in args.configs else ",")
    prompts = list(eval_draft.CHAT_PROMPTS) if args.set == "chat" else eval_draft.humaneval_prompts()
    out_dir = tempfile.mkdtemp(prefix="serve_ab_")
    data = os.path.join(out_dir, "prompts.jsonl")
    with open(data, "w") as f:
        for p in prompts[: args.num_prompts]:
            f.write(json.dumps({"prompt": p}) + "\n")
    rates: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for i, c in enumerate(configs):
            rates[c].append(one(c, args, data, out_dir, f"r{r}_c{i}", serve_flags))
            print(f"round {r}  {c:<40} {rates[c][-1]:8.1f} tok/s", flush=True)
    base = statistics.median(rates[configs[0]])
    rows = [{"config": c, "tok_s": rates[c], "median": statistics.median(rates[c]),
             "ratio_to_first": statistics.median(rates[c]) / base} for c in configs]
    for row in rows:
        print(f"{row['config']:<40} median {row['median']:8.1f} tok/s  ({row['ratio_to_first']:.3f}x)  "
              f"rounds {[round(x, 1) for x in row['tok_s']]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"set": args.set, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                       "output_len": args.output_len, "serve_flags": serve_flags, "rows": rows,
                       "logs": out_dir}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
