"""Reward constraints (``reward_constraints``, health/constraints.py): the dual ascent of the multipliers on a run made
by hand, the combined advantage, the refusals of bad constraints, and in real runs on the tiny SD3 pipeline: an
unconstrained and a constrained run from the same seed differ only through the multiplier, resume keeps the
multipliers, and the evaluation source reads the periodic evaluation."""

import json
import math

import pytest
import torch
from datasets import Dataset
from support.callbacks import StopAfter
from support.trainer_cases import PROMPTS, brightness_reward, make_args, make_trainer, redness_reward

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.rewards import register_reward
from flowgrpo.trainer.health.constraints import ConstraintSpec, RewardConstraints, parse_reward_constraints
from flowgrpo.trainer.rollout.advantages import (
    ConstraintTerms,
    combine_constrained_advantages,
    compute_constrained_advantages,
    compute_group_advantages,
)


def test_multipliers_follow_dual_ascent_on_a_hand_made_run():
    constraints = RewardConstraints([ConstraintSpec("colour", "rollouts", min_delta=-0.1),
                                     ConstraintSpec("ocr", "evaluation", min=0.5, lr=4.0)], lr=2.0)
    nan = math.nan
    # colour's batch means 0.9, 0.7, 0.75, 0.95 (NaN: unscored, left out); the bound is 0.9 - 0.1 = 0.8
    batches = [[0.8, 1.0, nan], [0.6, 0.8], [0.75, 0.75], [1.0, 0.9]]
    expected = [0.0, 0.2, 0.3, 0.0]  # max(0, lambda - 2 (mean - 0.8))
    for scores, multiplier in zip(batches, expected):
        constraints.observe_rollouts({"colour": torch.tensor(scores, dtype=torch.float64), "ocr": torch.zeros(2)})
        assert constraints.multipliers["colour"] == pytest.approx(multiplier)
        assert constraints.bound("colour") == pytest.approx(0.8)
    assert constraints.multipliers["ocr"] == 0.0 and constraints.values["ocr"] is None  # rollouts never move it
    # evaluation, at its own step size 4: 0.4 is 0.1 below the floor -> +0.4; the same step again (a resumed run's
    # evaluation on start) and a missing metric take no step; 0.6 is 0.1 above -> 0.4 - 0.4 = 0
    constraints.observe_evaluation({"eval_rewards/ocr/mean": 0.4}, "eval", 10)
    assert constraints.multipliers["ocr"] == pytest.approx(0.4)
    constraints.observe_evaluation({"eval_rewards/ocr/mean": 0.0}, "eval", 10)
    constraints.observe_evaluation({}, "eval", 15)
    assert constraints.multipliers["ocr"] == pytest.approx(0.4)
    constraints.observe_evaluation({"eval_rewards/ocr/mean": 0.6}, "eval", 20)
    assert constraints.multipliers["ocr"] == pytest.approx(0.0)
    logged = constraints.metrics()
    assert logged["constraint/colour/value"] == pytest.approx(0.95)
    assert logged["constraint/colour/slack"] == pytest.approx(0.15)
    assert logged["constraint/ocr/bound"] == 0.5 and logged["constraint/ocr/multiplier"] == pytest.approx(0.0)
    again = RewardConstraints(list(constraints.specs.values()), lr=2.0)
    again.load_state_dict(json.loads(json.dumps(constraints.state_dict())))
    assert again.state_dict() == constraints.state_dict()


def test_combined_advantage_by_hand():
    a0 = torch.tensor([1.0, -1.0, 0.5, -0.5])
    a1 = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    # (A_0 + 1 A_1) / (1 + 1)
    torch.testing.assert_close(combine_constrained_advantages(a0, {"c": a1}, {"c": 1.0}, 5.0),
                               torch.tensor([0.0, 0.0, 0.75, -0.75]))
    # (A_0 + 3 A_1) / 4, clipped to 0.5
    torch.testing.assert_close(combine_constrained_advantages(a0, {"c": a1}, {"c": 3.0}, 0.5),
                               torch.tensor([-0.5, 0.5, 0.5, -0.5]))
    assert torch.equal(combine_constrained_advantages(a0, {"c": a1}, {"c": 0.0}, 5.0), a0)
    with pytest.raises(ValueError, match="must be >= 0"):
        combine_constrained_advantages(a0, {"c": a1}, {"c": -1.0}, 5.0)
    # the per-image form: the constrained reward's own group advantage
    groups = torch.tensor([0, 0, 1, 1])
    reward = torch.tensor([0.2, 0.4, 0.9, 0.5])
    own = compute_group_advantages(reward, groups, "group", adv_clip_max=math.inf)[0]
    combined = compute_constrained_advantages(a0, ConstraintTerms({"c": 2.0}, {"c": reward}), groups, "group", 5.0)
    torch.testing.assert_close(combined, (a0 + 2 * own) / 3)


@pytest.mark.parametrize("value, message", [
    ({"c": {"min": 1.0, "min_delta": -0.1}}, "both bounds"),
    ({"c": {"source": "rollouts"}}, "no bound"),
    ({"c": {"min": 1.0, "source": "eval"}}, "source='eval' is not valid"),
    ({"c": {"max": 1.0}}, "unknown keys"),
    ({"c": {"min": 1.0, "lr": -2}}, r"lr=-2 must be a number >= 0"),
    ("{not json", "not valid JSON"),
])
def test_bad_constraint_entries_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        parse_reward_constraints(value)


def test_bad_constraints_fail_before_loading(tmp_path):
    """Each refusal names the bad value and the fix, from the configuration or before the model is read (the model
    path does not exist: loading would fail differently)."""
    with pytest.raises(ValueError, match="constraint_lr=-0.1"):
        make_args(tmp_path, constraint_lr=-0.1)
    with pytest.raises(ValueError, match="eval_strategy"):
        make_args(tmp_path, reward_constraints={"c": {"min": 0.5, "source": "evaluation"}})
    with pytest.raises(ValueError, match="eval_on_start"):
        make_args(tmp_path, reward_constraints={"c": {"min_delta": -0.1, "source": "evaluation"}},
                  eval_strategy="steps", eval_steps=2)
    data = Dataset.from_dict({"prompt": PROMPTS})

    def build(constraints, eval_dataset=None, **kwargs):
        args = make_args(tmp_path, reward_constraints=json.dumps(constraints), **kwargs)  # JSON, as on the CLI
        return FlowGRPOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=[brightness_reward], args=args,
                               train_dataset=data, eval_dataset=eval_dataset)

    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['colour'\]"):
        build({"colour": {"min": 0.5}})
    with pytest.raises(ValueError, match="no eval_dataset"):
        build({"brightness_reward": {"min": 0.5, "source": "evaluation"}}, eval_strategy="steps", eval_steps=2)
    with pytest.raises(ValueError, match="gold evaluation rewards"):
        build({"toy_color": {"min": 0.5}}, eval_reward_funcs=["toy_color"])


def _first_generation(trainer):
    """The first generation's records and the generation object itself (scored), after one optimizer step."""
    seen = []
    score = trainer.rollouts.score

    def keep(generation):
        score(generation)
        seen.append(generation)

    trainer.rollouts.score = keep
    trainer.train()
    return seen[0]


def test_constrained_run_differs_from_unconstrained_only_through_the_multiplier(tiny_sd3_path, tmp_path):
    common = dict(reward=[brightness_reward, redness_reward], reward_weights=[1.0, 0.0], learning_rate=3e-3,
                  scale_rewards="group")
    plain = make_trainer(tiny_sd3_path, tmp_path / "plain", max_steps=2, **common)
    plain_generation = _first_generation(plain)
    # a bound the run always meets: the multiplier stays 0 and the run is the unconstrained one, bit for bit
    kept = make_trainer(tiny_sd3_path, tmp_path / "kept", max_steps=2, constraint_lr=1.0,
                        reward_constraints={"redness_reward": {"min": -10.0}}, **common)
    kept.train()
    assert kept.health.constraints.multipliers == {"redness_reward": 0.0}
    for p, q in zip(plain.model.parameters(), kept.model.parameters()):
        assert torch.equal(p, q)
    # a bound it cannot meet: the multiplier is 10 - mean redness after the first step, and the advantages are the
    # unconstrained run's combined with redness's own group advantage by that multiplier
    pushed = make_trainer(tiny_sd3_path, tmp_path / "pushed", max_steps=1, constraint_lr=1.0,
                          reward_constraints={"redness_reward": {"min": 10.0}}, **common)
    generation = _first_generation(pushed)
    terms = generation.constraint_terms
    redness = terms.rewards["redness_reward"]
    assert terms.multipliers["redness_reward"] == pytest.approx(10.0 - float(redness.mean()))
    own = compute_group_advantages(redness, plain_generation.group_ids, "group", adv_clip_max=math.inf)[0]
    for plain_record, record in zip(plain_generation.records, generation.records):
        torch.testing.assert_close(record["x0"] if "x0" in record else record["latents"],
                                   plain_record["x0"] if "x0" in plain_record else plain_record["latents"])
    objective = torch.cat([r["advantages"] for r in plain_generation.records]).cpu()
    expected = combine_constrained_advantages(objective, {"redness_reward": own}, terms.multipliers, 5.0)
    torch.testing.assert_close(torch.cat([r["advantages"] for r in generation.records]).cpu(), expected)
    assert not torch.allclose(expected, objective)
    logged = [h for h in pushed.state.log_history if "constraint/redness_reward/multiplier" in h]
    assert logged[0]["constraint/redness_reward/multiplier"] == pytest.approx(terms.multipliers["redness_reward"])


def test_resume_keeps_the_multipliers(tiny_sd3_path, tmp_path):
    common = dict(reward=[brightness_reward, redness_reward], reward_weights=[1.0, 0.0], max_steps=4,
                  save_strategy="steps", save_steps=2, learning_rate=3e-3, constraint_lr=0.05,
                  reward_constraints={"redness_reward": {"min_delta": 0.5}})
    straight = make_trainer(tiny_sd3_path, tmp_path / "a", **common)
    straight.train()
    interrupted = make_trainer(tiny_sd3_path, tmp_path / "b", **common)
    interrupted.add_callback(StopAfter(2))
    interrupted.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-2"
    saved = json.loads((checkpoint / "health_state.json").read_text())["reward_constraints"]
    assert saved["multipliers"] == interrupted.health.constraints.multipliers
    resumed = make_trainer(tiny_sd3_path, tmp_path / "b", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.health.constraints.state_dict() == straight.health.constraints.state_dict()
    assert straight.health.constraints.multipliers["redness_reward"] > 0

    def multipliers(trainer):
        return [h["constraint/redness_reward/multiplier"] for h in trainer.state.log_history
                if "constraint/redness_reward/multiplier" in h]

    assert multipliers(resumed) == multipliers(straight) and len(multipliers(straight)) == 4


def test_evaluation_source_reads_the_periodic_evaluation(tiny_sd3_path, tmp_path):
    register_reward("redness_reward", overwrite=True)(redness_reward)  # a constraint may name a registered reward
    lr = 0.5
    args = make_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, eval_on_start=True,
                     per_device_eval_batch_size=2, eval_num_inference_steps=3, learning_rate=3e-3, constraint_lr=lr,
                     reward_constraints={"redness_reward": {"min_delta": 0.5, "source": "evaluation"}})
    assert isinstance(args, FlowGRPOConfig)
    trainer = FlowGRPOTrainer(model=str(tiny_sd3_path), reward_funcs=[brightness_reward], args=args,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                              eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}))
    # redness is not among reward_funcs: scored with weight 0, out of the objective
    assert trainer.reward_set.names == ["brightness_reward", "redness_reward"]
    assert trainer.reward_set.weights == [1.0, 0.0]
    trainer.train()
    evaluations = [h for h in trainer.state.log_history if "eval_rewards/redness_reward/mean" in h]
    assert [h["step"] for h in evaluations] == [0, 1, 2]
    values = [h["eval_rewards/redness_reward/mean"] for h in evaluations]
    bound = values[0] + 0.5
    multiplier = 0.0
    for evaluation, value in zip(evaluations, values):
        multiplier = max(0.0, multiplier + lr * (bound - value))
        assert evaluation["constraint/redness_reward/value"] == value
        assert evaluation["constraint/redness_reward/multiplier"] == pytest.approx(multiplier)
    # between evaluations the rollouts leave it alone: the training log of step 2 shows the multiplier of the
    # evaluation after step 1
    train_logs = [h for h in trainer.state.log_history if "reward" in h and "eval_reward" not in h]
    assert train_logs[1]["constraint/redness_reward/multiplier"] == pytest.approx(
        evaluations[1]["constraint/redness_reward/multiplier"])
    assert trainer.health.constraints.values["redness_reward"] == values[-1]


def test_ocr_recipe_keeps_pickscore_from_rollouts_and_aesthetics_from_evaluation():
    """recipes/ocr_kept_quality.yaml: OCR is the objective; PickScore and the aesthetic score are scored with weight
    0 (nothing loads before the first scoring) and kept by their multipliers, at their own step sizes."""
    from flowgrpo.cli.parser import parse_recipe
    from flowgrpo.rewards import resolve_reward_funcs
    from flowgrpo.rewards.composition import reward_spec_names
    from flowgrpo.trainer.health.constraints import check_constraint_rewards

    script, _, args = parse_recipe(["recipes/ocr_kept_quality.yaml"])
    added = check_constraint_rewards(args, reward_spec_names(script.reward_funcs), has_eval_dataset=True)
    assert script.reward_funcs == ["ocr"] and added == ["pickscore", "aesthetic"]
    rewards = resolve_reward_funcs(script.reward_funcs + added, [1.0, 0.0, 0.0], args.reward_kwargs)
    assert dict(zip(rewards.names, rewards.weights)) == {"ocr": 1.0, "pickscore": 0.0, "aesthetic": 0.0}
    specs = parse_reward_constraints(args.reward_constraints)
    assert [(s.name, s.source, s.min_delta, s.lr) for s in specs] == [("pickscore", "rollouts", -0.01, 10.0),
                                                                    ("aesthetic", "evaluation", -0.1, 5.0)]
    assert args.eval_on_start and str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "steps"
