"""The newer model families on their tiny offline pipelines: Qwen-Image, Wan 2.1 and Wan 2.2 A14B (two experts),
FLUX.1 Kontext and Qwen-Image-Edit.

What must hold for each: the trainer's ODE sampling through the family adapter reproduces the stock diffusers pipeline
(same seed, sigmas / shift / dynamic shift, guidance form, latent packing, source-image encoding and decoding); the
first pass over a rollout is on-policy (ratio exactly 1, KL 0); resuming from a checkpoint gives exactly the
uninterrupted run; the exported LoRA loads with the family's own ``load_lora_weights`` (both experts of Wan 2.2) and
changes the output; two optimizer steps on two ranks under ``accelerate_configs/cpu_ddp.yaml`` (four launches
balanced by cost, `launch_plan`: ``families_ddp_worker.py``), of Flow-GRPO and of the trainers of ``FURTHER_TRAINERS`` (DGPO, CRD, and the
reward-gradient trainer on two of them). SD3 and FLUX are covered by test_trainer.py and test_distributed.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline
from peft import LoraConfig
from PIL import Image
from support.family_cases import (
    CASE_IDS,
    CASES,
    SIZE,
    FamilyCase,
    brightness_reward,
    config_kwargs,
    dataset_rows,
    source_image,
)

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.models import WanAdapter
from flowgrpo.models.wan import WAN_LORA_TARGET_MODULES
from flowgrpo.trainer.outputs.lora_export import EXPERT_LORA_WEIGHTS_NAMES, LORA_WEIGHTS_NAME

REPO = Path(__file__).resolve().parents[2]
CASE_BY_NAME = {c.name: c for c in CASES}


def make_trainer(path, case: FamilyCase, output_dir, reward=brightness_reward, dataset=None, peft_config=None,
                 **overrides):
    args = FlowGRPOConfig(output_dir=str(output_dir), **config_kwargs(case, **overrides))
    return FlowGRPOTrainer(model=str(path), reward_funcs=reward, args=args,
                           train_dataset=Dataset.from_dict(dataset or dataset_rows(case)),
                           peft_config=peft_config or LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))


def stock_call(pipe, case: FamilyCase, prompts, images, output_type, monkeypatch, steps=3):
    """The stock pipeline's own call with the trainer's settings (noise from ``manual_seed(0)``)."""
    kwargs = dict(prompt=list(prompts), height=SIZE, width=SIZE, num_inference_steps=steps, output_type=output_type,
                  generator=torch.Generator().manual_seed(0), max_sequence_length=case.max_sequence_length)
    negative = [""] * len(prompts)
    if case.family == "sd3":
        kwargs.update(guidance_scale=case.guidance_scale, negative_prompt=negative)
    if case.family == "flux":
        kwargs.update(guidance_scale=case.guidance_scale)
    if case.family in ("qwenimage", "qwenimage_edit", "qwenimage_edit_plus", "qwenimage21"):
        kwargs.update(true_cfg_scale=case.guidance_scale, negative_prompt=negative)
    if case.family == "qwenimage21":  # no max_sequence_length argument; the configured sample_sigmas set the steps
        kwargs.pop("max_sequence_length")
    if case.family == "wan":
        kwargs.update(guidance_scale=case.guidance_scale, negative_prompt=negative, num_frames=case.num_frames)
    if case.family == "flux_kontext":  # keep the source at its own (working) size, as the adapter encodes it
        kwargs.update(image=list(images), guidance_scale=case.guidance_scale, max_area=SIZE * SIZE,
                      _auto_resize=False)
    if case.family == "qwenimage_edit":
        # The stock edit pipeline always resizes the source to about 1024^2; the adapter encodes it at the working
        # size by design. Give the stock pipeline's size rule the working size so both encode the same pixels.
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module

        monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (SIZE, SIZE, None))
        kwargs.update(image=list(images))
    if case.family == "qwenimage_edit_plus":
        return _edit_plus_stock_call_per_row(pipe, case, kwargs, images, monkeypatch)
    if case.family == "wan_i2v":
        kwargs.update(guidance_scale=case.guidance_scale, num_frames=case.num_frames)
        return _wan_i2v_stock_call_per_row(pipe, kwargs, images)
    if case.family == "hunyuanvideo15":  # its guider carries the guidance scale; its VAE decodes one video per call
        from diffusers.guiders import ClassifierFreeGuidance

        pipe.guider = ClassifierFreeGuidance(guidance_scale=case.guidance_scale)
        kwargs.pop("max_sequence_length")
        kwargs.update(negative_prompt=negative, num_frames=case.num_frames)
        if output_type != "latent":
            return _hunyuanvideo15_stock_call_per_row(pipe, kwargs)
    if case.family == "ltx2":  # CFG only (no spatio-temporal / modality guidance, no rescale), the same on the audio
        kwargs.update(guidance_scale=case.guidance_scale, negative_prompt=negative, num_frames=case.num_frames,
                      frame_rate=24.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0,
                      audio_guidance_scale=case.guidance_scale, audio_stg_scale=0.0, audio_modality_scale=1.0,
                      audio_guidance_rescale=0.0)
    if case.family in ("flux2", "flux2_klein", "zimage"):
        kwargs.update(guidance_scale=case.guidance_scale)
    if case.family in ("flux2", "flux2_klein") and images is not None:
        return _flux2_stock_call_per_row(pipe, kwargs, images, monkeypatch)
    out = pipe(**kwargs)
    return out.frames if case.video else out.images


def _edit_plus_stock_call_per_row(pipe, case, kwargs, images, monkeypatch):
    """Qwen-Image-Edit-Plus: the stock pipeline takes one prompt (with its source images) per call; each row is its own
    call on its share of the batch's noise. Its size rule is given the working size, as for Qwen-Image-Edit."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module
    from diffusers.utils.torch_utils import randn_tensor

    monkeypatch.setattr(plus_module, "calculate_dimensions", lambda area, ratio: (SIZE, SIZE))
    prompts, generator = kwargs.pop("prompt"), kwargs.pop("generator")
    kwargs.pop("negative_prompt")
    side = 2 * (SIZE // (pipe.vae_scale_factor * 2))
    channels = pipe.transformer.config.in_channels // 4
    noise = randn_tensor((len(prompts), 1, channels, side, side), generator=generator)
    outs = []
    for i, (prompt, row) in enumerate(zip(prompts, images)):
        packed = pipe._pack_latents(noise[i:i + 1], 1, channels, side, side)
        outs.append(pipe(prompt=[prompt], image=list(row), negative_prompt=[""], latents=packed, **kwargs).images)
    return np.concatenate(outs) if isinstance(outs[0], np.ndarray) else torch.cat(outs)


def _flux2_stock_call_per_row(pipe, kwargs, images, monkeypatch):
    """FLUX.2 with reference images: the stock pipeline gives every prompt of a call the same references, so each row
    is its own call, on its share of the batch's noise (drawn as one batch, as the adapter draws it)."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    from diffusers.utils.torch_utils import randn_tensor

    # The stock check wants references of 64 px or more; the tiny run's references are the working size (32 px).
    monkeypatch.setattr(Flux2ImageProcessor, "check_image_input", staticmethod(lambda image, *a, **k: image))
    prompts, generator = kwargs.pop("prompt"), kwargs.pop("generator")
    side = SIZE // (pipe.vae_scale_factor * 2)
    noise = randn_tensor((len(prompts), pipe.transformer.config.in_channels, side, side), generator=generator)
    outs = [pipe(prompt=[p], image=list(refs) if isinstance(refs, (list, tuple)) else [refs],
                 latents=noise[i:i + 1], **kwargs).images for i, (p, refs) in enumerate(zip(prompts, images))]
    return np.concatenate(outs) if isinstance(outs[0], np.ndarray) else torch.cat(outs)


def _hunyuanvideo15_stock_call_per_row(pipe, kwargs):
    """HunyuanVideo 1.5 decoding: this diffusers version's VAE fails on a batch of several videos, so each row is its
    own call on its share of the batch's noise."""
    from diffusers.utils.torch_utils import randn_tensor

    prompts, generator = kwargs.pop("prompt"), kwargs.pop("generator")
    kwargs.pop("negative_prompt")
    frames = (kwargs["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1
    side = SIZE // pipe.vae_scale_factor_spatial
    noise = randn_tensor((len(prompts), pipe.vae.config.latent_channels, frames, side, side), generator=generator)
    outs = [pipe(prompt=[p], negative_prompt=[""], latents=noise[i:i + 1], **kwargs).frames
            for i, p in enumerate(prompts)]
    return np.concatenate(outs) if isinstance(outs[0], np.ndarray) else torch.cat(outs)


def _wan_i2v_stock_call_per_row(pipe, kwargs, images):
    """Wan image-to-video: the stock pipeline encodes one image per call (and repeats it over the prompts), so each row
    is its own call on its share of the batch's noise (drawn as one batch, as the adapter draws it)."""
    from diffusers.utils.torch_utils import randn_tensor

    prompts, generator = kwargs.pop("prompt"), kwargs.pop("generator")
    frames = (kwargs["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1
    side = SIZE // pipe.vae_scale_factor_spatial
    noise = randn_tensor((len(prompts), pipe.vae.config.z_dim, frames, side, side), generator=generator)
    outs = [pipe(prompt=[p], image=image, negative_prompt=[""], latents=noise[i:i + 1], **kwargs).frames
            for i, (p, image) in enumerate(zip(prompts, images))]
    return np.concatenate(outs) if isinstance(outs[0], np.ndarray) else torch.cat(outs)


def lora_params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}


def train_logs(trainer):
    return [h for h in trainer.state.log_history if "ratio_mean" in h]


# --- sampling equals the stock pipeline; the first pass is on-policy ----------------------------------------------


def assert_sampling_matches_stock(trainer, case: FamilyCase, path, monkeypatch) -> torch.Tensor:
    """The trainer's ODE sampling (noise level 0) through the adapter, then its decoding, equal the stock pipeline's
    call with the same seed: latents and pixels. Returns the decoded pixels."""
    prompts = dataset_rows(case)["prompt"]
    images = dataset_rows(case).get("image")
    stock = DiffusionPipeline.from_pretrained(str(path))
    stock.set_progress_bar_config(disable=True)
    with trainer.policy.generation_context() as model:
        embeds, rows = trainer.rollouts.encode_unique(prompts, images, case.guidance_scale)
        final, _ = trainer.rollouts.sample(model, embeds.index_select(rows), 3, case.guidance_scale, 0.0, (0, 0),
                                   torch.Generator().manual_seed(0), record=False)
        pixels = trainer.adapter.decode(final, SIZE, SIZE)
    ref_latents = stock_call(stock, case, prompts, images, "latent", monkeypatch)
    ref_pixels = stock_call(stock, case, prompts, images, "pt", monkeypatch)
    if case.family == "ltx2":  # the state holds video and audio tokens; the stock latents are the video's
        final = trainer.adapter.unpack_video_latents(final, SIZE, SIZE)
    if case.family == "flux2_klein":  # its "latent" output is unpacked, denormalised and unpatchified
        final = trainer.adapter.unpack_latents(final, SIZE, SIZE)
    if case.family == "qwenimage21":  # the VAE decodes RGBA; the adapter hands the rewards RGB
        ref_pixels = ref_pixels[:, :3]
    assert final.shape == ref_latents.shape and pixels.shape == ref_pixels.shape
    torch.testing.assert_close(final, ref_latents.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pixels, ref_pixels.float(), rtol=1e-4, atol=1e-4)
    return pixels


@pytest.mark.parametrize("case", [FamilyCase("sd3", "sd3"), FamilyCase("flux", "flux", guidance_scale=3.5)],
                         ids=["sd3", "flux"])
def test_sampling_matches_stock_pipeline_sd3_and_flux(case, tiny_pipeline_path, tmp_path, monkeypatch):
    """The families that came first, held to the same check (SD3: CFG with a negative prompt; FLUX: embedded)."""
    path = tiny_pipeline_path(case.family)
    assert_sampling_matches_stock(make_trainer(path, case, tmp_path / "out"), case, path, monkeypatch)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_sampling_matches_stock_pipeline_and_first_pass_is_on_policy(case, tiny_pipeline_path, tmp_path,
                                                                     monkeypatch):
    path = tiny_pipeline_path(case.family, case.variant)
    seen: dict[str, list] = {"frames": [], "videos": [], "sources": []}

    def image_reward(prompts, images, **columns):
        seen["frames"].append(len(images))
        if "image" in columns:
            seen["sources"].extend(columns["image"])
        return brightness_reward(prompts, images)

    def video_reward(prompts, videos, **columns):
        seen["videos"].extend(len(v) for v in videos)
        return [float(np.mean([np.asarray(f, dtype=np.float32).mean() for f in v]) / 255) for v in videos]

    video_reward.accepts_video = True
    rewards = [image_reward, video_reward] if case.video else image_reward
    # No target modules: the trainer takes the family's default (Wan: attn1 / attn2).
    trainer = make_trainer(path, case, tmp_path / "out", reward=rewards, beta=0.04,
                           peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))
    targets = trainer.accelerator.unwrap_model(trainer.model).peft_config["default"].target_modules
    assert set(targets) == set(trainer.adapter.default_lora_target_modules)
    # the model card's task: FLUX.2's reference images are optional (image-to-image only with an image column)
    assert trainer._card_pipeline_tag == (("image-to-video" if case.edits else "text-to-video") if case.video else
                                          "image-to-image" if case.edits else "text-to-image")
    if case.family == "wan":
        assert set(targets) == set(WAN_LORA_TARGET_MODULES)
    if case.family == "wan_i2v":  # Wan 2.1 I2V: the image tokens' keys and values too
        assert set(targets) == set(WAN_LORA_TARGET_MODULES) | {"attn2.add_k_proj", "attn2.add_v_proj"}

    pixels = assert_sampling_matches_stock(trainer, case, path, monkeypatch)
    if case.video:
        assert pixels.shape == (4, case.num_frames, 3, SIZE, SIZE)

    before = lora_params(trainer.accelerator.unwrap_model(trainer.model))
    trainer.train()
    log = train_logs(trainer)[0]
    assert log["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert log["on_policy_ratio_max_dev"] < 1e-5
    assert log["kl"] == pytest.approx(0.0, abs=1e-10)
    after = lora_params(trainer.accelerator.unwrap_model(trainer.model))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed
    if case.variant == "two_experts":  # each expert took its own steps and was trained on them
        assert any(n.startswith("base_model.model.transformer.") for n in changed)
        assert any(n.startswith("base_model.model.transformer_2.") for n in changed)
    if case.video:  # image rewards score every frame, a video reward gets the videos
        assert seen["frames"] == [4 * case.num_frames] and seen["videos"] == [case.num_frames] * 4
        assert "rewards/video_reward/mean" in log
    if case.edits:  # the rewards see the source images, as PIL images (a list per row where rows hold several)
        def flat(values):
            return [im for v in values for im in (v if isinstance(v, list) else [v])]

        rows = 4 * (case.num_frames if case.video else 1)  # an image reward gets a video's columns per frame
        assert len(seen["sources"]) == rows and len(flat(seen["sources"])) == rows * case.images_per_row
        assert all(isinstance(s, Image.Image) for s in flat(seen["sources"]))
        assert {s.tobytes() for s in flat(seen["sources"])} <= {im.tobytes() for im in flat(dataset_rows(case)["image"])}

    metrics = trainer.evaluate(Dataset.from_dict(dataset_rows(case, 2)))
    assert np.isfinite(metrics["eval_reward"])
    sheet = Image.open(tmp_path / "out" / "eval_step_1.png")
    assert sheet.width == 2 * 192 * (3 if case.video else 1)  # videos: first, middle and last frame


def test_each_distinct_prompt_and_source_image_is_encoded_once(tiny_pipeline_path, tmp_path):
    case = CASE_BY_NAME["qwenimage_edit"]
    a, b = source_image(0), source_image(1)
    b.save(tmp_path / "b.png")
    # Two rows with one prompt and two images, then one more prompt: three distinct pairs, each sampled twice. The
    # image column mixes PIL images and a path (read by the trainer).
    data = {"prompt": ["make it red", "make it red", "add a star"], "image": [a, str(tmp_path / "b.png"), a]}
    trainer = make_trainer(tiny_pipeline_path(case.family), case, tmp_path / "out", dataset=data,
                           per_device_train_batch_size=6, num_generations=2)
    calls = []
    original = trainer.adapter.encode_prompts
    trainer.adapter.encode_prompts = lambda prompts, *args, **kw: (calls.append((list(prompts), kw.get("images"))),
                                                                   original(prompts, *args, **kw))[1]
    trainer.train()
    conditional = [c for c in calls if c[0] != [""] * len(c[0])]
    negative = [c for c in calls if c[0] == [""] * len(c[0])]
    assert len(conditional) == 1 and sorted(conditional[0][0]) == ["add a star", "make it red", "make it red"]
    keys = {(p, im.tobytes()) for p, im in zip(*conditional[0])}
    assert len(keys) == 3 and b.tobytes() in {im.tobytes() for im in conditional[0][1]}
    # Qwen-Image-Edit's negative embedding depends on the image, and its text is the same negative prompt for every
    # pair: encoded once per distinct source image (a and b), not once per pair.
    assert len(negative) == 1 and len(negative[0][0]) == 2
    assert {im.tobytes() for im in negative[0][1]} == {a.tobytes(), b.tobytes()}


# --- resume and LoRA export -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_resume_is_exact_and_lora_export_loads_in_stock_pipeline(case, tiny_pipeline_path, tmp_path, monkeypatch):
    path = tiny_pipeline_path(case.family, case.variant)
    common = dict(max_steps=2, save_strategy="steps", save_steps=1, learning_rate=5e-2, noise_level=1.0,
                  per_device_train_batch_size=2, num_generations=2, guidance_scale=1.0 if case.family != "flux_kontext"
                  else case.guidance_scale)
    straight = make_trainer(path, case, tmp_path / "a", **common)
    straight.train()  # checkpoint-1 is written on the way
    resumed = make_trainer(path, case, tmp_path / "b", **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    a, b = train_logs(straight), train_logs(resumed)
    assert [round(x["step"]) for x in b] == [1, 2]
    for key in ("reward", "policy_loss", "ratio_mean", "grad_norm"):
        assert a[1][key] == pytest.approx(b[1][key], rel=1e-5, abs=1e-7), key
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q)

    export = tmp_path / "a" / "checkpoint-2"
    assert (export / LORA_WEIGHTS_NAME).is_file()
    stock = DiffusionPipeline.from_pretrained(str(path))
    stock.set_progress_bar_config(disable=True)
    rows = dataset_rows(case, 1)
    call_case = case if case.family == "flux_kontext" else dataclasses.replace(case, guidance_scale=1.0)
    base = stock_call(stock, call_case, rows["prompt"], rows.get("image"), "np", monkeypatch, steps=2)
    if case.family == "hunyuanvideo15":  # no pipeline-level LoRA loader in this diffusers version
        stock.transformer.load_lora_adapter(str(export), prefix="transformer", weight_name=LORA_WEIGHTS_NAME)
    else:
        stock.load_lora_weights(str(export))  # the family's own loader
    tuned = stock_call(stock, call_case, rows["prompt"], rows.get("image"), "np", monkeypatch, steps=2)
    assert np.abs(tuned - base).max() > 0
    trained = lora_params(straight.accelerator.unwrap_model(straight.model))
    expert = "transformer." if case.variant == "two_experts" else ""
    for name, value in lora_params(stock.transformer).items():  # the loaded weights are the trained ones
        key = "base_model.model." + expert + name.replace(".default_0.", ".default.")
        torch.testing.assert_close(value, trained[key], msg=name)
    if case.variant == "two_experts":
        second = EXPERT_LORA_WEIGHTS_NAMES["transformer_2"]
        assert (export / second).is_file()
        stock.load_lora_weights(str(export), weight_name=second, load_into_transformer_2=True)
        both = stock_call(stock, call_case, rows["prompt"], rows.get("image"), "np", monkeypatch, steps=2)
        assert np.abs(both - tuned).max() > 0
        for name, value in lora_params(stock.transformer_2).items():
            key = "base_model.model.transformer_2." + name.replace(".default_0.", ".default.")
            torch.testing.assert_close(value, trained[key], msg=name)


# --- video logging --------------------------------------------------------------------------------------------------


def test_video_samples_reach_tensorboard_and_wandb(tiny_pipeline_path, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    (tmp_path / "wandb").mkdir()
    case = CASE_BY_NAME["wan"]
    trainer = make_trainer(tiny_pipeline_path("wan"), case, tmp_path / "out", report_to=["tensorboard", "wandb"],
                           log_images_steps=1, num_log_images=2, run_name="flowgrpo-video-test")
    trainer.train()
    import wandb

    wandb.finish()
    wandb.teardown()  # wandb keeps process-wide settings (WANDB_DIR included) until torn down
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_dirs = {root for root, _, files in os.walk(tmp_path / "tb") if any("tfevents" in f for f in files)}
    videos = []
    for d in event_dirs:
        acc = EventAccumulator(d, size_guidance={"images": 0})
        acc.Reload()
        if "samples/video" in acc.Tags()["images"]:
            videos += acc.Images("samples/video")
    assert videos and videos[0].encoded_image_string.startswith(b"GIF8")
    gif = Image.open(__import__("io").BytesIO(videos[0].encoded_image_string))
    assert gif.n_frames == case.num_frames and gif.size == (2 * SIZE, SIZE)  # two videos side by side
    gifs = [f for r, _, fs in os.walk(tmp_path / "wandb") for f in fs if f.endswith(".gif")]
    assert len(gifs) == 2


# --- checks before anything is loaded -------------------------------------------------------------------------------


def _index_only(path, tmp_path) -> Path:
    """A folder holding only the pipeline's model_index.json: loading it would fail, so an error raised on it comes
    from the checks that run before loading."""
    folder = tmp_path / "index-only"
    folder.mkdir(parents=True)
    shutil.copy(Path(path) / "model_index.json", folder / "model_index.json")
    return folder


def test_family_settings_are_checked_before_loading(tiny_pipeline_path, tmp_path):
    wan = _index_only(tiny_pipeline_path("wan"), tmp_path / "wan")
    with pytest.raises(ValueError, match=r"num_frames=4: Wan videos have 4k \+ 1 frames.*use 1 or 5"):
        make_trainer(wan, CASE_BY_NAME["wan"], tmp_path / "o1", num_frames=4)
    qwen = _index_only(tiny_pipeline_path("qwenimage"), tmp_path / "qwen")
    with pytest.raises(ValueError, match=r"num_frames=5.*generates images; set num_frames=1"):
        make_trainer(qwen, CASE_BY_NAME["qwenimage"], tmp_path / "o2", num_frames=5)
    edit = _index_only(tiny_pipeline_path("qwenimage_edit"), tmp_path / "edit")
    with pytest.raises(ValueError, match=r"QwenImageEditPipeline edits a source image.*no 'image' column"):
        make_trainer(edit, CASE_BY_NAME["qwenimage_edit"], tmp_path / "o3", dataset={"prompt": ["make it red"] * 2})
    from flowgrpo.testing import build_tiny_pipeline

    args = FlowGRPOConfig(output_dir=str(tmp_path / "o7"), **config_kwargs(CASE_BY_NAME["qwenimage_edit"]))
    with pytest.raises(ValueError, match=r"no 'image' column"):  # a pipeline object is checked the same way
        FlowGRPOTrainer(model=build_tiny_pipeline("qwenimage_edit"), reward_funcs=brightness_reward, args=args,
                        train_dataset=Dataset.from_dict({"prompt": ["make it red"] * 2}), peft_config=LoraConfig())
    with pytest.raises(ValueError, match=r"does not exist"):
        make_trainer(edit, CASE_BY_NAME["qwenimage_edit"], tmp_path / "o4",
                     dataset={"prompt": ["make it red"] * 2, "image": ["missing.png"] * 2})
    plus = _index_only(tiny_pipeline_path("qwenimage_edit_plus"), tmp_path / "plus")
    with pytest.raises(ValueError, match=r"QwenImageEditPlusPipeline edits a source image.*no 'image' column"):
        make_trainer(plus, CASE_BY_NAME["qwenimage_edit_plus"], tmp_path / "o8", dataset={"prompt": ["make it red"]})
    with pytest.raises(ValueError, match=r"empty list; give at least one image"):  # a list of images per row
        make_trainer(plus, CASE_BY_NAME["qwenimage_edit_plus"], tmp_path / "o9",
                     dataset={"prompt": ["make it red"], "image": [[]]})
    source_image(0).save(tmp_path / "b.png")
    with pytest.raises(ValueError, match=r"missing.png.*does not exist"):  # the second image of the row
        make_trainer(plus, CASE_BY_NAME["qwenimage_edit_plus"], tmp_path / "o10",
                     dataset={"prompt": ["make it red"], "image": [[str(tmp_path / "b.png"), "missing.png"]]})
    experts = _index_only(tiny_pipeline_path("wan", "two_experts"), tmp_path / "experts")
    args = FlowGRPOConfig(output_dir=str(tmp_path / "o5"), **config_kwargs(CASE_BY_NAME["wan_two_experts"]))
    with pytest.raises(ValueError, match=r"two experts.*LoRA.*peft_config"):
        FlowGRPOTrainer(model=str(experts), reward_funcs=brightness_reward, args=args,
                        train_dataset=Dataset.from_dict({"prompt": ["a cat"]}), peft_config=None)
    with pytest.raises(ValueError, match="num_frames=0"):
        FlowGRPOConfig(output_dir=str(tmp_path / "o6"), num_frames=0)


def test_wan_unipc_checkpoint_schedule_keeps_its_flow_shift(tiny_pipeline_path):
    """Released Wan checkpoints ship UniPC with flow_shift; the SDE scheduler gets the same shifted sigmas."""
    from diffusers import UniPCMultistepScheduler

    from flowgrpo.schedulers import FlowMatchSDEScheduler

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("wan")))
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0,
                                             num_train_timesteps=1000)
    adapter = WanAdapter(pipe, num_frames=5)
    naive = FlowMatchSDEScheduler.from_config(pipe.scheduler.config)
    assert naive.config.shift == 1.0  # what a plain conversion would silently do
    scheduler = FlowMatchSDEScheduler.from_config(adapter.sde_scheduler_config(), noise_level=0.7)
    assert scheduler.config.shift == 5.0
    for steps in (4, 10):
        adapter.set_timesteps(scheduler, steps, 64, 64, torch.device("cpu"))
        pipe.scheduler.set_timesteps(steps)
        # UniPC nudges sigma = 1 down by 1e-6 (for its log-SNR); everything else is identical
        torch.testing.assert_close(scheduler.sigmas, pipe.scheduler.sigmas.float(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("recipe, pipeline_class", [
    ("qwenimage_ocr.yaml", "QwenImagePipeline"), ("wan_t2v.yaml", "WanPipeline"),
    ("kontext_edit.yaml", "FluxKontextPipeline"), ("qwenimage_edit.yaml", "QwenImageEditPipeline"),
    ("wan_i2v.yaml", "WanImageToVideoPipeline"), ("ltx2_t2v.yaml", "LTX2Pipeline"),
    ("hunyuanvideo15_t2v.yaml", "HunyuanVideo15Pipeline"),
    ("flux2_klein_ocr.yaml", "Flux2KleinPipeline"), ("flux2_dev_pickscore.yaml", "Flux2Pipeline"),
    ("zimage_turbo_ocr.yaml", "ZImagePipeline"), ("qwenimage21_ocr.yaml", "QwenImage21Pipeline"),
    ("qwenimage_edit_plus.yaml", "QwenImageEditPlusPipeline")])
def test_family_recipes_suit_their_family(recipe, pipeline_class):
    """The recipes' settings (resolved as their run resolves them: an unset one is the model's own) pass the family's
    own checks (frames, sequence length) and name no LoRA targets, so the trainer uses the family's default."""
    from flowgrpo.cli import build_peft_config, parse_recipe
    from flowgrpo.models import family_adapter_class
    from flowgrpo.models.qwenimage import QWEN_MAX_SEQUENCE_LENGTH
    from flowgrpo.plan.recipe_settings import resolve_recipe_settings

    script_args, model_args, args = parse_recipe([str(REPO / "recipes" / recipe), "--use_cpu", "true"])
    assert resolve_recipe_settings(script_args, model_args, args).configs.pipeline_class == pipeline_class
    adapter_cls = family_adapter_class(pipeline_class)
    adapter_cls.check_num_frames(args.num_frames)
    assert (args.num_frames > 1) == adapter_cls.is_video
    assert build_peft_config(model_args).target_modules is None
    if adapter_cls.family.startswith("qwenimage"):
        assert args.max_sequence_length <= QWEN_MAX_SEQUENCE_LENGTH and args.guidance_scale > 1
    if adapter_cls.accepts_images and not adapter_cls.images_optional:
        assert script_args.dataset_name == "data/ocr_edit" and script_args.reward_funcs == ["ocr"]
    if adapter_cls.family == "wan_i2v":
        from flowgrpo.models.wan_i2v import WAN_I2V_TEXT_TOKENS

        assert args.max_sequence_length == WAN_I2V_TEXT_TOKENS
    if adapter_cls.family == "zimage":  # Turbo: its distilled few-step schedule, no CFG, exact-noise CPS steps
        assert args.guidance_scale == 0
        assert args.num_inference_steps == args.eval_num_inference_steps == 8 and args.sde_type == "cps"
    if adapter_cls.family == "flux2":  # the 24B encoder: cached embeddings, offloaded encoder
        assert args.cache_prompt_embeddings and args.offload_text_encoders


def test_wan_experts_split_a_batch_at_the_boundary_and_per_token_timesteps(tiny_pipeline_path, monkeypatch):
    """Samples on both sides of Wan 2.2's boundary each go to their own expert; Wan 2.2 TI2V's per-token timesteps
    (``expand_timesteps``) sample as the stock pipeline does."""
    from diffusers import WanPipeline

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("wan", "two_experts")))
    adapter = WanAdapter(pipe, num_frames=5)
    embeds = adapter.encode_prompts(["a cat", "a dog"], 16, torch.device("cpu"))
    x = adapter.prepare_latents(2, SIZE, SIZE, torch.Generator().manual_seed(0), torch.device("cpu"), torch.float32)
    t = torch.tensor([950.0, 300.0])  # boundary 875: the first sample is high noise, the second low noise
    assert adapter.expert_for(t).tolist() == [0, 1]
    with torch.no_grad():
        mixed = adapter.predict_velocity(adapter.trainable_module(), x, t, embeds, 1.0, None, SIZE, SIZE)
        high = pipe.transformer(hidden_states=x[:1], timestep=t[:1], encoder_hidden_states=embeds.tensors[
            "prompt_embeds"][:1], return_dict=False)[0]
        low = pipe.transformer_2(hidden_states=x[1:], timestep=t[1:], encoder_hidden_states=embeds.tensors[
            "prompt_embeds"][1:], return_dict=False)[0]
    torch.testing.assert_close(mixed, torch.cat([high, low]), rtol=1e-5, atol=1e-5)

    single = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("wan")))
    ti2v = WanPipeline(**{k: v for k, v in single.components.items() if k != "transformer_2"}, expand_timesteps=True)
    ti2v.set_progress_bar_config(disable=True)
    adapter = WanAdapter(ti2v, num_frames=5)
    assert adapter.expand_timesteps
    from flowgrpo.schedulers import FlowMatchSDEScheduler, sde_step_from_sigmas

    scheduler = FlowMatchSDEScheduler.from_config(adapter.sde_scheduler_config(), noise_level=0.0)
    adapter.set_timesteps(scheduler, 3, SIZE, SIZE, torch.device("cpu"))
    with torch.no_grad():
        embeds = adapter.encode_prompts(["a cat"], 16, torch.device("cpu"))
        x = adapter.prepare_latents(1, SIZE, SIZE, torch.Generator().manual_seed(0), torch.device("cpu"), torch.float32)
        for i in range(3):
            v = adapter.predict_velocity(ti2v.transformer, x, scheduler.timesteps[i].expand(1), embeds, 1.0, None, SIZE,
                                         SIZE)
            x = sde_step_from_sigmas(v, x, scheduler.sigmas[i], scheduler.sigmas[i + 1], noise_level=0.0).prev_sample
    reference = ti2v(prompt=["a cat"], height=SIZE, width=SIZE, num_frames=5, num_inference_steps=3, guidance_scale=1.0,
                     output_type="latent", max_sequence_length=16, generator=torch.Generator().manual_seed(0)).frames
    torch.testing.assert_close(x, reference, rtol=1e-4, atol=1e-4)


# --- two ranks ------------------------------------------------------------------------------------------------------


#: the trainers the two-rank launch also runs on every family (after Flow-GRPO), with the keys their logs must hold
FURTHER_TRAINERS = {"dgpo": ("loss", "policy_loss", "dgpo/dsm", "dgpo/group_weight", "kl", "clip_frac"),
                    "crd": ("loss", "policy_loss", "crd/implicit_reward", "kl"),
                    "reward_backprop": ("loss", "backprop/reward_loss", "kl")}
#: further trainers the launch runs on some families only (families_ddp_worker.ONLY_ON)
ONLY_ON = {"reward_backprop": ("qwenimage", "flux_kontext")}


#: seconds one rank spends on each family's part of a launch (Flow-GRPO's two steps, DGPO's and CRD's one, DRaFT's
#: where it runs), measured on a quiet 2-core machine, and on the Flow-DPPO / BranchGRPO / distillation part: what
#: `launch_plan` balances the launches by
LAUNCH_COST = {"qwenimage": 3.5, "wan": 4.5, "wan_two_experts": 6.0, "flux_kontext": 4.0, "qwenimage_edit": 4.5,
               "flux2_klein": 4.0, "zimage": 3.5, "flux2": 4.5, "qwenimage_edit_plus": 7.0, "qwenimage21": 4.0,
               "wan_i2v": 4.5, "wan_i2v_two_experts": 6.0, "wan_i2v_ti2v": 4.0, "ltx2": 6.0, "hunyuanvideo15": 14.0}
DPPO_BRANCH_OPD = "new:dppo_branch_opd"
LAUNCH_COST[DPPO_BRANCH_OPD] = 3.0
#: the two-rank launches (each its own test, so that parallel test workers share them; each about 20 s of training a
#: rank after its start-up, so that none runs past a minute beside another test)
LAUNCHES = 4


def launch_plan(launches: int = LAUNCHES) -> list[list[str]]:
    """The parts of each launch: every family of `CASES` and the Flow-DPPO / BranchGRPO / distillation part in
    exactly one, the longest first to the launch with the least so far (ties: the first such launch)."""
    plan: list[list[str]] = [[] for _ in range(launches)]
    totals = [0.0] * launches
    for name in sorted(LAUNCH_COST, key=lambda n: (-LAUNCH_COST[n], n)):
        target = totals.index(min(totals))
        plan[target].append(name)
        totals[target] += LAUNCH_COST[name]
    return plan


def test_the_two_rank_launches_cover_every_family():
    assert set(LAUNCH_COST) == {c.name for c in CASES} | {DPPO_BRANCH_OPD}, "a family without its launch cost"
    launched = [name for part in launch_plan() for name in part]
    assert sorted(launched) == sorted(LAUNCH_COST) and len(set(launched)) == len(LAUNCH_COST)
    totals = [sum(LAUNCH_COST[n] for n in part) for part in launch_plan()]
    assert max(totals) <= 1.25 * sum(totals) / LAUNCHES, totals  # balanced


@pytest.mark.slow
@pytest.mark.parametrize("launch", range(LAUNCHES))
def test_two_ranks_train_every_family(launch, tiny_pipeline_path, tiny_sd3_path, tmp_path):
    """Two CPU ranks (one accelerate launch per test) train the families of ``launch_plan()[launch]``: all the
    launches together train every family (test_the_two_rank_launches_cover_every_family)."""
    from support.trainer_cases import teacher_lora_folder

    part = launch_plan()[launch]
    cases = [c for c in CASES if c.name in part]
    with_dppo_branch_opd = DPPO_BRANCH_OPD in part
    paths = {c.name: str(tiny_pipeline_path(c.family, c.variant)) for c in cases}
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_ddp.yaml",
           "tests/distributed/families_ddp_worker.py", "--pipelines", json.dumps(paths), "--output_dir", str(tmp_path),
           "--trainers", json.dumps(list(FURTHER_TRAINERS))]
    if with_dppo_branch_opd:
        cmd += ["--dppo_branch_opd", str(tiny_sd3_path), "--teacher_lora", str(teacher_lora_folder(tiny_sd3_path))]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["rank"], r1["rank"], r0["world_size"], r1["world_size"]) == (0, 1, 2, 2)
    for case in cases:
        a, b = r0["cases"][case.name], r1["cases"][case.name]
        assert [x["step"] for x in a] == [x["step"] for x in b] == [0, 1, 2], case.name
        for x, y in zip(a, b):
            assert x["weights"] == y["weights"], (case.name, x["step"])  # gradients synchronised
        for part in a[0]["weights"]:  # every step moves every trained part (both experts of Wan 2.2)
            assert len({x["weights"][part] for x in a}) == 3, (case.name, part)
        if case.variant == "two_experts":
            assert set(a[0]["weights"]) == {"transformer", "transformer_2"}
        for x, y in zip(a[1:], b[1:]):
            assert x["samples"] != y["samples"], case.name  # each rank samples its own noise
            for key in ("reward", "reward_std", "frac_reward_zero_std"):
                assert x["logs"][key] == y["logs"][key], (case.name, key)  # statistics of the gathered rewards
            assert x["num_frames"] == [case.num_frames] * 2
        assert a[1]["logs"]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert a[1]["logs"]["reward"] == pytest.approx(np.mean(a[1]["rewards"] + b[1]["rewards"]), abs=1e-5)
        for kind, keys in FURTHER_TRAINERS.items():  # each family under DGPO and CRD too (DRaFT on two), both ranks
            if kind in ONLY_ON and case.name not in ONLY_ON[kind]:
                continue
            a, b = r0["cases"][f"{case.name}/{kind}"], r1["cases"][f"{case.name}/{kind}"]
            assert [x["step"] for x in a] == [x["step"] for x in b] == [0, 1], (case.name, kind)
            assert a[1]["weights"] == b[1]["weights"], (case.name, kind)  # gradients synchronised
            # one trained noise level: Wan 2.2's experts each train only on their own levels
            assert any(a[0]["weights"][part] != a[1]["weights"][part] for part in a[0]["weights"]), (case.name, kind)
            assert all(np.isfinite(x["logs"][key]) for x in (a[1], b[1]) for key in keys), (case.name, kind)
        # DGPO's group score is summed over the ranks: the same on both (one group of four split over them), and not
        # 0 (the LoRA starts away from the base)
        a, b = r0["cases"][f"{case.name}/dgpo"], r1["cases"][f"{case.name}/dgpo"]
        assert a[1]["logs"]["dgpo/group_score"] == pytest.approx(b[1]["logs"]["dgpo/group_score"], rel=1e-5)
        assert a[1]["logs"]["dgpo/group_score"] != 0.0, case.name
    if not with_dppo_branch_opd:
        return
    # Flow-DPPO, BranchGRPO and on-policy distillation on the tiny SD3 pipeline, same launch: each tree of 4 leaves is split over the two ranks.
    for name in ("new:dppo_branch", "new:opd"):
        a, b = r0["cases"][name], r1["cases"][name]
        assert [x["step"] for x in a] == [x["step"] for x in b] == [0, 1, 2], name
        for x, y in zip(a, b):
            assert x["weights"] == y["weights"], (name, x["step"])  # gradients synchronised
        assert len({x["weights"]["all"] for x in a}) == 3, name  # both steps moved the weights
        assert a[1]["samples"] != b[1]["samples"] and a[1]["logs"]["reward"] == b[1]["logs"]["reward"], name
    tree_a, tree_b = r0["cases"]["new:dppo_branch"][1]["logs"], r1["cases"]["new:dppo_branch"][1]["logs"]
    # 6 edges a tree (2 at the split step 0, 4 at step 1), each trained by the one rank that owns it
    assert tree_a["branch/trained_edges"] + tree_b["branch/trained_edges"] == 6.0
    assert tree_a["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    second = r0["cases"]["new:dppo_branch"][2]["logs"]
    assert second["dppo/divergence_mean"] > 0  # the second pass over the same trees
    assert r0["cases"]["new:opd"][1]["logs"]["opd_kl"] > 0


def test_flux2_klein_distilled_takes_one_pass_whatever_the_guidance_scale(tiny_pipeline_path):
    """FLUX.2 [klein]'s step-distilled releases (``is_distilled`` in the pipeline's config) are sampled without CFG at
    any guidance scale, as the stock pipeline samples them (the base model's CFG is covered above)."""
    from flowgrpo.models import Flux2KleinAdapter
    from flowgrpo.schedulers import FlowMatchSDEScheduler, sde_step_from_sigmas

    cpu = torch.device("cpu")
    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("flux2_klein", "distilled")))
    pipe.set_progress_bar_config(disable=True)
    adapter = Flux2KleinAdapter(pipe)
    assert adapter.is_distilled and not adapter.uses_cfg(4.0)
    scheduler = FlowMatchSDEScheduler.from_config(adapter.sde_scheduler_config(), noise_level=0.0)
    adapter.set_timesteps(scheduler, 3, SIZE, SIZE, cpu)
    prompts = ["a cat", "two blue squares"]
    with torch.no_grad():
        embeds = adapter.encode_prompts(prompts, 16, cpu)
        x = adapter.prepare_latents(2, SIZE, SIZE, torch.Generator().manual_seed(0), cpu, torch.float32)
        for i in range(3):
            v = adapter.predict_velocity(pipe.transformer, x, scheduler.timesteps[i].expand(2), embeds, 4.0, None,
                                         SIZE, SIZE)
            x = sde_step_from_sigmas(v, x, scheduler.sigmas[i], scheduler.sigmas[i + 1], noise_level=0.0).prev_sample
        pixels = adapter.decode(x, SIZE, SIZE)
    reference = pipe(prompt=prompts, height=SIZE, width=SIZE, num_inference_steps=3, guidance_scale=4.0,
                     output_type="pt", max_sequence_length=16, generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(pixels, reference, rtol=1e-4, atol=1e-4)


def test_qwenimage21_samples_the_configured_sample_sigmas(tiny_pipeline_path):
    """Qwen-Image 2.1's pipeline config carries the author's ``sample_sigmas`` (their number is the stock pipeline's
    step count): at that count the adapter's schedule is the stock pipeline's; another count resamples the same curve;
    without them the grid is linear."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    from flowgrpo.models import QwenImage21Adapter
    from flowgrpo.schedulers import FlowMatchSDEScheduler

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("qwenimage21")))
    adapter = QwenImage21Adapter(pipe)
    configured = list(pipe.config.sample_sigmas)
    scheduler = FlowMatchSDEScheduler.from_config(adapter.sde_scheduler_config(), noise_level=0.7)
    adapter.set_timesteps(scheduler, len(configured), 64, 64, torch.device("cpu"))
    config = pipe.scheduler.config
    mu = calculate_shift(16, config.base_image_seq_len, config.max_image_seq_len, config.base_shift, config.max_shift)
    pipe.scheduler.set_timesteps(sigmas=configured, mu=mu)  # what the pipeline's call does at 64 px (4x4 tokens)
    torch.testing.assert_close(scheduler.sigmas, pipe.scheduler.sigmas.float())
    assert len(scheduler.timesteps) == len(configured)
    assert adapter.sample_sigmas(5) == pytest.approx([1.0, 0.9, 0.8, 0.65, 0.5])  # along the grid's index
    adapter.set_timesteps(scheduler, 5, 64, 64, torch.device("cpu"))
    pipe.scheduler.set_timesteps(sigmas=[1.0, 0.9, 0.8, 0.65, 0.5], mu=mu)
    torch.testing.assert_close(scheduler.sigmas, pipe.scheduler.sigmas.float())
    pipe.register_to_config(sample_sigmas=None)
    assert adapter.sample_sigmas(4) == pytest.approx([1.0, 0.75, 0.5, 0.25])
