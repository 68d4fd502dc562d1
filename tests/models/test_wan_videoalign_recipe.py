"""recipes/wan_t2v_videoalign.yaml's reward and objective settings, trained for two steps on the tiny Wan 2.1 pipeline
with the tiny VideoReward checkpoint (flowgrpo.testing): the reward receives whole videos (5 frames of 32x32 through
the MP4 round trip at 8 fps), its dimensions are logged, and the policy's LoRA moves. The sizes (resolution, frames,
steps, batch) are the test's; everything the recipe says about the reward and the objective is the recipe's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from peft import LoraConfig
from support.family_cases import CASES, config_kwargs, dataset_rows

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.testing.tiny_videoreward import cached_tiny_videoreward_path

REPO = Path(__file__).resolve().parents[2]
WAN = next(c for c in CASES if c.name == "wan")
#: the recipe's keys that shape the reward and the objective (the rest sizes a GPU run)
RECIPE_KEYS = ("reward_funcs", "reward_kwargs", "noise_level", "sde_type", "beta", "epsilon", "adv_clip_max",
               "scale_rewards", "guidance_scale", "negative_prompt", "num_generations")


def test_wan_videoalign_recipe_trains_two_steps_on_the_tiny_pipeline(tiny_pipeline_path, tmp_path):
    recipe = yaml.safe_load((REPO / "recipes" / "wan_t2v_videoalign.yaml").read_text())
    settings = {key: recipe[key] for key in RECIPE_KEYS}
    assert settings["reward_funcs"] == ["videoalign"]
    tiny = cached_tiny_videoreward_path()
    settings["reward_kwargs"] = {"videoalign": {**recipe["reward_kwargs"]["videoalign"],
                                                "model_name_or_path": str(tiny / "videoreward"),
                                                "base_model_name_or_path": str(tiny / "base"),
                                                "device": "cpu", "dtype": "float32"}}
    args = FlowGRPOConfig(output_dir=str(tmp_path / "out"), **config_kwargs(
        WAN, **{k: v for k, v in settings.items() if k != "reward_funcs"}, max_steps=2, sde_window_size=1,
        sde_window_range=[0, 2]))
    trainer = FlowGRPOTrainer(model=str(tiny_pipeline_path("wan")), reward_funcs=settings["reward_funcs"], args=args,
                              train_dataset=Dataset.from_dict(dataset_rows(WAN)),
                              peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/videoalign/mean" in h]
    assert len(logs) == 2
    for log in logs:
        for key in ("rewards/videoalign/mean", "rewards/videoalign/VQ", "rewards/videoalign/MQ",
                    "rewards/videoalign/TA", "rewards/videoalign/Overall"):
            assert key in log and torch.isfinite(torch.tensor(log[key])), key
        # Overall (the recipe's dimension) is the sum of the three normalised dimensions
        assert log["rewards/videoalign/mean"] == pytest.approx(log["rewards/videoalign/Overall"], rel=1e-5)
        assert log["rewards/videoalign/Overall"] == pytest.approx(
            log["rewards/videoalign/VQ"] + log["rewards/videoalign/MQ"] + log["rewards/videoalign/TA"], rel=1e-5)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[k], after[k].detach()) for k in before)
