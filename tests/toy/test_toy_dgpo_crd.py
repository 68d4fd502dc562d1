"""recipes/toy_dgpo.yaml and recipes/toy_crd.yaml through the launch script, on a training reward this project does not
ship (the images' edge energy): a short run raises it on held-out prompts beyond the evaluation's noise (the paired
change since the first evaluation, in units of its standard error)."""

from __future__ import annotations

import os

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def edge_energy(prompts, images, **columns):
    """Mean absolute difference of neighbouring pixels of the grey image (down and across), in [0, 1]: more, larger or
    more ragged objects score higher. A reward foreign to the project."""
    out = []
    for image in images:
        grey = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
        out.append(float((np.abs(np.diff(grey, axis=0)).mean() + np.abs(np.diff(grey, axis=1)).mean()) / 2))
    return out


@pytest.fixture(scope="module")
def toy_world():
    from flowgrpo.toy.build import cached_toy_world

    return cached_toy_world("full", seed=0, log=lambda message: None)


# Each run takes about 15 s on one free core (20 optimizer steps of 16 images, two evaluations of 32): the least that
# shows a trained reward beyond the evaluation's noise.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["toy_dgpo.yaml", "toy_crd.yaml"])
def test_toy_recipe_raises_a_reward_it_has_never_seen(recipe, toy_world, tmp_path, monkeypatch):
    from flowgrpo.cli.train import main
    from flowgrpo.toy.build import read_prompts

    monkeypatch.chdir(REPO)
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text("\n".join(read_prompts(toy_world, "eval")[::5]) + "\n")  # 9 held-out prompts
    trainer = main([f"recipes/{recipe}", "--model_name_or_path", str(toy_world),
                    "--dataset_name", str(toy_world / "prompts_train.txt"), "--eval_dataset_name", str(eval_file),
                    "--reward_funcs", "test_toy_dgpo_crd:edge_energy", "--output_dir", str(tmp_path / "out"),
                    "--max_steps", "20", "--per_device_train_batch_size", "16", "--eval_strategy", "no",
                    "--eval_on_start", "true", "--eval_images_per_prompt", "4", "--eval_guidance_scales", "1.0",
                    "--per_device_eval_batch_size", "36", "--disable_tqdm", "true"])
    evals = [h for h in trainer.state.log_history if "eval_rewards/edge_energy/mean" in h]
    assert len(evals) == 2  # before training and the launch script's final evaluation
    last = evals[-1]
    assert last["eval_rewards/edge_energy/change"] > 2 * last["eval_rewards/edge_energy/change_se"] > 0
    train = [h["reward"] for h in trainer.state.log_history if "reward" in h and "loss" in h]
    assert np.mean(train[-5:]) > np.mean(train[:5])
