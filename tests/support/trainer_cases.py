"""The tiny trainers the trainer tests share: prompts, a cheap reward, a LoRA, test-sized configurations and
`make_trainer` for each trainer kind."""

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig

from flowgrpo import (
    AWMConfig,
    AWMTrainer,
    CRDConfig,
    CRDTrainer,
    DGPOConfig,
    DGPOTrainer,
    DiffusionDPOConfig,
    DiffusionDPOTrainer,
    DiffusionNFTConfig,
    DiffusionNFTTrainer,
    DiffusionOPDConfig,
    DiffusionOPDTrainer,
    FlowGRPOConfig,
    FlowGRPOTrainer,
    RewardBackpropConfig,
    RewardBackpropTrainer,
)

PROMPTS = ["a red circle", "two blue squares", 'a sign that says "hi"', "a green triangle on the left",
           "three yellow stars", "a cat", "a dog", "an apple"]


def brightness_reward(prompts, images, **columns):
    """Cheap deterministic reward: mean brightness in [0, 1]; differentiable (a float tensor (N, 3, H, W) in [0, 1]
    gives a tensor (N,) with its gradient, for the reward-gradient trainer)."""
    if isinstance(images, torch.Tensor):
        return images.mean(dim=(1, 2, 3))
    return [float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


def redness_reward(prompts, images, **columns):
    """Red minus the other channels, in [-1, 1]; differentiable as `brightness_reward`."""
    if isinstance(images, torch.Tensor):
        return images[:, 0].mean(dim=(1, 2)) - images[:, 1:].mean(dim=(1, 2, 3))
    out = []
    for im in images:
        a = np.asarray(im, dtype=np.float32) / 255.0
        out.append(float(a[..., 0].mean() - a[..., 1:].mean()))
    return out


brightness_reward.differentiable = True
redness_reward.differentiable = True


def lora_config(init="gaussian"):
    # init_lora_weights=True keeps B = 0 (identity at start); "gaussian" too (A gaussian, B zero).
    return LoraConfig(r=4, lora_alpha=8, init_lora_weights=init, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


#: the trainers on the shared base that the resume and export tests run: configuration and trainer classes, the
#: settings that make a short run exercise their own state (SDE window, replayed in one pass; AWM's EMA adapter
#: sampling off-policy; online DPO pairs), and the logged keys a resumed run must reproduce
TRAINER_KINDS = {
    # Flow-GRPO's two recorded steps replayed in one pass (train_timesteps_per_pass): resume and export with it
    "flow_grpo": (FlowGRPOConfig, FlowGRPOTrainer, dict(sde_window_size=2, sde_window_range=[0, 2],
                                                        train_timesteps_per_pass="all"),
                  ("reward", "policy_loss", "ratio_mean", "grad_norm")),
    "awm": (AWMConfig, AWMTrainer, dict(train_timesteps=2, beta=0.01, off_policy=True),
            ("reward", "policy_loss", "ratio_mean", "kl", "grad_norm")),
    "diffusion_dpo": (DiffusionDPOConfig, DiffusionDPOTrainer, dict(dpo_mode="online", beta_dpo=50.0),
                      ("reward", "loss", "dpo/inside", "grad_norm")),
    # DGPO: rollouts switch to the EMA reference after step 1; CRD: the sampling copy lags from step 1
    "dgpo": (DGPOConfig, DGPOTrainer, dict(dgpo_num_timesteps=2, dgpo_trunc_steps=2, dgpo_switch_ema_ref=1,
                                           beta=0.01, beta_dpo=10.0, dgpo_clip=0.05),
             ("reward", "policy_loss", "dgpo/dsm", "kl", "grad_norm")),
    "crd": (CRDConfig, CRDTrainer, dict(crd_num_timesteps=2, sampling_policy_decay_start=1, beta=0.01,
                                        kl_guidance_scale=2.0),
            ("reward", "policy_loss", "crd/implicit_reward", "kl", "grad_norm")),
    # the teacher: `teacher_lora_folder` of the pipeline, given by make_trainer
    "diffusion_opd": (DiffusionOPDConfig, DiffusionOPDTrainer, dict(sde_window_size=2, noise_level=1.0),
                      ("reward", "opd_kl", "grad_norm")),
    # Flow-GRPO's two switches: two passes over each batch (the trust region acts on the second), and trees
    "flow_dppo": (FlowGRPOConfig, FlowGRPOTrainer, dict(policy_loss="dppo", num_iterations=2, sde_window_size=2,
                                                        sde_window_range=[0, 2]),
                  ("ratio_mean", "policy_loss", "dppo/divergence_mean", "grad_norm")),
    "branch_grpo": (FlowGRPOConfig, FlowGRPOTrainer, dict(branch_steps=[0, 1], noise_level=1.0),
                    ("reward", "policy_loss", "ratio_mean", "branch/trained_edges", "grad_norm")),
    # DRaFT-K through the last 2 of 4 steps, checkpointed step by step, with the KL to the base
    "reward_backprop": (RewardBackpropConfig, RewardBackpropTrainer, dict(backprop_steps=2, kl_beta=0.01),
                        ("reward", "loss", "backprop/reward_loss", "kl", "grad_norm")),
    # rollout_cache: DiffusionNFT's rollouts through diffusers' PAB hooks (two of the four steps skip attention)
    "diffusion_nft_cached": (DiffusionNFTConfig, DiffusionNFTTrainer, dict(rollout_cache="pab", timestep_fraction=0.5),
                             ("reward", "nft/policy_loss", "rollout/cache_skipped", "grad_norm")),
    # a third-party algorithm (support/plugin_package.py), found by its entry point; its classes load with it
    "scaled_grpo": (None, None, dict(sde_window_size=2, sde_window_range=[0, 2], advantage_scale=-1.0),
                    ("reward", "policy_loss", "ratio_mean", "grad_norm")),
}


#: trainers `make_trainer` builds besides the shared cases (tests of their own resume them)
OTHER_KINDS = {"diffusion_nft": (DiffusionNFTConfig, DiffusionNFTTrainer)}


def kind_classes(kind: str) -> tuple[type, type]:
    """The configuration and trainer classes of ``kind`` (a plugin's from the registry, once installed)."""
    config_class, trainer_class = OTHER_KINDS[kind] if kind in OTHER_KINDS else TRAINER_KINDS[kind][:2]
    if config_class is None:
        from flowgrpo.trainer.registry import TRAINERS

        from .plugin_package import ensure_plugin_installed

        ensure_plugin_installed()
        spec = TRAINERS[kind]
        config_class, trainer_class = spec.config_class(), spec.trainer_class()
    return config_class, trainer_class


def teacher_lora_folder(pipeline_path, seed: int = 1, rank: int = 4) -> Path:
    """A teacher for on-policy distillation on the tiny pipeline at ``pipeline_path``: a LoRA of random, non-zero
    weights (``seed``) exported in diffusers' format, built once per pipeline folder (under the system's temporary
    folder; parallel test workers build it once)."""
    import torch
    from diffusers import DiffusionPipeline
    from peft import get_peft_model

    from flowgrpo.build_cache import build_folder_once
    from flowgrpo.models import get_family_adapter
    from flowgrpo.trainer.outputs.lora_export import LORA_WEIGHTS_NAME, save_diffusers_lora

    key = hashlib.sha1(f"{Path(pipeline_path).resolve()}|{seed}|{rank}".encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / "flowgrpo-test-teachers" / key

    def build(staging: Path) -> None:
        pipeline = DiffusionPipeline.from_pretrained(str(pipeline_path))
        adapter = get_family_adapter(pipeline)
        torch.manual_seed(seed)
        model = get_peft_model(adapter.trainable_module(), LoraConfig(
            r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian",
            target_modules=sorted(adapter.default_lora_target_modules)))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.05)
        save_diffusers_lora(adapter.lora_writer(), staging, model)

    return build_folder_once(target, build, marker=LORA_WEIGHTS_NAME, what="teacher LoRA")


def make_args(tmp_path, config_class=FlowGRPOConfig, **kwargs):
    base = dict(
        output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=4, num_generations=4,
        resolution=64, num_inference_steps=4, eval_num_inference_steps=4, guidance_scale=1.0, max_steps=1,
        learning_rate=1e-2, beta=0.0, max_sequence_length=16, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, log_images_steps=0, dtype="float32",
    )
    base.update(kwargs)
    return config_class(**base)


def make_trainer(path, tmp_path, reward=brightness_reward, peft=True, dataset=None, kind="flow_grpo", **kwargs):
    """A trainer of ``kind`` (`TRAINER_KINDS`) on the tiny pipeline at ``path`` with test-sized defaults (``kwargs``
    go to its configuration)."""
    config_class, trainer_class = kind_classes(kind)
    if kind == "diffusion_opd" and not any(kwargs.get(k) for k in ("teacher_lora", "teacher_model_name_or_path",
                                                                       "teachers")):
        kwargs["teacher_lora"] = str(teacher_lora_folder(path))
    return trainer_class(
        model=str(path), reward_funcs=reward, args=make_args(tmp_path, config_class, **kwargs),
        train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=lora_config() if peft else None,
    )
