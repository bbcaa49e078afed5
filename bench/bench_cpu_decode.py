"""CPU decode speed of the embedded SmolLM2-135M-Instruct at one request: this engine in the
fast mode (plain CPU GEMMs, the default) and the exact mode (batch-invariant GEMMs,
--batch-invariant), beside transformers' `generate` on the same dequantised weights.

    python bench/bench_cpu_decode.py [--max-tokens 128] [--repeats 3] [--modes fast,exact] [--no-hf]

Greedy, a chat-template prompt, exactly --max-tokens new tokens (EOS ignored), spec off.
tok/s = new tokens / wall time of the whole request (prefill included). Prints one JSON line
per configuration and a summary table.
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


def _timed(fn, repeats: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def bench_engine(batch_invariant: bool, max_tokens: int, repeats: int, prompt: str, speculative_config=None):
    from dflash_engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=None, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=1,
              batch_invariant=batch_invariant, speculative_config=speculative_config)
    load_s = time.perf_counter() - t0
    msgs = [{"role": "user", "content": prompt}]
    llm.chat(msgs, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times, outs = _timed(lambda: llm.chat(msgs, params, use_tqdm=False), repeats)
    out = outs[0]
    n = len(out.outputs[0].token_ids)
    assert n == max_tokens, n
    return {"engine": "dflash-engine", "mode": "exact" if batch_invariant else "fast",
            "spec": speculative_config is not None, "prompt_tokens": len(out.prompt_token_ids),
            "new_tokens": n, "seconds": [round(t, 3) for t in times],
            "tok_s": round(n / statistics.median(times), 2), "load_s": round(load_s, 2),
            "token_ids": out.outputs[0].token_ids, "text": out.outputs[0].text}


def bench_transformers(max_tokens: int, repeats: int, prompt: str):
    from transformers import AutoModelForCausalLM

    from dflash_engine.model_path import default_model_dir
    from dflash_engine.tokenizer import Tokenizer

    path = default_model_dir()
    tok = Tokenizer.from_dir(path)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
              min_new_tokens=max_tokens, pad_token_id=model.config.pad_token_id)
    with torch.inference_mode():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        times, out = _timed(lambda: model.generate(ids, **kw), repeats)
    new = out[0, ids.shape[1]:].tolist()
    return {"engine": "transformers", "mode": "generate", "spec": False, "prompt_tokens": ids.shape[1],
            "new_tokens": len(new), "seconds": [round(t, 3) for t in times],
            "tok_s": round(len(new) / statistics.median(times), 2), "token_ids": new}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="fast,exact")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--draft", default=None, help="also run spec on with this DFlash draft directory")
    ap.add_argument("--json", default=None, help="write all results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg()}
    print(json.dumps(info), flush=True)
    results = []
    for mode in [m for m in args.modes.split(",") if m]:
        if mode not in ("fast", "exact"):
            ap.error(f"unknown mode {mode!r}")
        results.append(bench_engine(mode == "exact", args.max_tokens, args.repeats, args.prompt))
        if args.draft:
            spec = {"method": "dflash", "model": args.draft}
            results.append(bench_engine(mode == "exact", args.max_tokens, args.repeats, args.prompt, spec))
    if not args.no_hf:
        results.append(bench_transformers(args.max_tokens, args.repeats, args.prompt))
    info["loadavg_after"] = os.getloadavg()
    for r in results:
        print(json.dumps({k: v for k, v in r.items() if k not in ("token_ids", "text")}), flush=True)
    ref = results[0]["token_ids"]
    print(f"\n{'engine':<15}{'mode':<10}{'spec':<6}{'tok/s':>8}   same tokens as {results[0]['mode']}")
    for r in results:
        print(f"{r['engine']:<15}{r['mode']:<10}{str(r['spec']):<6}{r['tok_s']:>8.2f}   {r['token_ids'] == ref}")
    print(f"threads {info['threads']}, load average before {info['loadavg_before']}, after {info['loadavg_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
