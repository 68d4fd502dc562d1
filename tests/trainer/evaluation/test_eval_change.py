"""The paired before/after change of an evaluation (flowgrpo.trainer.evaluation.eval_change) and the run summary's noise."""

import json
import math

import pytest

from flowgrpo.trainer.evaluation.eval_change import EvaluationBaseline, paired_change


def test_paired_change_is_the_mean_difference_over_images_scored_twice():
    change, se, pairs = paired_change([0.2, 0.4, None, 0.5], [0.3, 0.6, 0.9, float("nan")])
    diffs = [0.1, 0.2]
    assert pairs == 2 and change == pytest.approx(0.15)
    assert se == pytest.approx(math.sqrt(sum((d - 0.15) ** 2 for d in diffs) / 2) / math.sqrt(2))
    assert paired_change([None], [1.0])[2] == 0 and math.isnan(paired_change([None], [1.0])[0])
    with pytest.raises(ValueError, match="same images"):
        paired_change([1.0], [1.0, 2.0])


def test_pairing_removes_the_spread_between_images():
    # Images differ a lot from each other, training moved each by about +0.1: the paired error is small, the
    # unpaired one is dominated by the spread between images.
    first = [0.1, 0.9, 0.3, 0.7, 0.5, 0.2]
    now = [v + 0.1 + 0.01 * (-1) ** i for i, v in enumerate(first)]
    change, se, _ = paired_change(first, now)
    unpaired = math.sqrt(2 * (sum((v - sum(first) / 6) ** 2 for v in first) / 6) / 6)
    assert change == pytest.approx(0.1) and se < unpaired / 10


def test_baseline_is_kept_per_evaluation_set():
    baseline = EvaluationBaseline()
    assert baseline.compare("eval", ["a", "b"], {"r": [0.0, 1.0]}) == {}
    assert baseline.compare("eval", ["a", "c"], {"r": [5.0, 5.0]}) == {}  # other prompts: a new set
    (change, se, pairs), = baseline.compare("eval", ["a", "b"], {"r": [1.0, 2.0]}).values()
    assert (change, se, pairs) == (1.0, 0.0, 2)


def test_run_summary_states_the_paired_noise(tmp_path):
    from flowgrpo.cli.report import summarize_run

    history = [
        {"step": 0, "eval_reward": 0.4, "eval_rewards/toy/mean": 0.40, "eval_rewards/toy/std": 0.2,
         "eval_rewards/toy/count": 100.0},
        {"step": 1, "reward": 0.5},
        {"step": 2, "eval_reward": 0.5, "eval_rewards/toy/mean": 0.50, "eval_rewards/toy/std": 0.2,
         "eval_rewards/toy/count": 100.0, "eval_rewards/toy/change": 0.1, "eval_rewards/toy/change_se": 0.01},
    ]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    summary = summarize_run(tmp_path)
    assert summary["eval_components"]["toy"] == (0.40, 0.50) and summary["eval_noise"]["toy"] == 0.01
    del history[-1]["eval_rewards/toy/change_se"]  # an older run: the unpaired estimate from std and count
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    assert summarize_run(tmp_path)["eval_noise"]["toy"] == pytest.approx(math.sqrt(2 * 0.2**2 / 100))
