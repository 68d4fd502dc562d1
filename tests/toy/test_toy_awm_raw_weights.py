"""A toy run of AWM at its recipe's settings (SA-Solver rollouts, EMA with warm-up, raw and EMA weights evaluated)
measures both sets of weights, as the official code evaluates both."""

import pytest


@pytest.fixture(scope="module")
def toy_world():
    from flowgrpo.toy.build import cached_toy_world

    return cached_toy_world("full", seed=0, log=lambda message: None)


def test_awm_toy_run_measures_the_raw_and_the_ema_weights(toy_world, tmp_path):
    from flowgrpo.toy.leaderboard import TOY_AWM_SETTINGS
    from flowgrpo.toy.learning import RLSettings, run_toy_rl

    settings = RLSettings(name="awm-small", max_steps=2, **{
        **TOY_AWM_SETTINGS, "num_generations": 4, "prompts_per_step": 1, "num_inference_steps": 4,
        "learning_rate": 3e-3, "extra_config": {**TOY_AWM_SETTINGS["extra_config"], "train_timesteps": 2}})
    result = run_toy_rl(toy_world, settings, tmp_path, eval_images_per_prompt=1, eval_steps=4, max_eval_prompts=2,
                        log=lambda message: None)
    before, after = result["before"], result["after"]
    assert before["raw"] == {k: v for k, v in before.items() if k != "raw"}  # at the start, the same weights
    assert [set(point["raw"]) == set(before["raw"]) for point in result["curve"]] == [True] * 2
    ema, raw = after["reward/toy_shape_score"], after["raw"]["reward/toy_shape_score"]
    assert ema != raw  # the EMA (decay 2/11 after step 1, 3/12 after step 2) lags the raw weights
