"""The configurations of DGPO, CRD and on-policy distillation (DGPOConfig, CRDConfig, DiffusionOPDConfig), and FlowGRPOConfig's
Flow-DPPO (``policy_loss``) and BranchGRPO (``branch_*``) options: defaults from the official code, every field
documented, bad values refused with a message naming the value and the fix, and parsing from the command line."""

from __future__ import annotations

import warnings
from dataclasses import fields

import pytest
from transformers import HfArgumentParser

from flowgrpo.trainer.algorithms.crd_config import CRDConfig
from flowgrpo.trainer.algorithms.dgpo_config import DGPOConfig
from flowgrpo.trainer.algorithms.flow_grpo_config import FlowGRPOConfig
from flowgrpo.trainer.algorithms.opd_config import DiffusionOPDConfig, TeacherSpec
from flowgrpo.trainer.online_config import OnlineRLConfig


def make(cls, tmp_path, **kwargs):
    kwargs.setdefault("per_device_train_batch_size", 48)  # divisible by every default group size here
    return cls(output_dir=str(tmp_path), report_to=[], **kwargs)


@pytest.mark.parametrize("cls", [DGPOConfig, CRDConfig, DiffusionOPDConfig])
def test_every_own_field_is_documented(cls):
    base = {f.name for f in fields(OnlineRLConfig)}
    own = [f for f in fields(cls) if f.name not in base]
    assert own
    for f in own:
        assert len(f.metadata.get("help", "")) > 20, f.name


def test_flow_grpo_dppo_and_branch_fields_are_documented():
    names = {"policy_loss", "dppo_tau", "branch_steps", "branch_factor", "branch_noise_scale", "branch_pruning",
             "branch_split_log_prob", "branch_width_mode", "branch_width_ratio", "branch_prune_depths",
             "branch_prune_slide_interval"}
    by_name = {f.name: f for f in fields(FlowGRPOConfig)}
    for name in names:
        assert len(by_name[name].metadata.get("help", "")) > 20, name


# ---- DGPO --------------------------------------------------------------------------------------------------------

def test_dgpo_defaults_are_the_official_ocr_settings(tmp_path):
    args = make(DGPOConfig, tmp_path)
    assert (args.sampler, args.num_inference_steps, args.guidance_scale, args.num_generations, args.dgpo_num_timesteps,
            args.dgpo_trunc_steps, args.dgpo_shared_noise, args.beta_dpo, args.dgpo_clip, args.dgpo_clip_dsm,
            args.dgpo_clip_kl, args.beta, args.kl_guidance_scale, args.dgpo_use_ema_reference,
            args.dgpo_ema_decay_rate, args.dgpo_ema_decay_max, args.dgpo_switch_ema_ref, args.scale_rewards,
            args.adv_clip_max, args.learning_rate) == \
        ("dpmpp_2m", None, 4.5, 16, 4, 6, True, 100.0, 0.01, True, False, 0.02, 1.0, False, 0.001, 0.3, 200, "batch",
         5.0, 3e-4)
    assert args.uses_ema_reference
    assert not make(DGPOConfig, tmp_path, dgpo_clip_dsm=False).uses_ema_reference
    assert make(DGPOConfig, tmp_path, dgpo_clip_dsm=False, dgpo_use_ema_reference=True).uses_ema_reference


@pytest.mark.parametrize("bad, match", [
    (dict(dgpo_trunc_steps=10, num_inference_steps=10),
     r"dgpo_trunc_steps=10 must be an integer in 0 .. num_inference_steps - 1 = 9"),
    (dict(dgpo_num_timesteps=8), r"dgpo_num_timesteps=8 must be an integer in 1 .. dgpo_trunc_steps \+ 1 = 7"),
    (dict(dgpo_num_timesteps=0), "dgpo_num_timesteps=0"),
    (dict(beta_dpo=0.0), "beta_dpo=0.0 must be > 0"),
    (dict(dgpo_clip=0.0), "set dgpo_clip_dsm: false"),
    (dict(dgpo_ema_decay_max=1.0), r"dgpo_ema_decay_max=1.0 must be in \[0, 1\)"),
    (dict(dgpo_switch_ema_ref=-1), "dgpo_switch_ema_ref=-1"),
    (dict(sampler="sde"), "sampler='sde' is not valid"),
    (dict(kl_guidance_scale=0.0), "kl_guidance_scale=0.0"),
    (dict(dgpo_shared_noise="yes"), "dgpo_shared_noise='yes' must be true or false"),
])
def test_dgpo_refuses_bad_values(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        make(DGPOConfig, tmp_path, **bad)


# ---- CRD ---------------------------------------------------------------------------------------------------------

def test_crd_defaults_are_the_ports_ocr_settings(tmp_path):
    args = make(CRDConfig, tmp_path)
    assert (args.sampler, args.guidance_scale, args.num_generations, args.num_inference_steps, args.crd_num_timesteps,
            args.timestep_fraction, args.crd_beta, args.loss_type, args.crd_centering, args.crd_adaptive_weights,
            args.crd_use_old_policy, args.beta, args.kl_guidance_scale, args.reward_adaptive_kl,
            args.scale_rewards, args.adv_clip_max) == \
        ("euler", 1.0, 24, None, 20, 0.99, 1.0, "mse", "group", True, True, 0.1, 4.5, True, "batch", 5.0)
    assert [args.old_policy_decay(k) for k in (0, 100, 1000)] == pytest.approx([0.25, 0.75, 0.999])
    assert [args.sampling_policy_decay(k) for k in (0, 74, 75, 175, 1000)] == pytest.approx([0, 0, 0, 0.75, 0.999])


@pytest.mark.parametrize("bad, match", [
    (dict(loss_type="l2"), "loss_type='l2' is not valid; choose one of 'mse', 'bce'"),
    (dict(crd_centering="prompt"), "crd_centering='prompt' is not valid; choose one of 'group', 'batch'"),
    (dict(crd_beta=0.0), "crd_beta=0.0 must be > 0"),
    (dict(crd_num_timesteps=0), "crd_num_timesteps=0"),
    (dict(timestep_fraction=0.05, num_inference_steps=10), "leaves int"),
    (dict(timestep_fraction=1.5), r"timestep_fraction=1.5 must be in \(0, 1\]"),
    (dict(old_policy_decay_initial=1.5), r"old_policy_decay_initial=1.5 must be in \[0, 1\]"),
    (dict(sampling_policy_decay_start=-3), "sampling_policy_decay_start=-3"),
    (dict(old_policy_decay_rate=-0.1), "old_policy_decay_rate=-0.1 must be >= 0"),
    (dict(reward_adaptive_kl=1), "reward_adaptive_kl=1 must be true or false"),
])
def test_crd_refuses_bad_values(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        make(CRDConfig, tmp_path, **bad)


# ---- on-policy distillation --------------------------------------------------------------------------------------

def test_opd_one_teacher_lora_and_its_guidance(tmp_path):
    args = make(DiffusionOPDConfig, tmp_path, teacher_lora="experts/ocr", guidance_scale=4.5)
    assert (args.opd_kl, args.noise_level, args.sde_type, args.beta) == ("exact", 0.7, "sde", 0.0)
    assert args.teacher_for_generation(5) == TeacherSpec(lora="experts/ocr", model_name_or_path=None,
                                                         guidance_scale=4.5, dataset_name=None)
    args = make(DiffusionOPDConfig, tmp_path, teacher_model_name_or_path="org/bigger", teacher_guidance_scale=3.0)
    assert args.teacher_specs == [TeacherSpec(lora=None, model_name_or_path="org/bigger", guidance_scale=3.0,
                                              dataset_name=None)]


def test_opd_several_teachers_are_cycled_one_domain_a_batch(tmp_path):
    teachers = [{"lora": "experts/ocr", "dataset_name": "ocr", "guidance_scale": 1.0},
                {"lora": "experts/geneval", "dataset_name": "geneval"},
                {"lora": "user/pickscore-lora", "dataset_name": "pickscore", "guidance_scale": 4.5}]
    args = make(DiffusionOPDConfig, tmp_path, teachers=teachers, teacher_guidance_scale=2.0)
    picked = [args.teacher_for_generation(g) for g in range(7)]
    assert [t.dataset_name for t in picked] == ["ocr", "geneval", "pickscore", "ocr", "geneval", "pickscore", "ocr"]
    assert [t.guidance_scale for t in picked[:3]] == [1.0, 2.0, 4.5]
    # the command line gives the same list as JSON
    (parsed,) = HfArgumentParser(DiffusionOPDConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--teachers",
         '[{"lora": "experts/ocr", "dataset_name": "ocr"}, {"lora": "experts/geneval", "dataset_name": "geneval"}]'])
    assert [t.lora for t in parsed.teacher_specs] == ["experts/ocr", "experts/geneval"]


@pytest.mark.parametrize("bad, match", [
    (dict(), "needs a teacher: set teacher_lora"),
    (dict(teacher_lora="a", teacher_model_name_or_path="b"), "give exactly one teacher source"),
    (dict(teachers=[{"lora": "a"}], teacher_lora="b"), "give exactly one teacher source"),
    (dict(teachers=[{"lora": "a", "dataset_name": "x"}, {"lora": "b"}]), r"teachers \[1\] have no dataset_name"),
    (dict(teachers=[{"lora": "a", "dataset_name": "x"}, {"lora": "b", "dataset_name": "x"}]), "repeat"),
    (dict(teachers=[{"lora": "a", "weight": 2}]), r"teachers\[0\] has unknown keys \['weight'\]"),
    (dict(teachers=[{"dataset_name": "x"}]), r"teachers\[0\] needs 'lora'"),
    (dict(teachers=[{"lora": "a", "guidance_scale": -1}]), r"teachers\[0\].guidance_scale=-1"),
    (dict(teachers="[{lora: a}]"), "is not valid JSON"),
    (dict(teachers=[]), "must be a non-empty list"),
    (dict(teacher_lora="a", opd_kl="kl"), "opd_kl='kl' is not valid"),
    (dict(teacher_lora="a", noise_level=0.0), "set noise_level > 0 .* or opd_kl: ode"),
    (dict(teacher_lora="a", sde_window_size=10, num_inference_steps=10), "sde_window_size=10 must be an integer in 0 .. "),
    (dict(teacher_lora="a", teacher_guidance_scale=0.0), "teacher_guidance_scale=0.0 must be > 0"),
])
def test_opd_refuses_bad_values(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        make(DiffusionOPDConfig, tmp_path, **bad)


def test_opd_ode_form_accepts_ode_rollouts(tmp_path):
    assert make(DiffusionOPDConfig, tmp_path, teacher_lora="a", noise_level=0.0, opd_kl="ode").opd_kl == "ode"


# ---- Flow-GRPO: Flow-DPPO and BranchGRPO -------------------------------------------------------------------------

def test_flow_grpo_defaults_leave_both_off(tmp_path):
    args = make(FlowGRPOConfig, tmp_path)
    assert (args.policy_loss, args.dppo_tau, args.branch_steps, args.branch_factor, args.branch_noise_scale,
            args.branch_split_log_prob, args.branch_pruning, args.branch_width_mode, args.branch_width_ratio,
            args.branch_prune_depths, args.branch_prune_slide_interval) == \
        ("clip", 1e-5, [], 2, 4.0, "exact", "none", "per_branch", 0.5, None, 0)
    assert not args.uses_branching


def test_dppo_warns_when_a_single_pass_makes_it_plain_policy_gradient(tmp_path):
    with pytest.warns(UserWarning, match="policy_loss='dppo' with num_iterations=1.*Set num_iterations: 2"):
        make(FlowGRPOConfig, tmp_path, policy_loss="dppo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = make(FlowGRPOConfig, tmp_path, policy_loss="dppo", num_iterations=2, dppo_tau=2e-5)
    assert (args.policy_loss, args.dppo_tau) == ("dppo", 2e-5)
    with pytest.raises(ValueError, match="policy_loss='ppo' is not valid; choose one of 'clip', 'dppo'"):
        make(FlowGRPOConfig, tmp_path, policy_loss="ppo")
    with pytest.raises(ValueError, match="dppo_tau=0.0 must be > 0"):
        make(FlowGRPOConfig, tmp_path, dppo_tau=0.0)


def branch(tmp_path, **kwargs):
    settings = dict(num_inference_steps=20, branch_steps=[0, 3, 6, 9], num_generations=16,
                    per_device_train_batch_size=16, sde_type="dance", noise_level=0.3)
    settings.update(kwargs)
    return make(FlowGRPOConfig, tmp_path, **settings)


def test_branch_grpo_official_setting_and_the_command_line(tmp_path):
    args = branch(tmp_path, branch_steps=[9, 0, 6, 3], branch_pruning="width")
    assert args.branch_steps == [0, 3, 6, 9] and args.uses_branching
    (parsed,) = HfArgumentParser(FlowGRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", "--num_inference_steps", "20", "--branch_steps", "0",
         "3", "6", "9", "--num_generations", "16", "--per_device_train_batch_size", "16", "--branch_pruning", "depth",
         "--branch_prune_depths", "15", "16", "17", "18", "--branch_prune_slide_interval", "30"])
    assert parsed.branch_steps == [0, 3, 6, 9] and parsed.branch_prune_depths == [15, 16, 17, 18]


@pytest.mark.parametrize("bad, match", [
    (dict(num_generations=8, per_device_train_batch_size=8), "gives trees of 2\\^4 = 16 leaves, but num_generations=8"),
    (dict(branch_steps=[0, 3, 20]), r"branch_steps \[20\] are outside 0 .. num_inference_steps - 1 = 19"),
    (dict(branch_steps=[3, 3, 6, 9]), "repeats a step"),
    (dict(branch_factor=1), "branch_factor=1 must be an integer >= 2"),
    (dict(branch_noise_scale=0.0), "branch_noise_scale=0.0 must be > 0"),
    (dict(branch_split_log_prob="scaled"), "branch_split_log_prob='scaled' is not valid; choose one of 'exact', "
                                           "'unscaled'"),
    (dict(branch_pruning="both"), "branch_pruning='both' is not valid"),
    (dict(branch_width_mode="best"), "branch_width_mode='best' is not valid"),
    (dict(branch_width_ratio=0.0), r"branch_width_ratio=0.0 must be in \(0, 1\]"),
    (dict(sde_window_size=4), "set sde_window_size: 0"),
    (dict(noise_level=0.0), "set noise_level > 0"),
    (dict(branch_pruning="depth"), "branch_pruning='depth' needs branch_prune_depths"),
    (dict(branch_pruning="depth", branch_prune_depths=[0, 21]), r"branch_prune_depths \[0, 21\] must be depths in "
                                                               "1 .. num_inference_steps = 20"),
    (dict(branch_prune_slide_interval=-1), "branch_prune_slide_interval=-1"),
    # the last step is the deterministic step to the clean sample: a split there is refused, with or without pruning
    (dict(branch_steps=[0, 3, 6, 19], branch_pruning="width"), "splits at the last sampling step 19"),
    (dict(branch_steps=[0, 3, 6, 19]), "splits at the last sampling step 19"),
    (dict(branch_steps=[], num_generations=16, branch_pruning="width"), "but branch_steps is empty"),
])
def test_branch_grpo_refuses_bad_values(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        branch(tmp_path, **bad)
