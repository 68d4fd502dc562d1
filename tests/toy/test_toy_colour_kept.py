"""A goal row on the toy world (DGPO with colour kept, at test size): the trainer's own evaluation on the validation
prompts feeds the colour constraint, its seconds count as training, and the run records both sets of weights and
what it was made from."""

import dataclasses

import pytest


@pytest.fixture(scope="module")
def toy_world():
    from flowgrpo.toy.build import cached_toy_world

    return cached_toy_world("full", seed=0, log=lambda message: None)


@pytest.mark.slow
def test_colour_kept_row_reads_its_constraint_from_the_validation_evaluation(toy_world, tmp_path):
    from flowgrpo.toy.build import read_prompts
    from flowgrpo.toy.leaderboard import leaderboard_variants
    from flowgrpo.toy.learning import run_toy_rl, validation_prompts

    row = {s.name: s for s, _ in leaderboard_variants(2)}["dgpo-colour-kept"]
    settings = dataclasses.replace(row, num_generations=4, prompts_per_step=1, extra_config={
        **row.extra_config, "eval_steps": 1, "eval_images_per_prompt": 1, "constraint_lr": 50.0})
    result = run_toy_rl(toy_world, settings, tmp_path, eval_images_per_prompt=1, eval_steps=4, max_eval_prompts=2,
                        log=lambda message: None)
    validation = result["validation"]
    assert [v["step"] for v in validation] == [0, 1, 2]  # on start, then after every step
    start = validation[0]["constraint/toy_color/value"]
    assert validation[0]["constraint/toy_color/bound"] == pytest.approx(start - 0.01)
    multiplier = 0.0
    for v in validation:  # the dual step of each evaluation, from its own value
        assert v["constraint/toy_color/value"] == v["eval_rewards/toy_color/mean"]
        multiplier = max(0.0, multiplier + 50.0 * (start - 0.01 - v["constraint/toy_color/value"]))
        assert v["constraint/toy_color/multiplier"] == pytest.approx(multiplier)
    assert len(validation_prompts(read_prompts(toy_world, "train"))) == 44
    assert 0 < result["validation_seconds"] < result["train_seconds"]
    assert "raw" in result["after"] and result["code"]["consistent"] and len(result["code"]["digest"]) == 64
