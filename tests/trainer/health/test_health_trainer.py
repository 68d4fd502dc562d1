"""Gold rewards, best-model export, the hacking alarm, diagnostics and guards in real training runs on the tiny SD3
pipeline (CPU). Scripted rewards make the trajectories deterministic: the training reward rises step by step while
the gold reward peaks at the first evaluation after training starts, then falls."""

import json
import os

import numpy as np
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from support.trainer_cases import PROMPTS, lora_config, make_args
from transformers import TrainerCallback

from flowgrpo import DiffusionNFTConfig, DiffusionNFTTrainer, FlowGRPOTrainer
from flowgrpo.rewards import register_reward
from flowgrpo.trainer.data.datasets import INDEX_COLUMN


class Scripted:
    """A reward whose value follows a script per call (plus ``detail`` x brightness, so groups are not flat)."""

    def __init__(self, name, script, detail=1e-3):
        self.__name__ = name
        self.script, self.detail, self.calls = script, detail, 0

    def __call__(self, prompts, images, **columns):
        base = self.script(self.calls)
        self.calls += 1
        return [base + self.detail * float(np.asarray(im, dtype=np.float32).mean() / 255) for im in images]


def rising(name="proxy"):
    return Scripted(name, lambda k: 0.1 * k)


def redness(prompts, images, **columns):
    return [float((np.asarray(im, dtype=np.float32)[..., 0] / 255).mean()) for im in images]


GOLD_SCRIPT = [0.5, 0.9, 0.88, 0.2, 0.1, 0.1]


def trainer_with_gold(tmp_path, path, **kwargs):
    register_reward("gold", overwrite=True)(
        Scripted("gold", lambda k: GOLD_SCRIPT[min(k, len(GOLD_SCRIPT) - 1)], detail=0.0))
    args = dict(max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                save_total_limit=1, eval_on_start=True, metric_for_best_model="eval_rewards/gold/mean",
                load_best_model_at_end=True, on_hacking="stop", health_kl_steps=1, learning_rate=5e-2,
                per_device_eval_batch_size=2, eval_num_inference_steps=3, eval_reward_funcs=["gold"])
    args.update(kwargs)
    return FlowGRPOTrainer(model=str(path), reward_funcs=[rising(), redness], args=make_args(tmp_path, **args),
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}), peft_config=lora_config())


class KeepWeights(TrainerCallback):
    """The trained LoRA tensors after every optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.steps = trainer, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step] = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()
                                         if p.requires_grad}


def test_best_export_hacking_stop_diagnostics_and_resume(tiny_sd3_path, tmp_path):
    trainer = trainer_with_gold(tmp_path, tiny_sd3_path)
    kept = KeepWeights(trainer)
    trainer.add_callback(kept)
    trainer.train()
    out = trainer.args.output_dir
    # Gold 0.9 at step 1, 0.88 at step 2 (within hacking_tolerance), 0.2 at step 3 while the training reward rose.
    assert trainer.stopped_by_hacking_alarm and trainer.state.global_step == 3
    evals = [h for h in trainer.state.log_history if "eval_rewards/gold/mean" in h]
    assert [h["eval_rewards/gold/mean"] for h in evals] == pytest.approx([0.5, 0.9, 0.88, 0.2])
    assert [h["health/hacking_alarm"] for h in evals] == [0.0, 0.0, 0.0, 1.0]
    assert {"eval_rewards/gold/std", "eval_rewards/gold/count", "eval_rewards/gold/change",
            "eval_rewards/gold/change_se", "eval_gold_reward", "eval_rewards/proxy/mean"} <= set(evals[-1])
    assert evals[-1]["eval_rewards/gold/change"] == pytest.approx(0.2 - 0.5)
    train = [h for h in trainer.state.log_history if "reward" in h and "loss" in h]
    for key in ("health/zero_std_groups", "health/diversity/grey32", "health/lora_update_ratio",
                "health/kl_to_reference", "health/reward_correlation/proxy__redness", "health/hacking_alarm"):
        assert all(np.isfinite(h[key]) for h in train), key
    assert train[0]["health/kl_to_reference"] > 0 and train[0]["health/lora_update_ratio"] > 0
    # The best evaluation is step 1: the rotation (save_total_limit=1) kept it while checkpoints 2 and 3 came and
    # went; trainer_state.json names it, and its weights are the final ones and the export's.
    best = os.path.join(out, "checkpoint-1")
    assert trainer.state.best_model_checkpoint == best and trainer.state.best_metric == pytest.approx(0.9)
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-1"]
    trainer.save_model()
    trainer.save_state()
    exported = load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    torch.testing.assert_close(exported, load_file(os.path.join(best, "pytorch_lora_weights.safetensors")))
    live = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    for name, value in kept.steps[1].items():
        torch.testing.assert_close(live[name], value)
    assert any(not torch.equal(kept.steps[3][n], v) for n, v in kept.steps[1].items())
    state = json.loads(open(os.path.join(out, "trainer_state.json")).read())
    assert state["best_model_checkpoint"] == best and state["best_metric"] == pytest.approx(0.9)
    trainer.create_model_card()
    card = open(os.path.join(out, "README.md")).read()
    assert "eval_rewards/gold/mean = 0.9000 at step 1" in card and "those of step 1" in card
    assert "stopped by the hacking alarm" in card
    # The guards' state is in every checkpoint; a resumed run starts from it.
    saved = json.loads(open(os.path.join(best, "health_state.json")).read())
    assert saved["hacking"]["best"]["gold"] == [pytest.approx(0.9), 1] and saved["diversity"]["first"] > 0
    resumed = trainer_with_gold(tmp_path, tiny_sd3_path, max_steps=1, on_hacking="warn")
    resumed.train(resume_from_checkpoint=best)
    assert resumed.health.monitor.hacking.best == {"gold": (pytest.approx(0.9), 1)}
    assert resumed.health.monitor.hacking.train_rewards[0] == pytest.approx(trainer.health.monitor.hacking.train_rewards[0])
    assert resumed.health.monitor.diversity.first == pytest.approx(trainer.health.monitor.diversity.first)
    assert resumed.state.best_metric == pytest.approx(0.9)


def test_dynamic_sampling_keeps_batch_shapes(tiny_sd3_path, tmp_path):
    def flat_for_cats(prompts, images, **columns):
        return [1.0 if "cat" in p else float(np.asarray(im, dtype=np.float32).mean()) for p, im in
                zip(prompts, images)]

    config = make_args(tmp_path, per_device_train_batch_size=8, filter_zero_std_groups=True, max_resample_rounds=2,
                       health_kl_steps=0, max_steps=1)
    trainer = FlowGRPOTrainer(model=str(tiny_sd3_path), reward_funcs=flat_for_cats, args=config,
                              train_dataset=Dataset.from_dict({"prompt": ["a cat", "a red circle"]}),
                              peft_config=lora_config())
    trainer.train()
    log = [h for h in trainer.state.log_history if "health/dropped_groups" in h][0]
    assert log["health/dropped_groups"] == 1.0 and log["health/zero_std_groups_kept"] == 0.0
    assert log["health/resample_rounds"] >= 1 and log["health/zero_std_groups"] == 0.0
    [batch] = trainer.buffer
    assert batch["advantages"].shape == (8,) and batch["latents"].shape[0] == 8 and len(batch["embeds"]) == 8


def test_gardo_reference_refresh_and_tail_flow_grpo(tiny_sd3_path, tmp_path):
    config = make_args(tmp_path, max_steps=2, beta=0.04, regularizer="gardo", gardo_auxiliary_rewards=["redness"],
                       reward_weights=[1.0, 0.0], gardo_reset_steps=1, sync_ref_model=True, ref_model_sync_steps=1,
                       ref_model_mixup_alpha=0.5, base_model_tail_steps=1, sde_window_size=2,
                       sde_window_range=[0, 2], scale_rewards="none", save_strategy="steps", save_steps=2)
    trainer = FlowGRPOTrainer(model=str(tiny_sd3_path), reward_funcs=[rising(), redness], args=config,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora_config())
    assert trainer.policy.reference.kind == "adapter"
    trainer.train()
    logs = [h for h in trainer.state.log_history if "gardo/gate_fraction" in h]
    assert logs and logs[0]["gardo/gate_fraction"] == pytest.approx(0.1) and "gardo/diversity_factor" in logs[0]
    assert "kl_gate" in trainer.buffer[0] and trainer.buffer[0]["kl_gate"].dtype == torch.bool
    assert trainer.policy.reference.refreshes >= 2  # the TRL-style sync every step and GARDO's scheduled reset
    ckpt = os.path.join(trainer.args.output_dir, "checkpoint-2")
    assert os.path.exists(os.path.join(ckpt, "reference_policy.safetensors"))
    assert not os.path.exists(os.path.join(ckpt, "ref"))  # not saved as a peft adapter folder
    # A rollout whose tail would reach a recorded SDE step stops with the same advice; a bad setting, before loading.
    trainer.args.base_model_tail_steps = 3
    with pytest.raises(ValueError, match="base_model_tail_steps=3 reaches a trained"):
        trainer._generate([{"prompt": p, INDEX_COLUMN: i} for i, p in enumerate(PROMPTS[:4])])
    with pytest.raises(ValueError, match="base_model_tail_steps=2 reaches the trained SDE window"):
        FlowGRPOTrainer(model=str(tiny_sd3_path), reward_funcs=rising(),
                        args=make_args(tmp_path, base_model_tail_steps=2, sde_window_size=0),
                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora_config())


def test_gardo_and_early_stopping_with_diffusion_nft(tiny_sd3_path, tmp_path):
    config = DiffusionNFTConfig(
        output_dir=str(tmp_path / "nft"), report_to=[], per_device_train_batch_size=4, num_generations=4,
        resolution=64, num_inference_steps=4, eval_num_inference_steps=3, max_steps=5, learning_rate=1e-2,
        max_sequence_length=16, logging_steps=1, disable_tqdm=True, seed=0, log_images_steps=0, dtype="float32",
        beta=0.01, regularizer="gardo", gardo_auxiliary_rewards=["redness"], reward_weights=[1.0, 0.0],
        eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_rewards/flat/mean", eval_reward_funcs=["flat"],
        early_stopping_patience=1, per_device_eval_batch_size=2, health_kl_steps=1, save_strategy="no")
    register_reward("flat", overwrite=True)(Scripted("flat", lambda k: 0.0, detail=0.0))
    trainer = DiffusionNFTTrainer(model=str(tiny_sd3_path), reward_funcs=[rising(), redness], args=config,
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                  eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}), peft_config=lora_config())
    trainer.train()
    # A flat gold metric never improves: transformers' EarlyStoppingCallback stops after patience 1.
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "gardo/gated" in h]
    assert logs and all(np.isfinite(h["health/kl_to_reference"]) for h in logs)
