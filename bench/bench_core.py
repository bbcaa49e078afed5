"""Micro-benchmark: Rust schedule() + commit() per decode step, Python crossing included.

Usage: python bench/bench_core.py [--steps 2000] [--block-rows 16]
Each timed step schedules every running request (verify block of B rows + draft block),
reads the plan arrays the model runner reads, and commits random acceptance (0-2 accepted
drafts per request, drawn before timing: in the engine they come from the GPU).
"""

import argparse
import time

import numpy as np

from dflash_engine import _core

PLAN_FIELDS = (
    "input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "page_tables",
    "sample_rows", "draft_input_ids", "draft_positions", "draft_slot_mapping",
    "draft_query_start_loc", "draft_seq_lens", "draft_page_tables", "verify_target_rows",
    "sample_start", "num_drafts",
)


def bench(num_reqs: int, block_rows: int, steps: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    # Long enough for every timed step: at most 3 tokens a step, 128 prompt tokens.
    max_len = 128 + 3 * (steps + 20) + 2 * block_rows
    s = _core.Scheduler(
        num_pages=num_reqs * (max_len // 16 + 2) + 8, page_size=16, max_num_seqs=num_reqs,
        max_num_batched_tokens=max(num_reqs * block_rows, 8192), max_model_len=max_len,
        num_speculative_tokens=block_rows - 1, mask_token_id=1,
    )
    for i in range(num_reqs):
        s.add_request(f"r{i}", np.arange(128, dtype=np.int64) + 5, max_len - 128)
    while True:  # prefill everything (chunked by the token budget)
        p = s.schedule()
        decoding = int((p.num_drafts > 0).sum())
        s.commit(p, np.zeros(len(p), np.int64), np.full(len(p.sample_rows), 7, np.int64))
        if decoding == num_reqs:
            break

    # Acceptance and sampled tokens come from the GPU in the engine: made before timing here.
    accepted = [rng.integers(0, 3, size=num_reqs, dtype=np.int64) for _ in range(steps + 20)]
    sampled = np.full(num_reqs * block_rows, 7, np.int64)

    def one_step(i):
        p = s.schedule()
        for f in PLAN_FIELDS:
            getattr(p, f)
        s.commit(p, accepted[i], sampled)

    for i in range(20):
        one_step(i)
    t0 = time.perf_counter()
    for i in range(steps):
        one_step(20 + i)
    dt = (time.perf_counter() - t0) / steps
    assert s.num_running == num_reqs, "benchmark must stay in steady-state decode"
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--block-rows", type=int, default=16)
    args = ap.parse_args()
    print(f"schedule+commit per step, B={args.block_rows}, Python crossing included")
    print(f"{'running':>8} {'us/step':>10}")
    for n in (1, 32, 256):
        dt = bench(n, args.block_rows, args.steps)
        print(f"{n:>8} {dt * 1e6:>10.1f}")


if __name__ == "__main__":
    main()
