"""Model card and Hub uploads, offline.

The Hub API is replaced by a stand-in that patches ``huggingface_hub.HfApi.create_repo`` / ``upload_folder`` (the
methods ``transformers.Trainer`` calls) and records a snapshot of every file that would be uploaded. Nothing leaves
the machine; the production path calls ``huggingface_hub`` unchanged.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import Dataset
from huggingface_hub import ModelCard
from peft import LoraConfig
from PIL import Image

from flowgrpo.trainer.outputs.hub import (
    copy_checkpoint_exports,
    describe_upload,
    files_for_upload,
    write_card_images,
)
from flowgrpo.trainer.outputs.lora_export import LORA_WEIGHTS_NAME
from flowgrpo.trainer.outputs.model_card import CardSample, card_tag, is_hub_id, render_model_card


def brightness(prompts, images, **columns):
    return [float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


class HubStandIn:
    """Records what ``HfApi`` would do. ``uploads`` holds one dict per ``upload_folder`` call with a snapshot
    folder of exactly the files that would have been sent."""

    def __init__(self, snapshot_root: Path):
        self.snapshot_root = snapshot_root
        self.repos: list[dict] = []
        self.uploads: list[dict] = []

    def install(self, monkeypatch):
        import huggingface_hub

        stand_in = self

        def create_repo(api, repo_id, *args, **kwargs):
            stand_in.repos.append({"repo_id": repo_id, **kwargs})
            return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"someone/{repo_id}",
                                   url=f"https://huggingface.co/{repo_id}")

        def upload_folder(api, *, repo_id, folder_path, path_in_repo=None, commit_message=None, ignore_patterns=None,
                          allow_patterns=None, run_as_future=False, **kwargs):
            files = files_for_upload(folder_path, ignore_patterns or (), allow_patterns)
            snapshot = stand_in.snapshot_root / f"upload-{len(stand_in.uploads)}"
            for rel in files:
                (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(folder_path, rel), snapshot / rel)
            stand_in.uploads.append({"repo_id": repo_id, "path_in_repo": path_in_repo, "files": files,
                                     "snapshot": snapshot, "commit_message": commit_message})
            info = SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0", oid="0")
            if run_as_future:
                future = Future()
                future.set_result(info)
                return future
            return info

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        for name in ("create_commit", "upload_file", "preupload_lfs_files"):
            def refuse(api, *args, _name=name, **kwargs):
                raise AssertionError(f"unexpected Hub call HfApi.{_name}")

            monkeypatch.setattr(huggingface_hub.HfApi, name, refuse)
        return self


# ---------------------------------------------------------------------------------------------------------------------
# model card
# ---------------------------------------------------------------------------------------------------------------------


def test_model_card_metadata_snippet_and_samples():
    text = render_model_card(
        repo_id="me/sd35m-ocr", base_model="stabilityai/stable-diffusion-3.5-medium", rewards=["ocr"],
        tags=["flow-grpo", "lora", "text-to-image", "diffusers", "ocr", "lora"], dataset_name="me/ocr-prompts",
        extra_sections="## Training setup\n\n- group size 8", paper={"title": "Flow-GRPO", "id": "2505.05470",
                                                                     "citation": "@article{x}"},
        samples=[CardSample("images/sample_0.png", 'a sign that says "hi" | x', 0.75)],
        contact_sheet="eval_step_10.png", metrics={"eval_reward": 0.5, "eval_rewards/ocr/mean": 0.5},
    )
    card = ModelCard(text)
    assert card.data.library_name == "diffusers"
    assert card.data.base_model == "stabilityai/stable-diffusion-3.5-medium"
    assert card.data.pipeline_tag == "text-to-image"
    assert card.data.tags == ["flow-grpo", "lora", "text-to-image", "diffusers", "ocr"]  # de-duplicated
    assert card.data.datasets == ["me/ocr-prompts"]
    assert card.data.widget == [{"text": 'a sign that says "hi" | x', "output": {"url": "images/sample_0.png"}}]
    body = card.text
    assert 'pipe.load_lora_weights("me/sd35m-ocr")' in body
    assert 'DiffusionPipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium"' in body
    assert "## Training setup" in body and "group size 8" in body
    assert "eval_reward: 0.5000" in body  # metrics rendered: the extra sections have no evaluation section
    assert "![sample 0](images/sample_0.png)" in body and "\\|" in body and "0.7500" in body
    assert "eval_step_10.png" in body and "@article{x}" in body


def test_model_card_local_base_model_and_full_finetune():
    text = render_model_card(repo_id="/tmp/run", base_model="/tmp/tiny-sd3", rewards=["pkg.mod:score"],
                             tags=["flow-grpo"], is_lora=False,
                             extra_sections="## Evaluation (last run)\n\n- eval_reward: 1", metrics={"eval_reward": 1})
    card = ModelCard(text)
    assert card.data.base_model is None  # a local path is not valid Hub metadata
    assert "`/tmp/tiny-sd3`" in card.text
    assert 'subfolder="transformer"' in card.text and "load_lora_weights" not in card.text
    assert card.text.count("eval_reward") == 1  # the trainer's own evaluation section is not repeated
    assert is_hub_id("user/model") and is_hub_id("model") and not is_hub_id("./x") and not is_hub_id("/a/b")
    assert card_tag("pkg.mod:Score Fn") == "pkg.mod-score-fn"


def test_card_images_and_checkpoint_exports(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    sheet = tmp_path / "elsewhere.png"
    Image.new("RGB", (8, 8), "red").save(sheet)
    last_eval = {"metrics": {"eval_reward": 0.1}, "contact_sheet": str(sheet),
                 "samples": [(f"p{i}", Image.new("RGB", (16, 16), "blue"), 0.1 * i) for i in range(10)]}
    samples, sheet_rel = write_card_images(out, last_eval, max_images=3)
    assert [s.image for s in samples] == [f"images/sample_{i}.png" for i in range(3)]
    assert sheet_rel == "images/elsewhere.png" and (out / sheet_rel).is_file()
    assert write_card_images(out, None) == ([], None)

    ckpt = tmp_path / "checkpoint-3"
    (ckpt / "transformer").mkdir(parents=True)
    (ckpt / LORA_WEIGHTS_NAME).write_bytes(b"lora")
    (ckpt / "transformer" / "config.json").write_text("{}")
    (ckpt / "optimizer.pt").write_bytes(b"x")
    assert copy_checkpoint_exports(ckpt, out) == [LORA_WEIGHTS_NAME, "transformer/"]
    (out / "README.md").write_text("card")
    (out / "_private").write_text("x")
    (out / "checkpoint-3").mkdir()
    (out / "checkpoint-3" / "x.bin").write_text("x")
    summary = describe_upload(out)
    assert summary["lora"] and summary["transformer"] and summary["model_card"]
    assert "optimizer.pt" not in summary["files"] and "_private" not in summary["files"]
    assert not any(f.startswith("checkpoint-") for f in summary["files"])
    assert len(summary["images"]) == 4


# ---------------------------------------------------------------------------------------------------------------------
# trainer uploads through the stand-in
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_push_to_hub_and_every_save_upload_diffusers_lora_and_card(tiny_sd3_path, tmp_path, monkeypatch):
    from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer

    hub = HubStandIn(tmp_path / "hub").install(monkeypatch)
    args = FlowGRPOConfig(
        output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=2, num_generations=2,
        resolution=32, num_inference_steps=2, eval_num_inference_steps=2, guidance_scale=1.0, max_steps=2,
        learning_rate=1e-2, beta=0.0, max_sequence_length=8, save_strategy="steps", save_steps=1,
        disable_tqdm=True, log_images_steps=0, dtype="float32", per_device_eval_batch_size=2,
        push_to_hub=True, hub_model_id="me/tiny-flow-grpo", hub_strategy="every_save", hub_always_push=True,
    )
    prompts = ['a sign that says "hi"', "a red circle", "a cat", "a dog"]
    trainer = FlowGRPOTrainer(
        model=str(tiny_sd3_path), reward_funcs=brightness, args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}), eval_dataset=Dataset.from_dict({"prompt": prompts[:2]}),
        peft_config=LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian",
                               target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
    )
    assert hub.repos and hub.repos[0]["repo_id"] == "me/tiny-flow-grpo"
    trainer.train()

    # every_save: one upload per checkpoint, each with the diffusers LoRA and a card
    checkpoint_pushes = [u for u in hub.uploads if u["commit_message"].startswith("Training in progress")]
    assert len(checkpoint_pushes) == 2
    for upload in checkpoint_pushes:
        assert upload["repo_id"] == "me/tiny-flow-grpo"
        assert LORA_WEIGHTS_NAME in upload["files"] and "README.md" in upload["files"]
        assert not any(f.startswith("checkpoint-") for f in upload["files"])

    trainer.evaluate()
    trainer.push_to_hub(dataset_name="me/prompts")
    final = hub.uploads[-1]
    assert final["commit_message"] == "End of training"
    assert {LORA_WEIGHTS_NAME, "README.md", "images/sample_0.png", "images/sample_1.png"} <= set(final["files"])
    assert any(f.startswith("eval_step_") for f in final["files"])

    card = ModelCard((final["snapshot"] / "README.md").read_text())
    assert card.data.library_name == "diffusers"
    assert {"flow-grpo", "lora", "text-to-image", "brightness"} <= set(card.data.tags)
    assert card.data.datasets == ["me/prompts"]
    assert 'pipe.load_lora_weights("me/tiny-flow-grpo")' in card.text
    assert str(tiny_sd3_path) in card.text  # the base model (a local folder here)
    assert "Training setup" in card.text and "eval_reward" in card.text
    assert "images/sample_0.png" in card.text and len(card.data.widget) == 2

    # the uploaded LoRA is what a user's pipeline loads: non-zero B matrices after training, output changes
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    lora = load_file(final["snapshot"] / LORA_WEIGHTS_NAME)
    assert all(k.startswith("transformer.") for k in lora)
    assert any(float(t.abs().max()) > 0 for k, t in lora.items() if "lora_B" in k)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_path))
    kwargs = dict(prompt="a cat", num_inference_steps=2, height=32, width=32, guidance_scale=1.0,
                  max_sequence_length=8, output_type="np")
    before = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(final["snapshot"]))
    after = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert np.abs(after - before).max() > 0
