"""scripts/learning_goals.py's figures on hand-made runs: goal 1 counts only seeds that keep colour, goal 2 credits a
run with its last evaluation at or before 150 s, and the page states the world's ceiling. (Training an attempt is
minutes of CPU: the runs themselves are the toy world's, tested in tests/toy.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import learning_goals as goals  # noqa: E402


def _run(seed: int, curve: list[tuple[int, float, float, float]], steps: int = 300) -> dict:
    """curve: (step, train seconds, shape, colour); the first point is the world before training."""
    points = [{"step": s, "train_seconds": t, "shape": shape, "color": colour} for s, t, shape, colour in curve]
    return {"settings": {"seed": seed, "max_steps": steps}, "before": points[0], "after": points[-1],
            "curve": points, "train_seconds": points[-1]["train_seconds"],
            "eval": {"prompts": 43, "images_per_prompt": 8}}


def test_goal_one_needs_colour_kept_and_goal_two_takes_the_last_evaluation_before_the_budget():
    runs = [
        _run(0, [(0, 0, 0.44, 0.94), (100, 100, 0.55, 0.93), (200, 160, 0.65, 0.93), (300, 240, 0.72, 0.93)]),
        _run(1, [(0, 0, 0.44, 0.94), (100, 120, 0.60, 0.90), (200, 240, 0.70, 0.90), (300, 360, 0.75, 0.90)]),
    ]
    f = goals.row_figures(runs)
    assert f["goal1_seeds"] == 1  # seed 1 has more shape but gave up 4 points of colour
    assert f["best"][2] == 1 and f["best_kept"][2] == 0
    assert f["best_point_kept"][0] == 0.72 and f["best_point_kept"][2:] == (0, 300)  # seed 1's points all lost colour
    assert f["at_goal_seconds"] == pytest.approx((0.55 + 0.60) / 2)  # 160 s and 240 s are past the budget
    assert f["best_within_goal_seconds"] == pytest.approx(((0.55 + 0.60) / 2, 120))  # 100 s: (0.55 + 0.44) / 2
    assert f["last_100_gain"] == pytest.approx((0.07 + 0.05) / 2)
    assert f["seconds_per_step"] == pytest.approx((240 + 360) / 2 / 300)
    text = goals.render({"awm": runs}, {}, {"vae_reconstruction_accuracy": {"shape": 0.79}})
    assert "The world's ceiling: 79.0% shape" in text and "| awm | 2 x 300 | 73.5% | 75.0% (-4.0) | 72.0% (-1.0) | 1 |" \
        in text


def test_attempts_change_one_thing_of_their_row():
    from flowgrpo.toy.leaderboard import COLOUR_KEPT, ROLLOUTS_AT_EVAL_GUIDANCE, leaderboard_variants

    rows = {s.name: s for s, _ in leaderboard_variants(300)}
    for name, (row, _, question) in goals.ATTEMPTS.items():
        settings, base = goals.attempt_settings(name, 3), rows[row]
        assert settings.seed == 3 and settings.max_steps > 300 and settings.trainer == base.trainer and question
        changed = {k for k in set(settings.extra_config) | set(base.extra_config)
                   if settings.extra_config.get(k) != base.extra_config.get(k)}
        if "colour-kept" in name:  # the colour constraint (its evaluation reads the EMA only), and CFG 3 rollouts
            allowed = set(COLOUR_KEPT) | {"eval_raw_weights"} | (set(ROLLOUTS_AT_EVAL_GUIDANCE) if "cfg3" in name
                                                                  else set())
            assert set(COLOUR_KEPT) <= changed <= allowed, name
        else:
            assert changed <= {"dgpo_num_timesteps"}
        assert settings.num_generations == base.num_generations
    assert goals.attempt_settings("awm-600-colour1", 0).reward_weights == [1.0, 1.0]
    assert goals.attempt_settings("dgpo-1-level", 0).extra_config["dgpo_num_timesteps"] == 1
