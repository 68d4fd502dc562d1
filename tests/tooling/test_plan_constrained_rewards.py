"""`flowgrpo plan` counts the reward models a run loads: the constrained rewards outside reward_funcs are scored (with
weight 0) and their models take memory like the others'."""

from types import SimpleNamespace

from flowgrpo.plan.planner import REWARD_MODEL_PARAMS, _scored_rewards


def test_constrained_rewards_count_as_loaded_reward_models():
    script = SimpleNamespace(reward_funcs=["ocr", "pickscore"])
    args = SimpleNamespace(reward_constraints={"pickscore": {"min_delta": -0.01}, "aesthetic": {"min": 5.5}})
    assert _scored_rewards(script, args) == ("ocr", "pickscore", "aesthetic")
    assert _scored_rewards(script, SimpleNamespace(reward_constraints=None)) == ("ocr", "pickscore")
    assert "aesthetic" in REWARD_MODEL_PARAMS  # so the recipe's aesthetic constraint is planned with its weights
