"""AWM's and Diffusion-DPO's settings as their references run them: the CFG scale of the trained velocities, AWM's
rollout sampler (SA-Solver) and Diffusion-DPO's draws; defaults, recipe parsing and the errors on bad values."""

from __future__ import annotations

import pytest

from flowgrpo import AWMConfig, DiffusionDPOConfig
from flowgrpo.cli import parse_recipe
from flowgrpo.schedulers.sa_solver import SA_SOLVER_NOISE_RANGE, SA_SOLVER_TAU


def awm(tmp_path, **kwargs) -> AWMConfig:
    return AWMConfig(output_dir=str(tmp_path), report_to=[], **kwargs)


def dpo(tmp_path, **kwargs) -> DiffusionDPOConfig:
    return DiffusionDPOConfig(output_dir=str(tmp_path), report_to=[], **kwargs)


# ---- the CFG scale of the trained velocities ------------------------------------------------------------------------

@pytest.mark.parametrize("make", [awm, dpo], ids=["awm", "dpo"])
def test_train_guidance_scale_defaults_to_the_conditional_velocity(tmp_path, make):
    args = make(tmp_path, guidance_scale=4.5)
    assert args.train_guidance_scale == 1.0 and args.training_guidance_scale == 1.0  # rollouts at 4.5, loss at 1
    assert make(tmp_path, guidance_scale=4.5, train_guidance_scale=None).training_guidance_scale == 4.5
    assert make(tmp_path, guidance_scale=3.0, train_guidance_scale=2).training_guidance_scale == 2.0
    assert make(tmp_path, train_guidance_scale=0).train_guidance_scale == 0.0  # Z-Image's conditional velocity
    for bad in (-1.0, float("nan"), float("inf"), True, "high"):
        with pytest.raises(ValueError, match=r"train_guidance_scale=.* must be a finite number >= 0 .*or null"):
            make(tmp_path, train_guidance_scale=bad)


# ---- AWM's rollout sampler --------------------------------------------------------------------------------------------

def test_awm_rollout_sampler_defaults_to_the_official_sa_solver(tmp_path):
    args = awm(tmp_path)
    # rollouts by SA-Solver, evaluation with Euler, raw and EMA weights evaluated (the official evaluation)
    assert (args.rollout_sampler, args.rollout_solver, args.sampler) == ("sa_solver", "sa_solver", "euler")
    assert args.eval_raw_weights is True
    assert (args.sa_solver_tau, args.sa_solver_noise_range) == (SA_SOLVER_TAU, list(SA_SOLVER_NOISE_RANGE)) == (
        0.4, [0.3, 0.9])
    assert (args.sa_solver_predictor_order, args.sa_solver_corrector_order) == (2, 2)
    # steps and rollout guidance: the model's own, resolved by the trainer (CFG-free for AWM; SD3.5-M's 14 steps are
    # the recipes'); the trained velocity is the conditional one whatever the rollouts' guidance
    assert (args.num_inference_steps, args.guidance_scale, args.training_guidance_scale) == (None, None, 1.0)
    # null: the rollouts use the evaluation sampler (the behaviour before the option)
    assert awm(tmp_path, rollout_sampler=None, sampler="euler").rollout_solver == "euler"
    assert awm(tmp_path, rollout_sampler="dpmpp_2m").rollout_solver == "dpmpp_2m"
    assert awm(tmp_path, sa_solver_noise_range=(0, 1)).sa_solver_noise_range == [0.0, 1.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(rollout_sampler="ddim"), "rollout_sampler='ddim' is not valid; choose one of 'sa_solver', 'dpmpp_2m'"),
    (dict(sampler="sa_solver"), "sampler='sa_solver' is not valid"),  # evaluation stays deterministic
    (dict(sa_solver_tau=-0.4), r"sa_solver_tau=-0.4 must be a finite number >= 0 \(AWM: 0.4"),
    (dict(sa_solver_tau=float("nan")), "sa_solver_tau=nan"),
    (dict(sa_solver_noise_range=[0.9, 0.3]), r"sa_solver_noise_range=\[0.9, 0.3\] must be two noise levels"),
    (dict(sa_solver_noise_range=[0.3]), "0 <= lo <= hi <= 1"),
    (dict(sa_solver_noise_range=[0.3, 1.5]), "0 <= lo <= hi <= 1"),
    (dict(sa_solver_predictor_order=3), r"sa_solver_predictor_order=3 is not supported; use 1 or 2"),
    (dict(sa_solver_corrector_order=3), r"sa_solver_corrector_order=3 is not supported; use 0 \(no corrector\)"),
    (dict(eval_raw_weights="yes"), "eval_raw_weights='yes' must be true or false"),
])
def test_awm_bad_sampler_settings_name_the_value_and_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        awm(tmp_path, **kwargs)


# ---- Diffusion-DPO's draws ----------------------------------------------------------------------------------------------

def test_dpo_defaults_follow_the_flow_matching_references(tmp_path):
    args = dpo(tmp_path)
    assert args.beta_dpo == 100.0
    assert (args.dpo_timestep_distribution, args.dpo_num_noise_draws, args.training_guidance_scale) == (
        "logit_normal", 1, 1.0)
    assert dpo(tmp_path, dpo_num_noise_draws=39, dpo_timestep_distribution="uniform").dpo_num_noise_draws == 39
    assert args.dpo_rollout_policy == "policy" and dpo(tmp_path, dpo_rollout_policy="reference").dpo_rollout_policy


@pytest.mark.parametrize("kwargs, message", [
    (dict(dpo_num_noise_draws=0), r"dpo_num_noise_draws=0 must be an integer >= 1 .*flow_grpo: 39"),
    (dict(dpo_num_noise_draws=2.5), "dpo_num_noise_draws=2.5"),
    (dict(dpo_timestep_distribution="cosine"),
     "dpo_timestep_distribution='cosine' is not valid; choose one of 'logit_normal', 'uniform'"),
    (dict(beta_dpo=0.0), r"beta_dpo=0.0 must be > 0 \(the flow-matching references: 100"),
    (dict(dpo_rollout_policy="ema"), "dpo_rollout_policy='ema' is not valid; choose one of 'policy', 'reference'"),
])
def test_dpo_bad_settings_name_the_value_and_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        dpo(tmp_path, **kwargs)


# ---- recipes and the command line ----------------------------------------------------------------------------------

def test_the_settings_parse_from_recipes_and_flags():
    overrides = {"rollout_sampler": None, "sa_solver_noise_range": [0.2, 0.95], "guidance_scale": 4.5,
                 "train_guidance_scale": None}
    _, _, args = parse_recipe(["recipes/awm_geneval.yaml", "--use_cpu", "true", "--sa_solver_corrector_order", "0",
                               "--sa_solver_tau", "0.5"], overrides=overrides)
    assert type(args).__name__ == "AWMConfig"
    assert args.rollout_sampler is None and args.rollout_solver == args.sampler
    assert (args.sa_solver_noise_range, args.sa_solver_tau, args.sa_solver_corrector_order) == ([0.2, 0.95], 0.5, 0)
    assert args.train_guidance_scale is None and args.training_guidance_scale == 4.5
    _, _, args = parse_recipe(["recipes/dpo_online_ocr.yaml", "--use_cpu", "true", "--beta_dpo", "500",
                               "--dpo_num_noise_draws", "39", "--dpo_timestep_distribution", "uniform",
                               "--train_guidance_scale", "2.0"])
    assert type(args).__name__ == "DiffusionDPOConfig"
    assert (args.dpo_num_noise_draws, args.dpo_timestep_distribution, args.beta_dpo) == (39, "uniform", 500.0)
    assert args.training_guidance_scale == 2.0


@pytest.mark.parametrize("recipe", ["awm_geneval.yaml", "awm_ocr.yaml", "toy_awm.yaml"])
def test_awm_recipes_run_the_official_settings(recipe):
    _, _, args = parse_recipe([f"recipes/{recipe}", "--use_cpu", "true"])
    assert (args.rollout_solver, args.sa_solver_tau, args.sa_solver_noise_range) == ("sa_solver", 0.4, [0.3, 0.9])
    assert (args.sa_solver_predictor_order, args.sa_solver_corrector_order) == (2, 2)
    assert (args.num_inference_steps, args.guidance_scale, args.training_guidance_scale) == (14, 1.0, 1.0)
    assert (args.num_generations, args.sampler, args.eval_raw_weights) == (24, "euler", True)
    assert args.use_ema and args.ema_warmup and args.ema_decay == 0.99 and args.lr_scheduler_type.value == "constant"
    if recipe != "toy_awm.yaml":  # one optimizer step of 1728 images = 72 prompts x 24 on 8 GPUs
        assert 8 * args.per_device_train_batch_size * args.gradient_accumulation_steps == 1728 == 72 * 24
        assert args.eval_num_inference_steps == 40
    text = open(f"recipes/{recipe}").read()
    assert "864" not in text and "deterministic DPM-Solver" not in text


@pytest.mark.parametrize("recipe, mode", [("dpo_online_ocr.yaml", "online"), ("dpo_offline_sd35m.yaml", "offline"),
                                          ("toy_dpo.yaml", "offline")])
def test_dpo_recipes_run_the_flow_matching_references_settings(recipe, mode):
    _, _, args = parse_recipe([f"recipes/{recipe}", "--use_cpu", "true"])
    assert (args.dpo_mode, args.beta_dpo, args.dpo_timestep_distribution) == (mode, 100.0, "logit_normal")
    assert args.training_guidance_scale == 1.0 and 1e-4 <= args.learning_rate <= 3e-4
    if mode == "online" or recipe == "toy_dpo.yaml":  # groups of 4, more prompts: more pairs from the same rollouts
        assert args.num_generations == 4 and args.dpo_num_noise_draws == 4 and args.learning_rate == 3e-4
    text = open(f"recipes/{recipe}").read()
    assert "5000.0" not in text and "2500" not in text
