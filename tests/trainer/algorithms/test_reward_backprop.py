"""The reward-gradient trainer (DRaFT-K, DRaFT-LV, ReFL, AlignProp): its gradient against one unrolled by hand on the
tiny SD3 pipeline (the no-grad prefix, the checkpointed steps, the decoder and the reward through the trainer's own
code), ReFL's step range and loss, AlignProp's and DRaFT-LV's draws by hand, the refusals before anything is loaded,
and what the planner is told. Resume and LoRA export run in tests/trainer/test_trainer.py (TRAINER_KINDS), two ranks
in tests/models/test_model_families.py, FSDP2 in tests/distributed/fsdp2_worker.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from support.trainer_cases import PROMPTS, brightness_reward, make_args, make_trainer

from flowgrpo import RewardBackpropConfig, RewardBackpropTrainer
from flowgrpo.trainer.algorithms.reward_backprop_loss import (
    alignprop_backprop_steps,
    default_refl_step_range,
    refl_loss,
    refl_step,
    renoised_last_state,
    reward_gradient_loss,
)
from flowgrpo.trainer.data.datasets import INDEX_COLUMN
from flowgrpo.trainer.seeds import seed_for

REPO = Path(__file__).resolve().parents[3]
SIZE, STEPS = 32, 3


def _trainable_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", ["draft", "refl"])
def test_the_reward_gradient_equals_one_unrolled_by_hand(tiny_sd3_path, tmp_path, mode):
    """DRaFT-K (K = 2 of 3 steps) and ReFL: the trainer's loss and LoRA gradient (steps checkpointed one by one, the
    decoder checkpointed) equal the same chain written out with the transformer, the VAE and the reward; the
    weight-0 non-differentiable reward is logged, not trained on."""
    own = dict(backprop_steps=2) if mode == "draft" else dict(refl_step_range=[1, 2])
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="reward_backprop", reward=[brightness_reward, "toy_color"],
                           reward_weights=[1.0, 0.0], reward_backprop_mode=mode, resolution=SIZE,
                           num_inference_steps=STEPS, per_device_train_batch_size=2, num_generations=1, **own)
    args, adapter, model = trainer.args, trainer.policy.adapter, trainer.model
    records = trainer._generate([{"prompt": p, INDEX_COLUMN: i} for i, p in enumerate(PROMPTS[:2])])
    batch = trainer._prepare_batch(records[0])
    model.train()
    out = trainer._batch_loss(model, batch, 0, True)
    out.loss.backward()
    ours = _trainable_grads(model)
    model.zero_grad(set_to_none=True)
    assert math.isfinite(trainer.metrics.train["rewards/toy_color/mean"][-1])

    embeds, sigmas, timesteps = records[0]["embeds"], batch["sigmas"], batch["timesteps"]

    def velocity(x, i):
        return adapter.predict_velocity(model, x, timesteps[i].expand(2), embeds, 1.0, None, SIZE, SIZE).float()

    if mode == "draft":  # the initial noise of the micro-step, 1 step without gradient, then 2 with it
        gen = torch.Generator().manual_seed(seed_for(args.seed, 5273, 0, 0))
        x = adapter.prepare_latents(2, SIZE, SIZE, gen, torch.device("cpu"), torch.float32)
        for i in range(STEPS):
            if i == STEPS - 2:
                torch.testing.assert_close(x, batch["state"])  # the prefix, by the engine's sampler
            with torch.set_grad_enabled(i >= STEPS - 2):
                x = x + (sigmas[i + 1] - sigmas[i]) * velocity(x, i)
    else:  # ReFL: from the state at the drawn step m, one step with gradient to x0 = x_m - sigma_m v
        m = batch["start"]
        assert m in (1, 2)
        x = batch["state"] - sigmas[m] * velocity(batch["state"], m)
    vae = trainer.pipeline.vae
    images = (vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor).sample.float() / 2 + 0.5).clamp(0, 1)
    reward = images.mean(dim=(1, 2, 3))
    hand = -reward.mean() if mode == "draft" else 1e-3 * torch.relu(2.0 - reward).mean()
    hand.backward()
    theirs = _trainable_grads(model)
    assert float(out.loss.detach()) == pytest.approx(float(hand.detach()), rel=1e-5)
    assert any(float(g.abs().max()) > 0 for g in ours.values())
    for name, grad in theirs.items():
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-9, msg=name)


def test_refl_step_range_and_loss():
    """ReFL's draw is uniform over [lo, hi] inclusive (the official randint(30, 39) of 40 steps) and its loss is
    scale x mean relu(target - reward) over the scored images; the linear form is -scale x mean reward."""
    gen = torch.Generator().manual_seed(0)
    draws = {refl_step([30, 39], gen) for _ in range(400)}
    assert draws == set(range(30, 40))
    assert default_refl_step_range(40) == [30, 39] and default_refl_step_range(8) == [6, 7]
    rewards, valid = torch.tensor([1.5, 2.5, float("nan")]), torch.tensor([True, True, False])
    assert float(refl_loss(rewards, valid).loss) == pytest.approx(2.5e-4)  # (0.5 + 0) / 2 x 1e-3
    assert float(refl_loss(rewards, valid, "linear", scale=1.0).loss) == pytest.approx(-2.0)
    r = torch.tensor([1.5, 2.5], requires_grad=True)
    refl_loss(r, torch.tensor([True, True])).loss.backward()  # above the target: no gradient
    assert r.grad.tolist() == pytest.approx([-5e-4, 0.0])
    nothing = reward_gradient_loss(torch.tensor([float("nan")]), torch.tensor([False]))
    assert float(nothing.loss) == 0.0
    args = make_args(Path("/tmp/unused"), RewardBackpropConfig, reward_backprop_mode="refl", num_inference_steps=40)
    assert args.refl_step_range == [30, 39] and args.loss_scale == 1e-3
    with pytest.raises(ValueError, match=r"refl_step_range=\[30, 40\]"):
        make_args(Path("/tmp/unused"), RewardBackpropConfig, reward_backprop_mode="refl", num_inference_steps=40,
                  refl_step_range=[30, 40])


def test_alignprop_and_draft_lv_draws():
    """AlignProp's K for a rollout, as the official draw of the first step with gradient; DRaFT-LV's re-noised last
    state (1 - s) sg(x_T) + s eps."""
    gen = torch.Generator().manual_seed(0)
    uniform = [alignprop_backprop_steps(50, "uniform", 20, 5.0, gen) for _ in range(2000)]
    assert set(uniform) == set(range(1, 21))  # the official uniform {min 30, max 50} of 50 steps
    gaussian = [alignprop_backprop_steps(50, "gaussian", 8, 5.0, gen) for _ in range(4000)]
    assert min(gaussian) >= 1 and max(gaussian) <= 49

    def cdf(z: float) -> float:  # of N(42, 5)
        return 0.5 * (1 + math.erf((z - 42) / (5 * math.sqrt(2))))

    # b = int(z) kept when 1 <= b <= 49 (z in [b, b + 1) for z > 0): E[K] = E[50 - b | kept] = 9.09
    mass = {b: cdf(b + 1) - cdf(b) for b in range(1, 50)}
    expected = sum((50 - b) * p for b, p in mass.items()) / sum(mass.values())
    assert sum(gaussian) / len(gaussian) == pytest.approx(expected, abs=0.25) and expected == pytest.approx(9.09, 0.01)
    assert set(alignprop_backprop_steps(4, "gaussian", 2, 5.0, gen) for _ in range(200)) <= {1, 2, 3}
    final = torch.ones(2, 3, requires_grad=True)
    state = renoised_last_state(final, torch.full((2, 3), 3.0), torch.tensor([0.25, 0.5]))
    assert state.tolist() == [[1.5] * 3, [2.0] * 3] and not state.requires_grad


def test_refusals_before_anything_is_loaded(tmp_path):
    """A reward without gradient (of non-zero weight) is refused by name with the reason, before the model is read;
    the settings that have no meaning for a reward-gradient method, a video family and rollout workers are refused
    with the fix."""
    with pytest.raises(ValueError, match=r"\['toy_color'\] are not differentiable.*reward_weights 0"):
        RewardBackpropTrainer(model="/nonexistent", reward_funcs=[brightness_reward, "toy_color"],
                              args=make_args(tmp_path, RewardBackpropConfig),
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    bad = [
        (dict(beta=0.04), "set kl_beta: 0.04"),
        (dict(reward_backprop_mode="draft_lv", backprop_steps=2), "trains one step"),
        (dict(backprop_steps=5), "at most 4"),
        (dict(reward_backprop_mode="alignprop", backprop_steps=4), "never backpropagates through step 0"),
        (dict(refl_pretrain_weight=0.1), "use 'refl'"),
        (dict(filter_zero_std_groups=True), "no groups to refill"),
        (dict(num_iterations=2), "raise max_steps"),
        (dict(train_timesteps_per_pass="all"), "no recorded timesteps to stack"),
        (dict(rollout_backend="ray"), "samples inside its loss"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            make_args(tmp_path, RewardBackpropConfig, **kwargs)
    args = make_args(tmp_path, RewardBackpropConfig, kl_beta=0.02)
    assert args.beta == 0.02 and args.num_generations == 4  # beta follows kl_beta (the planner reads it)
    with pytest.raises(ValueError, match="generates videos"):
        RewardBackpropTrainer._check_datasets(None, {"_class_name": "WanPipeline"}, args, (None, None))
    refl = make_args(tmp_path, RewardBackpropConfig, reward_backprop_mode="refl", refl_pretrain_weight=0.5)
    with pytest.raises(ValueError, match="'pretrain_image' column"):
        RewardBackpropTrainer._check_datasets(None, {"_class_name": "StableDiffusion3Pipeline"}, refl,
                                              (Dataset.from_dict({"prompt": PROMPTS}), None))


def test_the_planner_is_told_the_chain():
    """What `flowgrpo plan` measures for each mode (the spec's PlannedStep): the steps with gradient and whether each
    is recomputed, the passes without gradient, the trained chains of a micro-batch."""
    from flowgrpo.cli.parser import parse_recipe
    from flowgrpo.plan.planner import settings_from_args

    def settings(*overrides):
        script, model, args = parse_recipe([str(REPO / "recipes" / "toy_draft.yaml"), *overrides])
        return settings_from_args(args, model, script.trainer)

    lv = settings()
    assert (lv.loss, lv.trained_input, lv.backprop_steps, lv.trained_steps) == ("reward_gradient", "sampled_state", 1, 2)
    assert lv.sampling_passes == 8 and lv.checkpointed_steps and lv.stored_per_step == 0
    full = settings("--reward_backprop_mode", "draft", "--backprop_steps", "8", "--backprop_checkpointing", "false")
    assert (full.backprop_steps, full.sampling_passes, full.trained_steps, full.checkpointed_steps) == (8, 0, 1, False)
    refl = settings("--reward_backprop_mode", "refl", "--kl_beta", "0.01")
    assert refl.sampling_passes == 6.5 and refl.frozen_forwards == ("reference",) and refl.beta == 0.01
