"""recipes/toy_hacking.yaml through the launch script, on a training reward this project does not ship, with the toy
world's shape and colour checks as gold: the exported LoRA is the best evaluation's and the hacking alarm follows
its rule on the run's own trajectories."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def saturation_reward(prompts, images, **columns):
    """Mean colour saturation (max - min channel): a reward foreign to the project, and hackable."""
    out = []
    for image in images:
        a = np.asarray(image, dtype=np.float32) / 255.0
        out.append(float((a.max(axis=2) - a.min(axis=2)).mean()))
    return out


@pytest.fixture(scope="module")
def toy_world():
    from flowgrpo.toy.build import cached_toy_world

    return cached_toy_world("full", seed=0, log=lambda message: None)


def test_toy_hacking_recipe_exports_the_best_and_rings_the_alarm_by_its_rule(toy_world, tmp_path, monkeypatch):
    from flowgrpo.cli.train import main
    from flowgrpo.toy.build import read_prompts
    from flowgrpo.trainer.health import HackingAlarm

    monkeypatch.chdir(REPO)
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("\n".join(read_prompts(toy_world, "eval")[:4]) + "\n")
    out = tmp_path / "out"
    trainer = main(["recipes/toy_hacking.yaml", "--model_name_or_path", str(toy_world),
                    "--dataset_name", str(toy_world / "prompts_train.txt"), "--eval_dataset_name", str(eval_file),
                    "--reward_funcs", "test_health_toy:saturation_reward", "--output_dir", str(out),
                    "--max_steps", "2", "--eval_steps", "1", "--save_steps", "1", "--save_total_limit", "1",
                    "--per_device_train_batch_size", "16", "--eval_images_per_prompt", "1",
                    "--eval_num_inference_steps", "8", "--learning_rate", "3e-3", "--hacking_tolerance", "0.0",
                    "--disable_tqdm", "true"])
    history = trainer.state.log_history
    evals = [h for h in history if "eval_rewards/toy_shape/mean" in h]
    assert len(evals) == 4  # on start, after steps 1-2, and the launch script's final one (the exported weights)
    assert all("eval_rewards/toy_color/mean" in h and "health/hacking_alarm" in h for h in evals)
    during = evals[1:3]
    shape = [h["eval_rewards/toy_shape/mean"] for h in during]
    best_step = 1 + int(np.argmax(shape))  # the first best, as transformers' strict comparison keeps
    assert trainer.state.best_global_step == best_step
    assert trainer.state.best_model_checkpoint == str(out / f"checkpoint-{best_step}")
    assert evals[-1]["eval_rewards/toy_shape/mean"] == pytest.approx(max(shape))
    exported = load_file(out / "pytorch_lora_weights.safetensors")
    at_best = load_file(out / f"checkpoint-{best_step}" / "pytorch_lora_weights.safetensors")
    torch.testing.assert_close(exported, at_best)
    # The alarm replayed from the logged trajectories (training reward per step, gold means per evaluation).
    alarm = HackingAlarm(0.0)
    train = {round(h["step"]): h["reward"] for h in history if "reward" in h and "loss" in h}
    expected = [alarm.update(0, {"toy_shape": evals[0]["eval_rewards/toy_shape/mean"],
                                 "toy_color": evals[0]["eval_rewards/toy_color/mean"]}).fired]
    for step, h in enumerate(during, start=1):
        alarm.observe_train_reward(step, train[step])
        expected.append(alarm.update(step, {g: h[f"eval_rewards/{g}/mean"] for g in ("toy_shape", "toy_color")}).fired)
    assert [bool(h["health/hacking_alarm"]) for h in evals[:3]] == expected
    assert "## Best evaluation" in (out / "README.md").read_text()
