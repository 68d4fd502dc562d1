"""DiffusionNFTTrainer on the tiny random SD3 pipeline (CPU): the old policy's updates, exact resumption, exports,
full fine-tuning, the launch script.

A random tiny pipeline cannot show learning (the toy world does, see docs/learning_leaderboard.md); these tests check
the mechanics exactly. The loss's math is tested in tests/trainer/algorithms/test_nft.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from support.callbacks import StopAfter
from transformers import TrainerCallback

from flowgrpo import DiffusionNFTConfig, DiffusionNFTTrainer, FlowGRPOTrainer
from flowgrpo.trainer.policy.old_policy import OLD_POLICY_ADAPTER, OLD_POLICY_WEIGHTS_NAME, old_policy_decay

PROMPTS = ["a red circle", "two blue squares", "a green triangle", "a cat"]
#: the old policy's decay after step k: 0 at step 1, then 0.3, 0.5, 0.5 (it moves slower than the policy)
DECAY = dict(old_policy_decay_start=1, old_policy_decay_rate=0.3, old_policy_decay_max=0.5)


def redness_reward(prompts, images, **columns):
    out = []
    for im in images:
        a = np.asarray(im, dtype=np.float32) / 255.0
        out.append(float(a[..., 0].mean() - a[..., 1:].mean()))
    return out


def make_trainer(path, out, peft=True, **kwargs):
    base = dict(output_dir=str(out), report_to=[], per_device_train_batch_size=4, num_generations=2, resolution=64,
                num_inference_steps=3, eval_num_inference_steps=3, max_steps=1, learning_rate=3e-3,
                max_sequence_length=16, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                log_images_steps=0, dtype="float32", timestep_fraction=0.67, **DECAY)
    base.update(kwargs)
    lora = LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    return DiffusionNFTTrainer(model=str(path), reward_funcs=redness_reward, args=DiffusionNFTConfig(**base),
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora if peft else None)


class Snapshots(TrainerCallback):
    """The trained and the old-policy tensors after every optimizer step (after the old policy's update)."""

    def __init__(self, trainer):
        self.trainer, self.theta, self.old = trainer, [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.theta.append([t.detach().clone() for t, _ in self.trainer.policy.old_policy.pairs])
        self.old.append([o.detach().clone() for _, o in self.trainer.policy.old_policy.pairs])



def nft_logs(trainer):
    return [h for h in trainer.state.log_history if "nft/positive_loss" in h]


def test_old_policy_follows_its_schedule_and_resume_is_exact(tiny_sd3_path, tmp_path):
    common = dict(max_steps=3, save_strategy="steps", save_steps=2, use_ema=True)
    straight = make_trainer(tiny_sd3_path, tmp_path / "a" / "out", **common)
    initial_theta = [t.detach().clone() for t, _ in straight.policy.old_policy.pairs]
    for (_, o), t in zip(straight.policy.old_policy.pairs, initial_theta):
        torch.testing.assert_close(o, t)  # the old policy starts as the trained one
    snapshots = Snapshots(straight)
    straight.add_callback(snapshots)
    straight.train()

    logs = nft_logs(straight)
    assert [round(x["step"]) for x in logs] == [1, 2, 3]
    keys = ("loss", "nft/policy_loss", "nft/positive_loss", "nft/negative_loss", "nft/old_policy_decay", "kl",
            "reward", "rewards/redness_reward/mean", "timing/rollout", "timing/training_forward", "timing/sampling")
    assert all(k in x for x in logs for k in keys)
    # step 1 trains against an old policy equal to the current one: v+ = v- = v_theta, so L+ = L-
    assert logs[0]["nft/old_policy_deviation"] == 0.0
    assert logs[0]["nft/positive_loss"] == pytest.approx(logs[0]["nft/negative_loss"], rel=1e-6)
    # with a decay of 0 after step 1 the old policy is still the current one at step 2; after 0.3 it lags at step 3
    assert logs[1]["nft/old_policy_deviation"] == 0.0 and logs[2]["nft/old_policy_deviation"] > 0
    decays = [old_policy_decay(k, start=1, rate=0.3, maximum=0.5) for k in (1, 2, 3)]
    assert decays == pytest.approx([0.0, 0.3, 0.5])
    assert [x["nft/old_policy_decay"] for x in logs] == pytest.approx(decays)
    previous = initial_theta
    for k, decay in enumerate((0.0, 0.3, 0.5)):
        for old_prev, theta, old in zip(previous, snapshots.theta[k], snapshots.old[k]):
            torch.testing.assert_close(old, decay * old_prev + (1 - decay) * theta)
        previous = snapshots.old[k]
    assert any((a - b).abs().max() > 0 for a, b in zip(snapshots.old[-1], snapshots.theta[-1]))

    interrupted = make_trainer(tiny_sd3_path, tmp_path / "b" / "out", **common)
    interrupted.add_callback(StopAfter(2))
    interrupted.train()
    ckpt = tmp_path / "b" / "out" / "checkpoint-2"
    assert (ckpt / OLD_POLICY_ADAPTER / "adapter_model.safetensors").exists()  # the old policy, as a peft adapter
    resumed = make_trainer(tiny_sd3_path, tmp_path / "b" / "out", **common)
    resumed.train(resume_from_checkpoint=str(ckpt))
    b = nft_logs(resumed)
    assert [round(x["step"]) for x in b] == [1, 2, 3]
    for x, y in zip(logs, b):
        for key in ("loss", "nft/positive_loss", "nft/negative_loss", "nft/old_policy_deviation", "reward",
                    "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)
    for (p, o), (q, r) in zip(straight.policy.old_policy.pairs, resumed.policy.old_policy.pairs):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(o, r)
    for s, t in zip(straight.policy.ema.shadow, resumed.policy.ema.shadow):
        torch.testing.assert_close(s, t)
    # a checkpoint without an old policy cannot continue a DiffusionNFT run exactly
    flow_grpo_like = tmp_path / "c" / "checkpoint-1"
    flow_grpo_like.mkdir(parents=True)
    with pytest.raises(ValueError, match="no old-policy adapter"):
        resumed._load_from_checkpoint(str(flow_grpo_like))


def test_exported_lora_is_the_trained_adapter_and_loads_in_the_stock_pipeline(tiny_sd3_path, tmp_path):
    from diffusers import DiffusionPipeline
    from safetensors import safe_open

    trainer = make_trainer(tiny_sd3_path, tmp_path / "out", learning_rate=5e-2, beta=0.0)
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    assert not os.path.exists(os.path.join(out, OLD_POLICY_ADAPTER))  # exports hold the trained adapter only
    assert "kl" not in nft_logs(trainer)[0]  # beta = 0: no reference pass
    with safe_open(os.path.join(out, "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert keys and all(k.startswith("transformer.") and ".old." not in k for k in keys)
        trained = {k: f.get_tensor(k) for k in keys}
    live = {n: p for n, p in trainer.model.named_parameters() if ".default." in n}
    assert len(live) == len(trained)
    pipe = DiffusionPipeline.from_pretrained(str(tiny_sd3_path))
    kwargs = dict(prompt="a red circle", num_inference_steps=3, height=64, width=64, output_type="np",
                  max_sequence_length=16)
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(out)
    tuned = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert np.abs(base - tuned).max() > 0
    card = (tmp_path / "out" / "README.md")
    trainer.create_model_card()
    text = card.read_text()
    assert "DiffusionNFT" in text and "2509.16117" in text and "nft_beta" in text


def test_full_finetuning_keeps_a_frozen_old_copy_in_checkpoints(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path / "out", peft=False, max_steps=2, save_strategy="steps",
                           save_steps=2, learning_rate=1e-3, timestep_fraction=0.34)
    assert trainer.policy.old_policy.module is not trainer.model
    assert not any(p.requires_grad for p in trainer.policy.old_policy.module.parameters())
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    assert (ckpt / OLD_POLICY_WEIGHTS_NAME).exists()
    saved = [o.detach().clone() for _, o in trainer.policy.old_policy.pairs]
    assert any((o - t).abs().max() > 0 for t, o in trainer.policy.old_policy.pairs)  # decay 0.3 at step 2
    for _, o in trainer.policy.old_policy.pairs:
        o.data.zero_()
    trainer.policy.old_policy.load(ckpt)
    for (_, o), s in zip(trainer.policy.old_policy.pairs, saved):
        torch.testing.assert_close(o, s)


def test_configs_and_trainers_do_not_mix(tmp_path):
    with pytest.raises(TypeError, match="args must be a FlowGRPOConfig for FlowGRPOTrainer, got DiffusionNFTConfig"):
        FlowGRPOTrainer(model="/nonexistent", reward_funcs=redness_reward,
                        args=DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[]))


def test_launch_script_runs_the_trainer_the_recipe_names(tiny_sd3_path, tmp_path, capsys):
    from flowgrpo.cli import main

    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    recipe = tmp_path / "nft.yaml"
    recipe.write_text(f"""trainer: diffusion_nft
model_name_or_path: {tiny_sd3_path}
dtype: float32
lora_r: 4
lora_alpha: 8
lora_target_modules: [to_q, to_k]
dataset_name: {tmp_path / "prompts.txt"}
dataset_test_split: null
reward_funcs: [jpeg_compressibility]
resolution: 64
num_inference_steps: 2
sampler: euler
max_sequence_length: 16
num_generations: 2
per_device_train_batch_size: 4
max_steps: 1
output_dir: {tmp_path / "run"}
save_strategy: "no"
report_to: none
use_cpu: true
disable_tqdm: true
log_images_steps: 0
""")
    trainer = main([str(recipe)])
    assert isinstance(trainer, DiffusionNFTTrainer) and trainer.args.sampler == "euler"
    assert trainer.state.global_step == 1 and (tmp_path / "run" / "pytorch_lora_weights.safetensors").exists()
    assert "nft/positive_loss" in trainer.state.log_history[0]


def test_benchmark_presets_build_the_nft_trainer_and_count_its_flops():
    from flowgrpo.benchmarking import get_preset, run_benchmark, step_flops, transformer_forward_flops
    from flowgrpo.benchmarking.presets import SD35M_TRANSFORMER

    gpu = get_preset("sd35m-nft-random")
    kwargs = gpu.config_kwargs()
    assert gpu.trainer == "diffusion_nft" and gpu.architecture == "sd35m" and "noise_level" not in kwargs
    args = DiffusionNFTConfig(output_dir="unused", report_to=[], **{**kwargs, "bf16": False, "use_cpu": True})
    assert (args.guidance_scale, args.num_inference_steps, args.num_trained_timesteps, args.nft_beta) == (1.0, 10, 9,
                                                                                                           0.1)
    # an NFT step: rollout forwards, then per trained noise level policy forward + backward, old-policy and
    # reference forwards
    fwd = transformer_forward_flops("sd3", dict(SD35M_TRANSFORMER), 1024, 333, 32, list(gpu.lora_targets))
    flops = step_flops(fwd, micro_batches=8, micro_batch_size=8, num_inference_steps=10, trained_steps=9, cfg=False,
                       beta=1e-4, gradient_checkpointing=True, old_policy=True)
    assert (flops.rollout_forwards, flops.training_passes, flops.old_policy_forwards, flops.reference_forwards) == (
        80, 72, 72, 72)
    assert flops.old_policy == 72 * 8 * fwd.total and flops.reference == 72 * 8 * fwd.base
    assert flops.total == flops.rollout + flops.training + flops.old_policy + flops.reference

    result = run_benchmark("tiny-nft", steps=1, warmup_steps=0, log=None)
    counted = result["flops"]
    assert (counted["rollout_forwards"], counted["training_passes"], counted["old_policy_forwards"]) == (8, 6, 6)
    assert result["floor_time_s"] > 0 and result["breakdown"]["training_backward"] > 0
