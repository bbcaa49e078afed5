"""CPU decode speed of the embedded SmolLM2-135M-Instruct at one request: this engine in the
fast mode (plain CPU GEMMs, the default) and the exact mode (batch-invariant GEMMs,
--batch-invariant), beside transformers' `generate` on the same dequantised weights.

    python bench/bench_cpu_decode.py [--max-tokens 128] [--repeats 3] [--modes fast,exact] [--no-hf]

Greedy, a chat-template prompt, exactly --max-tokens new tokens (EOS ignored), spec off.
tok/s = new tokens / wall time of the whole request (prefill included). Every configuration is
loaded and warmed up first, then timed once per round for --repeats rounds (interleaved, so a
shared machine's load hits all alike); the median and best round are reported. Prints one JSON
line per configuration and a summary table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

PROMPT = "Write a short story about a robot who learns to paint."


class EngineRunner:
    def __init__(self, batch_invariant: bool, max_tokens: int, prompt: str, speculative_config=None,
                 dtype: str = "float32"):
        from dflash_engine import LLM, SamplingParams

        t0 = time.perf_counter()
        self.llm = LLM(model=None, device="cpu", dtype=dtype, max_model_len=1024, max_num_seqs=1,
                       batch_invariant=batch_invariant, speculative_config=speculative_config)
        self.load_s = time.perf_counter() - t0
        self.msgs = [{"role": "user", "content": prompt}]
        self.params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.llm.chat(self.msgs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        self.info = {"engine": "dflash-engine", "mode": "exact" if batch_invariant else "fast",
                     "dtype": dtype, "spec": speculative_config is not None}

    def __call__(self) -> tuple[list[int], int]:
        out = self.llm.chat(self.msgs, self.params, use_tqdm=False)[0]
        return out.outputs[0].token_ids, len(out.prompt_token_ids)


class TransformersRunner:
    def __init__(self, max_tokens: int, prompt: str):
        from transformers import AutoModelForCausalLM

        from dflash_engine.model_path import default_model_dir
        from dflash_engine.tokenizer import Tokenizer

        path = default_model_dir()
        tok = Tokenizer.from_dir(path)
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        self.ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t0
        self.kw = dict(attention_mask=torch.ones_like(self.ids), do_sample=False, max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, pad_token_id=self.model.config.pad_token_id)
        with torch.inference_mode():  # warm-up
            self.model.generate(self.ids, **{**self.kw, "max_new_tokens": 8, "min_new_tokens": 8})
        self.info = {"engine": "transformers", "mode": "generate", "spec": False}

    def __call__(self) -> tuple[list[int], int]:
        with torch.inference_mode():
            out = self.model.generate(self.ids, **self.kw)
        return out[0, self.ids.shape[1]:].tolist(), self.ids.shape[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="fast,exact")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--dtypes", default="float32",
                    help="engine dtypes, comma-separated (float32, bfloat16, auto); each mode runs in each")
    ap.add_argument("--draft", default=None, help="also run spec on with this DFlash draft directory")
    ap.add_argument("--num-speculative-tokens", type=int, default=None, help="spec on: K (default: the draft's)")
    ap.add_argument("--json", default=None, help="write all results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg()}
    print(json.dumps(info), flush=True)
    runners = []
    for mode in [m for m in args.modes.split(",") if m]:
        if mode not in ("fast", "exact"):
            ap.error(f"unknown mode {mode!r}")
        for dtype in [d for d in args.dtypes.split(",") if d]:
            runners.append(EngineRunner(mode == "exact", args.max_tokens, args.prompt, dtype=dtype))
            if args.draft:
                spec = {"method": "dflash", "model": args.draft}
                if args.num_speculative_tokens is not None:
                    spec["num_speculative_tokens"] = args.num_speculative_tokens
                runners.append(EngineRunner(mode == "exact", args.max_tokens, args.prompt, spec, dtype=dtype))
    if not args.no_hf:
        runners.append(TransformersRunner(args.max_tokens, args.prompt))
    # Rounds: every configuration once per round, so that all of them see the same machine
    # (other processes come and go on a shared box); best and median of the rounds.
    times: list[list[float]] = [[] for _ in runners]
    outs: list[tuple[list[int], int]] = [None] * len(runners)  # type: ignore[list-item]
    for _ in range(args.repeats):
        for i, run in enumerate(runners):
            t0 = time.perf_counter()
            outs[i] = run()
            times[i].append(time.perf_counter() - t0)
    info["loadavg_after"] = os.getloadavg()
    results = []
    for run, ts, (tokens, n_prompt) in zip(runners, times, outs):
        n = len(tokens)
        assert n == args.max_tokens, n
        results.append({**run.info, "prompt_tokens": n_prompt, "new_tokens": n, "seconds": [round(t, 3) for t in ts],
                        "tok_s_median": round(n / statistics.median(ts), 2), "tok_s_best": round(n / min(ts), 2),
                        "load_s": round(run.load_s, 2), "token_ids": tokens})
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k != "token_ids"}), flush=True)
    ref = results[0]["token_ids"]
    print(f"\n{'engine':<15}{'mode':<10}{'dtype':<10}{'spec':<6}{'tok/s median':>13}{'best':>8}   "
          f"same tokens as the first")
    for r in results:
        print(f"{r['engine']:<15}{r['mode']:<10}{r.get('dtype', 'float32'):<10}{str(r['spec']):<6}"
              f"{r['tok_s_median']:>13.2f}{r['tok_s_best']:>8.2f}   {r['token_ids'] == ref}")
    print(f"threads {info['threads']}, load average before {info['loadavg_before']}, after {info['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
