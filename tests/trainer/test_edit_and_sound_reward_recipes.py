"""The reward settings of recipes/qwenimage_edit_editreward.yaml, recipes/kontext_edit_editreward.yaml and
recipes/ltx2_t2v.yaml train on the tiny Qwen-Image-Edit, FLUX.1 Kontext and LTX-2 pipelines on a CPU, with the tiny
EditReward, CLAP and PickScore checkpoints built offline in place of the hub ones (the only change to the recipes'
reward settings; EditReward's images are also resized to 56 x 56 instead of 448 x 448 to keep the tiny run short)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from datasets import Dataset
from peft import LoraConfig
from support.family_cases import CASES, config_kwargs, dataset_rows

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.testing.tiny_clap import save_tiny_clap
from flowgrpo.testing.tiny_editreward import save_tiny_editreward

REPO = Path(__file__).resolve().parents[2]
CASE = {c.name: c for c in CASES}


def _recipe(name):
    return yaml.safe_load((REPO / "recipes" / name).read_text())


def _tiny_pickscore(folder):
    """A tiny random CLIP saved as a PickScore model folder (model, tokenizer, image processor)."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from flowgrpo.testing.tiny_tokenizers import build_clip_tokenizer

    tokenizer = build_clip_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, eos_token_id=eos, pad_token_id=eos,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|startoftext|>")),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(folder)
    return str(folder)


def _train(case, pipeline, rewards, tmp_path, rows=None):
    """One step of Flow-GRPO on ``case``'s tiny pipeline with the recipe's reward settings ``rewards``."""
    rows = rows or dataset_rows(case)
    settings = {k: v for k, v in rewards.items() if k != "reward_funcs"}
    args = FlowGRPOConfig(output_dir=str(tmp_path / "out"), **config_kwargs(case), **settings)
    trainer = FlowGRPOTrainer(model=str(pipeline), reward_funcs=rewards["reward_funcs"], args=args,
                              train_dataset=Dataset.from_dict(rows),
                              peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))
    trainer.train()
    return trainer.state.log_history


@pytest.mark.parametrize("recipe, case", [("qwenimage_edit_editreward.yaml", "qwenimage_edit"),
                                          ("kontext_edit_editreward.yaml", "flux_kontext")])
def test_editreward_recipes_train_on_their_tiny_editing_pipelines(recipe, case, tiny_pipeline_path, tmp_path):
    written = _recipe(recipe)
    assert written["reward_funcs"] == ["editreward"] and written["reward_offload"] is True
    tiny = save_tiny_editreward(tmp_path / "editreward")
    kwargs = dict(written["reward_kwargs"]["editreward"], model_name_or_path=str(tiny["checkpoint"]),
                  base_model_name_or_path=str(tiny["base"]), dtype="float32", min_pixels=56 * 56,
                  max_pixels=56 * 56)
    rewards = {"reward_funcs": written["reward_funcs"], "reward_kwargs": {"editreward": kwargs},
               "reward_offload": written["reward_offload"]}
    history = _train(CASE[case], tiny_pipeline_path(CASE[case].family), rewards, tmp_path)
    means = [h["rewards/editreward/mean"] for h in history if "rewards/editreward/mean" in h]
    assert means and all(math.isfinite(m) for m in means)
    assert any(math.isfinite(h.get("rewards/editreward/following", math.nan)) for h in history)


def test_ltx2_recipe_trains_with_clap_and_frame_pickscore(tiny_pipeline_path, tmp_path):
    written = _recipe("ltx2_t2v.yaml")
    assert written["reward_funcs"] == ["clap", "pickscore"] and written["reward_weights"] == [0.5, 0.5]
    assert written["reward_aggregation"] == "normalize_then_sum"
    clap = dict(written["reward_kwargs"]["clap"], model_name_or_path=str(save_tiny_clap(tmp_path / "clap")))
    pickscore = _tiny_pickscore(tmp_path / "pickscore")
    rewards = {"reward_funcs": written["reward_funcs"], "reward_weights": written["reward_weights"],
               "reward_aggregation": written["reward_aggregation"],
               "reward_kwargs": {"clap": clap, "pickscore": {"model_id": pickscore, "processor_id": pickscore}}}
    history = _train(CASE["ltx2"], tiny_pipeline_path("ltx2"), rewards, tmp_path)
    for name in ("clap", "pickscore"):
        means = [h[f"rewards/{name}/mean"] for h in history if f"rewards/{name}/mean" in h]
        assert means and all(math.isfinite(m) for m in means), name
