"""The draft-length schedule (issue 10, item 6): `num_speculative_tokens_schedule` shortens
the draft block as more requests decode (verify work is batch x block rows). The core picks
each step's block (rust SchedulerConfig::block_rows_for, property-tested there); here: it
reaches the runner, outputs stay lossless (greedy spec-on == spec-off, exact mode), the
decode-graph path keeps one runner per block length, synthetic acceptance scales with the
shorter block, and bad schedules are refused."""
from __future__ import annotations

import pytest
import torch

from dflash_engine import LLM, SamplingParams
from dflash_engine._core import draft_len_for
from dflash_engine.config import SpeculativeConfig
from dflash_engine.worker.model_runner import ModelRunner

SCHEDULE = [[1, 3], [2, 2], [4, 1]]  # the random draft's block is 4: up to 3 drafts


def prompts(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, 250, (5 + 3 * i,), generator=g).tolist()} for i in range(n)]


def spec(draft, schedule=SCHEDULE, **extra) -> dict:
    return {"method": "dflash", "model": str(draft), "num_speculative_tokens_schedule": schedule, **extra}


def record_blocks(monkeypatch) -> list[tuple[int, int]]:
    """(decoding requests, block rows) of every step with decode entries."""
    seen = []
    real = ModelRunner.launch

    def launch(self, plan, *a, **k):
        if plan.num_decode:
            seen.append((plan.num_decode, plan.block_rows))
        return real(self, plan, *a, **k)

    monkeypatch.setattr(ModelRunner, "launch", launch)
    return seen


def test_draft_len_for_is_the_cores_rule():
    s = [(1, 3), (2, 2), (4, 1)]
    assert [draft_len_for(s, 3, n) for n in (1, 2, 3, 4, 9)] == [3, 2, 1, 1, 1]
    assert draft_len_for([], 5, 7) == 5


def test_schedule_is_parsed_and_validated(qwen3_dir, random_draft_dir):
    assert SpeculativeConfig.parse(spec(random_draft_dir)).num_speculative_tokens_schedule == [(1, 3), (2, 2), (4, 1)]
    for bad in ([[2, 1], [1, 3]], [[1, 0]], [[1, 2, 3]], "x", [[1, True]]):
        with pytest.raises(ValueError, match="num_speculative_tokens_schedule"):
            SpeculativeConfig.parse(spec(random_draft_dir, bad))
    with pytest.raises(ValueError, match="<= num_speculative_tokens"):
        SpeculativeConfig.parse(spec(random_draft_dir, [[1, 3]], num_speculative_tokens=2))
    with pytest.raises(ValueError, match="<= num_speculative_tokens"):  # past the draft's own block (3)
        LLM(model=str(qwen3_dir), device="cpu", speculative_config=spec(random_draft_dir, [[1, 5]]))


def test_blocks_follow_the_schedule_and_stay_lossless(qwen3_dir, random_draft_dir, monkeypatch):
    seen = record_blocks(monkeypatch)
    # different lengths: the batch thins out as requests finish, so the block grows back
    params = [SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(5)]
    ps = prompts(5)
    on = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=5, batch_invariant=True,
             speculative_config=spec(random_draft_dir))
    a = [o.outputs[0].token_ids for o in on.generate(ps, params, use_tqdm=False)]
    seen = list(seen)
    off = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=5, batch_invariant=True, speculative_config=None)
    assert a == [o.outputs[0].token_ids for o in off.generate(ps, params, use_tqdm=False)]
    assert seen and all(b == draft_len_for([(1, 3), (2, 2), (4, 1)], 3, n) + 1 for n, b in seen), str(seen)
    assert {b for _, b in seen} >= {2, 4}  # both ends of the schedule ran
    st = on.stats()
    assert st.spec_num_draft_tokens < 3 * st.spec_num_drafts  # shorter blocks were drafted


def test_synthetic_acceptance_scales_with_the_shorter_block(qwen3_dir, random_draft_dir):
    """Always accepting (length = k + 1): τ is each step's block, 2 under a schedule of k = 1."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=4, speculative_config=spec(
        random_draft_dir, [[1, 1]], rejection_sample_method="synthetic", synthetic_acceptance_length=4.0))
    llm.generate(prompts(3), params, use_tqdm=False)
    st = llm.stats()
    assert st.spec_num_draft_tokens == st.spec_num_drafts  # one draft per step
    assert st.mean_acceptance_length == pytest.approx(2.0)


def test_decode_graph_path_keeps_one_runner_per_block(qwen3_dir, random_draft_dir, decode_runs, monkeypatch):
    """The kernel decode step under Triton's interpreter: a runner per block length, each
    used for the steps of its length, the same tokens as the reference path."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter mode is for machines without a GPU")
    used = decode_runs
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "1")
    # 3, 5, 7 tokens: two decode steps at each block length (3, 2, 1 decoding requests: B = 2, 3, 4)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(3)]
    ps = prompts(3)
    llm = LLM(model=str(qwen3_dir), device="cpu", max_num_seqs=4, speculative_config=spec(random_draft_dir))
    runners = llm.engine.runner.graphs
    assert sorted(runners) == [2, 3, 4] and all(runners[b].d == 4 for b in runners)
    fast = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
    assert used and all(b == pb for b, pb in used) and len({b for b, _ in used}) >= 2, used
    monkeypatch.setenv("DFLASH_KERNELS_ON_CPU", "0")
    ref = LLM(model=str(qwen3_dir), device="cpu", speculative_config=None)
    assert fast == [o.outputs[0].token_ids for o in ref.generate(ps, params, use_tqdm=False)]
