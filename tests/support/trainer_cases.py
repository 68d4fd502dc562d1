"""The tiny trainers the trainer tests share: prompts, a cheap reward, a LoRA, test-sized configurations and
`make_trainer` for each trainer kind."""

import numpy as np
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
    FlowGRPOConfig,
    FlowGRPOTrainer,
)

PROMPTS = ["a red circle", "two blue squares", 'a sign that says "hi"', "a green triangle on the left",
           "three yellow stars", "a cat", "a dog", "an apple"]


def brightness_reward(prompts, images, **columns):
    """Cheap deterministic reward: mean brightness in [0, 1]."""
    return [float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


def redness_reward(prompts, images, **columns):
    out = []
    for im in images:
        a = np.asarray(im, dtype=np.float32) / 255.0
        out.append(float(a[..., 0].mean() - a[..., 1:].mean()))
    return out


def lora_config(init="gaussian"):
    # init_lora_weights=True keeps B = 0 (identity at start); "gaussian" too (A gaussian, B zero).
    return LoraConfig(r=4, lora_alpha=8, init_lora_weights=init, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


#: the trainers on the shared base that the resume and export tests run: configuration and trainer classes, the
#: settings that make a short run exercise their own state (SDE window; AWM's EMA adapter sampling off-policy;
#: online DPO pairs), and the logged keys a resumed run must reproduce
TRAINER_KINDS = {
    "flow_grpo": (FlowGRPOConfig, FlowGRPOTrainer, dict(sde_window_size=2, sde_window_range=[0, 2]),
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
}


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
    config_class, trainer_class, _, _ = TRAINER_KINDS[kind]
    return trainer_class(
        model=str(path), reward_funcs=reward, args=make_args(tmp_path, config_class, **kwargs),
        train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS}),
        peft_config=lora_config() if peft else None,
    )
