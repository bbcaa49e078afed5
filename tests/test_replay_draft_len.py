"""bench/replay_draft_len.py: the offline replay of the draft-length estimator."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("replay_draft_len", Path(__file__).parents[1] / "bench" / "replay_draft_len.py")
replay_draft_len = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_draft_len)


def test_replay_commits_the_shorter_blocks_share_of_each_traced_step(tmp_path):
    # Two requests traced at K = 15 (a prefill step, drafts 0, is skipped).
    steps = [([1, 2], [0, 0], [0, 0]), ([1, 2], [15, 15], [15, 2]), ([1], [15], [5])]
    seqs = replay_draft_len.streams(steps, 15)
    assert seqs == [[15, 5], [2]]
    cost = {0: 1.0, 1: 1.0, 3: 1.0, 7: 1.0, 15: 1.0}
    # K = 3: min(15, 3) + 1, min(5, 3) + 1, min(2, 3) + 1 tokens in three unit steps.
    assert replay_draft_len.replay(seqs, cost, fixed=3)[0] == pytest.approx((4 + 4 + 3) / 3)
    assert replay_draft_len.replay(seqs, cost, fixed=15)[0] == pytest.approx((16 + 6 + 3) / 3)


@pytest.mark.parametrize("mode", ["none", "k", "position"])
def test_the_estimator_drafts_long_blocks_on_traffic_that_accepts_everything(mode):
    seqs = [[15] * 40 for _ in range(4)]
    cost = replay_draft_len.TABLES["gpu b1"]
    rate, chosen = replay_draft_len.replay(seqs, cost, replay_draft_len.Estimator(15, cost, mode))
    best = replay_draft_len.replay(seqs, cost, fixed=15)[0]
    assert rate > 0.9 * best and chosen.get(15, 0) > 0.8 * sum(chosen.values()), chosen
