"""Prometheus metrics under the names vLLM's dashboards and `vllm bench serve` read.

Latency histograms are observed per request by the engine thread as outputs arrive.
Gauges and counters are read at scrape time from the engine's cumulative ``stats()``
snapshot, so they can never drift from the engine's own accounting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..outputs import RequestOutput

if TYPE_CHECKING:
    from ..engine import EngineStats
    from .async_engine import RequestStream

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket edges as in vLLM, so dashboards built for it read the same quantiles.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

# (metric name without _total, EngineStats field, help)
_COUNTERS = [
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("vllm:spec_decode_num_drafts", "spec_num_drafts", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens",
     "Number of accepted tokens."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits",
     "Prefix cache hits, in terms of number of cached tokens."),
    # Step timing (dflash_engine/step_timer.py): device busy from each step's first launch to
    # its last; idle between one step's end and the next one's start while requests wait.
    ("dflash:step_device_busy_seconds", "step_busy_seconds",
     "Device time from each engine step's first launch to its last, summed."),
    ("dflash:step_device_idle_seconds", "step_idle_seconds",
     "Device time between consecutive engine steps while requests were running or waiting."),
    ("dflash:steps", "num_steps", "Engine steps timed."),
    ("dflash:step_host_gaps", "step_host_gaps",
     "Gaps between steps whose host time is in dflash:step_host_seconds."),
    ("dflash:step_host_overlapped_seconds", "step_host_overlapped_seconds",
     "Host time spent on a step's outputs while the device ran the next step."),
]
_GAUGES = [
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
]


class _EngineStatsCollector:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], acceptance: str) -> None:
        self.model_name = model_name
        self.stats = stats
        self.acceptance = acceptance

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        labels = ["model_name"]
        for name, attr, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], float(getattr(s, attr)))
            yield g
        for name, attr, doc in _COUNTERS:
            # Speculative counters say how acceptance was decided: "target" (the real thing)
            # or "synthetic" (benchmark-only, a seeded RNG).
            spec = name.startswith("vllm:spec_decode")
            c = CounterMetricFamily(name, doc, labels=labels + ["acceptance"] if spec else labels)
            c.add_metric([self.model_name, self.acceptance] if spec else [self.model_name],
                         float(getattr(s, attr)))
            yield c
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "position", "acceptance"],
        )
        for pos, n in enumerate(s.spec_accepted_per_pos):
            per_pos.add_metric([self.model_name, str(pos), self.acceptance], float(n))
        yield per_pos
        chosen = CounterMetricFamily(
            "dflash:draft_length_chosen",
            "Engine steps with decoding requests, by the number of drafts K they verified (0: no draft pass).",
            labels=["model_name", "k"],
        )
        for k, n in sorted(s.spec_draft_len_counts.items()):
            chosen.add_metric([self.model_name, str(k)], float(n))
        yield chosen
        for name, doc, counts in (
                ("dflash:spec_decode_num_drafts_by_draft_length",
                 "Request-steps that drafted K tokens (K > 0).", s.spec_drafts_by_len),
                ("dflash:spec_decode_num_accepted_tokens_by_draft_length",
                 "Accepted draft tokens of the request-steps that drafted K.", s.spec_accepted_by_len)):
            fam = CounterMetricFamily(name, doc, labels=["model_name", "k"])
            for k, n in sorted(counts.items()):
                fam.add_metric([self.model_name, str(k)], float(n))
            yield fam
        calibration = GaugeMetricFamily(
            "dflash:spec_decode_acceptance_calibration",
            "Adaptive draft length: observed over predicted acceptances through each draft position (1 = exact).",
            labels=["model_name", "position"],
        )
        for pos, f in enumerate(s.spec_acceptance_calibration):
            calibration.add_metric([self.model_name, str(pos)], f)
        yield calibration
        paths = CounterMetricFamily(
            "dflash:steps_by_path",
            "Engine steps launched, by path: decode_graph, mixed_graph (CUDA graphs of padded shapes) or eager.",
            labels=["model_name", "path"],
        )
        for path, n in sorted(s.steps_by_path.items()):
            paths.add_metric([self.model_name, path], float(n))
        yield paths
        host = CounterMetricFamily(
            "dflash:step_host_seconds",
            "Host time on the critical path between steps (results back -> next first launch), by phase "
            "(worker/host_path.py); the rest of the device idle time is wake-up and launch latency.",
            labels=["model_name", "phase"],
        )
        for phase, sec in s.step_host_seconds.items():
            host.add_metric([self.model_name, phase], sec)
        yield host


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], synthetic: bool = False) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds",
                         "Histogram of time per output token in seconds.", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of end to end request latency in seconds.", _E2E_BUCKETS)
        self.registry.register(
            _EngineStatsCollector(model_name, stats, "synthetic" if synthetic else "target"))

    def observe_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        """One engine output of a request (engine thread); updates the stream's timing."""
        if out.new_token_ids:
            if stream.first_token_at is None:
                stream.first_token_at = now
                self.ttft.observe(now - stream.arrival)
            elif stream.last_token_at is not None:
                self.itl.observe(now - stream.last_token_at)
            stream.last_token_at = now
            stream.num_tokens += len(out.new_token_ids)
        if out.finished and out.error is None:
            self.e2e.observe(now - stream.arrival)
            if stream.num_tokens > 1 and stream.first_token_at is not None:
                self.tpot.observe((now - stream.first_token_at) / (stream.num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
