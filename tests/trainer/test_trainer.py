"""FlowGRPOTrainer on tiny random SD3 / FLUX pipelines (CPU).

A random tiny pipeline cannot show that RL *learns* (its images are noise whatever the policy); these tests
check the mechanics exactly: on-policy ratio 1, KL 0 at the start, the direction of one update, what is
trained, logging, evaluation, export and exact resumption. Learning itself is shown on the toy world.
"""

import math
import os

import numpy as np
import pytest
import torch
from datasets import Dataset
from PIL import Image
from support.callbacks import StopAfter
from support.trainer_cases import (
    PROMPTS,
    TRAINER_KINDS,
    brightness_reward,
    lora_config,
    make_args,
    make_trainer,
    redness_reward,
)

from flowgrpo import (
    FlowGRPOTrainer,
)
from flowgrpo.schedulers import sde_step_from_sigmas


def train_logs(trainer, key="ratio_mean"):
    return [h for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("guidance, window", [(1.0, 0), (3.0, 2)])
def test_first_pass_ratio_is_one_and_kl_zero(tiny_sd3_path, tmp_path, sde_type, guidance, window):
    trainer = make_trainer(tiny_sd3_path, tmp_path, sde_type=sde_type, guidance_scale=guidance, sde_window_size=window,
                           sde_window_range=[0, 2] if window else None, beta=0.04, num_inference_steps=4)
    trainer.train()
    log = train_logs(trainer)[0]
    assert abs(log["ratio_mean"] - 1.0) < 1e-5
    assert log["on_policy_ratio_max_dev"] < 1e-5
    assert log["kl"] == pytest.approx(0.0, abs=1e-10)
    assert log["clip_frac"] == 0.0
    for key in ("reward", "reward_std", "rewards/brightness_reward/mean", "rewards/brightness_reward/std",
                "frac_reward_zero_std", "policy_loss", "approx_kl", "grad_norm", "timing/sampling", "timing/reward",
                "timing/training", "timing/startup"):
        assert key in log, key
        assert math.isfinite(log[key]), key


def test_first_pass_ratio_is_one_flux(tiny_flux_path, tmp_path):
    trainer = make_trainer(tiny_flux_path, tmp_path, guidance_scale=1.0, sde_window_size=2, sde_window_range=[0, 2])
    trainer.train()
    log = train_logs(trainer)[0]
    assert abs(log["ratio_mean"] - 1.0) < 1e-5
    assert log["on_policy_ratio_max_dev"] < 1e-5


def stored_log_probs(trainer, batch):
    """Recompute log p_theta(x_{j+1} | x_j) for every stored step of ``batch`` with the current weights."""
    args = trainer.args
    model = trainer.model
    h, w = args.image_size
    out = []
    with torch.no_grad():
        for j in range(batch["latents"].shape[1]):
            v = trainer.policy.velocity(model, batch["latents"][:, j], batch["timesteps"][:, j], batch["embeds"],
                                  args.guidance_scale, h, w)
            step = sde_step_from_sigmas(v, batch["latents"][:, j], batch["sigmas"][:, j], batch["sigmas_next"][:, j],
                                        prev_sample=batch["next_latents"][:, j], noise_level=args.noise_level,
                                        sde_type=args.sde_type,
                                        sigma_max_fallback=float(trainer.rollouts.scheduler.sigmas[1]))
            out.append(step.log_prob)
    return torch.stack(out, 1)


def test_one_step_moves_log_probs_with_advantages(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, reward=redness_reward, per_device_train_batch_size=8,
                           num_generations=4, epsilon=10.0, learning_rate=3e-3, sde_window_size=2,
                           sde_window_range=[0, 2], noise_level=1.0)
    trainer.train()
    batch = trainer.buffer[0]
    before = batch["log_probs"]
    after = stored_log_probs(trainer, batch)
    delta = (after - before).sum(1)
    adv = batch["advantages"]
    assert (adv > 0).any() and (adv < 0).any()
    assert delta[adv > 0].mean() > 0
    assert delta[adv < 0].mean() < 0
    assert (delta * adv).sum() > 0


def test_training_runs_only_window_steps(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, num_inference_steps=6, sde_window_size=2, sde_window_range=[1, 4])
    calls = {"train": 0, "eval": 0}
    base = trainer.accelerator.unwrap_model(trainer.model).get_base_model()
    handle = base.register_forward_pre_hook(lambda mod, args: calls.__setitem__(
        "train" if mod.training else "eval", calls["train" if mod.training else "eval"] + 1))
    trainer.train()
    handle.remove()
    assert calls["eval"] == 6  # one rollout micro-batch, all steps
    assert calls["train"] == 2  # only the window's two steps are trained
    batch = trainer.buffer[0]
    start, end = batch["window"]
    assert end - start == 2 and 1 <= start < 4
    sigmas = trainer.rollouts.scheduler.sigmas
    torch.testing.assert_close(batch["sigmas"][0], sigmas[start:end].float())


def test_each_unique_prompt_encoded_once(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, per_device_train_batch_size=4, num_generations=4,
                           gradient_accumulation_steps=2)
    seen = []
    original = trainer.adapter.encode_prompts
    trainer.adapter.encode_prompts = lambda prompts, *a, **k: (seen.append(list(prompts)), original(prompts, *a, **k))[1]
    trainer.train()
    assert len(seen) == 1  # one generation batch of 2 prompts x 4 images
    assert len(seen[0]) == 2 == len(set(seen[0]))


def test_full_finetune_and_evaluate(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, peft=False, beta=0.1, learning_rate=1e-4,
                           eval_num_inference_steps=3, per_device_eval_batch_size=4)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    log = train_logs(trainer)[0]
    assert abs(log["ratio_mean"] - 1) < 1e-5 and log["kl"] == pytest.approx(0.0, abs=1e-10)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    metrics = trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:5]}))
    assert "eval_reward" in metrics and "eval_rewards/brightness_reward/mean" in metrics
    assert os.path.exists(os.path.join(trainer.args.output_dir, "eval_step_1.png"))
    again = trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:5]}))
    assert again["eval_reward"] == metrics["eval_reward"]  # fixed seeds, ODE: deterministic
    assert "eval_rewards/brightness_reward/change" not in metrics  # the first evaluation of this set: the baseline
    assert again["eval_rewards/brightness_reward/change"] == 0.0
    assert again["eval_rewards/brightness_reward/change_se"] == 0.0
    assert again["eval_rewards/brightness_reward/count"] == 5.0
    trainer.save_model()
    from diffusers import SD3Transformer2DModel

    reloaded = SD3Transformer2DModel.from_pretrained(os.path.join(trainer.args.output_dir, "transformer"))
    for (name, p), q in zip(trainer.model.named_parameters(), reloaded.parameters()):
        torch.testing.assert_close(p.detach(), q, msg=name)


def test_evaluate_draws_several_seeded_images_per_prompt(tiny_sd3_path, tmp_path):
    seen = []

    def recording_reward(prompts, images, **columns):
        seen.append((list(prompts), [np.asarray(im).copy() for im in images]))
        return brightness_reward(prompts, images)

    trainer = make_trainer(tiny_sd3_path, tmp_path, reward=recording_reward, eval_num_inference_steps=3,
                           per_device_eval_batch_size=4, eval_images_per_prompt=3)
    eval_set = Dataset.from_dict({"prompt": PROMPTS[:2]})
    metrics = trainer.evaluate(eval_set)
    prompts = [p for batch, _ in seen for p in batch]
    images = [im for _, batch in seen for im in batch]
    assert prompts == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert not np.array_equal(images[0], images[1]) and not np.array_equal(images[1], images[2])
    assert metrics["eval_reward"] == pytest.approx(np.mean([im.astype(np.float32).mean() / 255 for im in images]))
    sheet = Image.open(os.path.join(trainer.args.output_dir, "eval_step_0.png"))
    assert sheet.width == 2 * 192  # one cell per prompt (its first image), not one per sample
    trainer.args.eval_images_per_prompt = 1  # sample 0 keeps its seed: the same first image
    seen.clear()
    trainer.evaluate(eval_set)
    first = seen[0][1][0].astype(np.int16)
    assert len(seen[0][1]) == 2
    assert np.abs(first - images[0]).max() <= 2  # other batch shapes: float rounding only
    assert np.abs(first - images[1]).max() > 20
    with pytest.raises(ValueError, match="eval_images_per_prompt=0"):
        make_args(tmp_path, eval_images_per_prompt=0)


def test_evaluation_at_several_guidance_scales_logs_each(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, eval_num_inference_steps=3, eval_guidance_scales=[1.0, 4.0])
    assert trainer.args.evaluation_guidance_scales == [1.0, 4.0]
    metrics = trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:2]}))
    for prefix in ("eval", "eval_cfg4"):
        assert f"{prefix}_reward" in metrics and f"{prefix}_rewards/brightness_reward/count" in metrics
    assert metrics["eval_reward"] != metrics["eval_cfg4_reward"]  # guidance changes the images
    assert os.path.exists(os.path.join(trainer.args.output_dir, "eval_step_0.png"))
    assert os.path.exists(os.path.join(trainer.args.output_dir, "eval_step_0_cfg4.png"))
    again = trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:2]}))
    assert again["eval_cfg4_rewards/brightness_reward/change"] == 0.0  # each scale is paired with its own baseline
    with pytest.raises(ValueError, match="eval_guidance_scales"):
        make_args(tmp_path, eval_guidance_scales=[-1.0])



@pytest.mark.parametrize("kind", list(TRAINER_KINDS))
def test_resume_matches_uninterrupted(tiny_sd3_path, tmp_path, kind):
    _, _, settings, keys = TRAINER_KINDS[kind]
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, learning_rate=3e-3, use_ema=True, ema_warmup=True,
                  reward=redness_reward, kind=kind, **settings)
    straight = make_trainer(tiny_sd3_path, tmp_path / "a", **common)
    straight.train()
    interrupted = make_trainer(tiny_sd3_path, tmp_path / "b", **common)
    interrupted.add_callback(StopAfter(2))
    interrupted.train()
    ckpt = tmp_path / "b" / "out" / "checkpoint-2"
    assert (ckpt / "pytorch_lora_weights.safetensors").exists()
    assert (ckpt / "ema_state.pt").exists()
    resumed = make_trainer(tiny_sd3_path, tmp_path / "b", **common)
    resumed.train(resume_from_checkpoint=str(ckpt))
    a = train_logs(straight, keys[1])
    b = train_logs(resumed, keys[1])  # the restored history (steps 1-2) plus the resumed steps
    assert train_logs(interrupted, keys[1]) == b[:2]
    assert [round(x["step"]) for x in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for key in keys:
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), (x["step"], key)
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q)
    for s, t in zip(straight.policy.ema.shadow, resumed.policy.ema.shadow):
        torch.testing.assert_close(s, t)
    if straight.policy.old_policy is not None:  # AWM's EMA adapter
        for (_, o), (_, r) in zip(straight.policy.old_policy.pairs, resumed.policy.old_policy.pairs):
            torch.testing.assert_close(o, r)
    for name, kept in straight.policy.copies.items():  # CRD's sampling copy
        assert (ckpt / name).is_dir()
        for (_, o), (_, r) in zip(kept.pairs, resumed.policy.copies[name].pairs):
            torch.testing.assert_close(o, r)


@pytest.mark.parametrize("kind", list(TRAINER_KINDS))
def test_lora_export_loads_in_stock_pipeline(tiny_sd3_path, tmp_path, kind):
    from diffusers import DiffusionPipeline

    trainer = make_trainer(tiny_sd3_path, tmp_path, learning_rate=5e-2, kind=kind, reward=redness_reward,
                           **TRAINER_KINDS[kind][2])
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    from safetensors import safe_open

    with safe_open(os.path.join(out, "pytorch_lora_weights.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert keys and all(k.startswith("transformer.") and ".old." not in k and ".sampling." not in k for k in keys)
        assert any(f.get_tensor(k).abs().sum() > 0 for k in keys if "lora_B" in k)
        assert "lora_adapter_metadata" in (f.metadata() or {})
    for copy_name in ("old", *trainer.policy.copies):  # exports hold the trained adapter only
        assert not os.path.exists(os.path.join(out, copy_name))
    pipe = DiffusionPipeline.from_pretrained(str(tiny_sd3_path))
    kwargs = dict(prompt="a red circle", num_inference_steps=3, height=64, width=64, output_type="np",
                  max_sequence_length=16)
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(out)
    tuned = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert np.abs(base - tuned).max() > 0
    trainer.create_model_card()
    card = open(os.path.join(out, "README.md")).read()
    assert trainer._name in card and trainer._paper["id"] in card


def test_bad_inputs_fail_before_loading(tmp_path):
    args = make_args(tmp_path)
    with pytest.raises(ValueError, match="not_a_reward"):
        FlowGRPOTrainer(model="/nonexistent", reward_funcs="not_a_reward", args=args,
                        train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    with pytest.raises(ValueError, match="'prompt' column"):
        FlowGRPOTrainer(model="/nonexistent", reward_funcs=brightness_reward, args=args,
                        train_dataset=Dataset.from_dict({"text": PROMPTS}))


def test_quantized_loading_configuration(tmp_path):
    pytest.importorskip("bitsandbytes", reason="the bnb extra is not installed")
    from flowgrpo.trainer.policy.quantization import build_quantization_config

    cfg4 = build_quantization_config("4bit", torch.bfloat16)
    assert cfg4.load_in_4bit and cfg4.bnb_4bit_quant_type == "nf4" and cfg4.bnb_4bit_compute_dtype == torch.bfloat16
    assert build_quantization_config("8bit", torch.bfloat16).load_in_8bit
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            FlowGRPOTrainer(model="/nonexistent", reward_funcs=brightness_reward,
                            args=make_args(tmp_path, quantization="4bit"),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora_config())
        pytest.skip("loading a bitsandbytes-quantized transformer needs CUDA; configuration checked above")


def test_wandb_and_tensorboard_receive_scalars_and_images(tiny_sd3_path, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    (tmp_path / "wandb").mkdir()
    trainer = make_trainer(tiny_sd3_path, tmp_path, report_to=["tensorboard", "wandb"], log_images_steps=1,
                           num_log_images=4, run_name="flowgrpo-test")
    trainer.train()
    import wandb

    wandb.finish()
    wandb.teardown()  # wandb keeps process-wide settings (WANDB_DIR included) until torn down
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_dirs = {root for root, _, files in os.walk(tmp_path / "tb") if any("tfevents" in f for f in files)}
    tags = {"scalars": set(), "images": set()}
    for d in event_dirs:
        acc = EventAccumulator(d, size_guidance={"images": 0, "scalars": 0})
        acc.Reload()
        tags["scalars"] |= set(acc.Tags()["scalars"])
        tags["images"] |= set(acc.Tags()["images"])
    assert any("reward" in t for t in tags["scalars"]), tags
    assert any("ratio_mean" in t for t in tags["scalars"]), tags
    assert "samples" in tags["images"]
    run_dirs = [os.path.join(r, d) for r, ds, _ in os.walk(tmp_path / "wandb") for d in ds if d.startswith("offline-run")]
    assert run_dirs
    media = [f for r, _, fs in os.walk(run_dirs[0]) for f in fs if f.endswith(".png")]
    assert media, "no image reached the wandb run"
    wandb_files = [os.path.join(r, f) for r, _, fs in os.walk(run_dirs[0]) for f in fs if f.endswith(".wandb")]
    blob = b"".join(open(f, "rb").read() for f in wandb_files)
    assert b"ratio_mean" in blob and b"reward" in blob


def test_memory_options_8bit_adam_and_gradient_checkpointing(tiny_sd3_path, tmp_path):
    pytest.importorskip("bitsandbytes", reason="the bnb extra is not installed")
    trainer = make_trainer(tiny_sd3_path, tmp_path, optim="adamw_bnb_8bit", gradient_checkpointing=True,
                           sde_window_size=1, sde_window_range=[0, 2])
    base = trainer.accelerator.unwrap_model(trainer.model).get_base_model()
    assert base.gradient_checkpointing
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    assert type(optimizer).__module__.startswith("bitsandbytes.optim")
    assert optimizer.args.optim_bits == 8
    log = train_logs(trainer)[0]
    assert abs(log["ratio_mean"] - 1) < 1e-5
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed


def test_num_iterations_reuse_one_generation(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, num_iterations=2, max_steps=2, learning_rate=5e-2,
                           sde_window_size=2, sde_window_range=[0, 2], epsilon=1e-4, noise_level=1.0)
    rollouts = []
    original = trainer._generate
    trainer._generate = lambda inputs: (rollouts.append(len(inputs)), original(inputs))[1]
    trainer.train()
    logs = train_logs(trainer)
    assert len(rollouts) == 1  # two optimizer steps on one generation batch
    assert abs(logs[0]["ratio_mean"] - 1) < 1e-5
    assert logs[1]["approx_kl"] > 0  # the second pass is off-policy: the ratio has moved and gets clipped
    assert logs[1]["clip_frac"] > 0


@pytest.mark.parametrize("kind", ["awm", "diffusion_dpo"])
def test_launch_line_runs_the_new_trainers(tiny_sd3_path, tmp_path, kind):
    """``src/train.py recipe.yaml --trainer NAME``; offline DPO reads its pairs from a jsonl prompt file whose image
    paths are relative to the file."""
    import json

    from flowgrpo.cli import main

    prompts = ["a red circle", "a cat"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    extra = ""
    dataset = tmp_path / "prompts.txt"
    if kind == "diffusion_dpo":
        (tmp_path / "pairs" / "images").mkdir(parents=True)
        rows = []
        for i, prompt in enumerate(prompts):
            for role, colour in (("chosen", (220, 30, 30)), ("rejected", (30, 30, 220))):
                Image.fromarray(np.full((64, 64, 3), colour, np.uint8)).save(tmp_path / "pairs" / "images" / f"{i}{role}.png")
            rows.append({"prompt": prompt, "chosen": f"images/{i}chosen.png", "rejected": f"images/{i}rejected.png"})
        (tmp_path / "pairs" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        dataset, extra = tmp_path / "pairs" / "train.jsonl", "dpo_mode: offline\n"
    else:
        extra = "train_timesteps: 2\n"
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"""model_name_or_path: {tiny_sd3_path}
dtype: float32
lora_r: 4
lora_alpha: 8
lora_target_modules: [to_q, to_k]
dataset_name: {dataset}
dataset_test_split: null
reward_funcs: [jpeg_compressibility]
resolution: 64
num_inference_steps: 2
sampler: euler
max_sequence_length: 16
num_generations: 2
per_device_train_batch_size: 2
max_steps: 1
output_dir: {tmp_path / "run"}
save_strategy: "no"
report_to: none
use_cpu: true
disable_tqdm: true
log_images_steps: 0
{extra}""")
    trainer = main([str(recipe), "--trainer", kind])
    assert type(trainer).__name__ == {"awm": "AWMTrainer", "diffusion_dpo": "DiffusionDPOTrainer"}[kind]
    assert trainer.state.global_step == 1 and (tmp_path / "run" / "pytorch_lora_weights.safetensors").exists()
    if kind == "diffusion_dpo":
        assert trainer.state.log_history[0]["dpo/pairs"] == 2


def test_the_trainer_owns_its_four_parts_and_they_do_not_read_it(tiny_sd3_path, tmp_path):
    """``trainer.policy``, ``trainer.rollouts``, ``trainer.evaluator`` and ``trainer.health`` are the parts (the
    contract's names); none of them holds the trainer: they get what they need at construction."""
    from flowgrpo.trainer.evaluation import Evaluator
    from flowgrpo.trainer.health import HealthGuards
    from flowgrpo.trainer.policy import Policy
    from flowgrpo.trainer.rollout import RolloutEngine

    trainer = make_trainer(tiny_sd3_path, tmp_path, beta=0.04)
    parts = {"policy": Policy, "rollouts": RolloutEngine, "evaluator": Evaluator, "health": HealthGuards}
    for name, cls in parts.items():
        part = getattr(trainer, name)
        assert isinstance(part, cls), name
        assert all(value is not trainer for value in vars(part).values()), f"trainer.{name} holds the trainer"
    assert trainer.rollouts.policy is trainer.policy and trainer.evaluator.rollouts is trainer.rollouts
    assert trainer.policy.reference is not None and trainer.policy.reference.kind == "base"  # LoRA: adapter off
