"""Analytic FLOPs of LTX-2 and HunyuanVideo 1.5 against torch's counter: the tiny pipelines through their adapters
(forward and backward, LoRA on the family's default targets and full fine-tuning) and the full-size transformers on
the meta device (forward, one short clip)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowgrpo.benchmarking import transformer_forward_flops
from flowgrpo.benchmarking.flops import count_flops


def _check_adapter_flops(family, pipe, adapter, embeds, latents, full, audio_tokens=0):
    """Forward and backward of ``predict_velocity`` (batch 2, no CFG) against the analytic count."""
    from peft import LoraConfig, get_peft_model

    n_img, n_txt = adapter.sequence_lengths(embeds, latents)
    config = dict(pipe.transformer.config)
    targets = list(adapter.default_lora_target_modules)
    if full:
        model = pipe.transformer.requires_grad_(True)
        expected = transformer_forward_flops(family, config, n_img, n_txt, audio_tokens=audio_tokens)
    else:
        model = get_peft_model(pipe.transformer, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        expected = transformer_forward_flops(family, config, n_img, n_txt, lora_rank=4, lora_targets=targets,
                                             audio_tokens=audio_tokens)
        assert expected.lora > 0
    out = {}
    with sdpa_kernel(SDPBackend.MATH):
        forward = count_flops(lambda: out.setdefault("v", adapter.predict_velocity(
            model, latents, torch.full((2,), 500.0), embeds, 1.0, None, 32, 32)))
        backward = count_flops(lambda: out["v"].float().square().mean().backward())
    assert forward == 2 * expected.total
    assert backward == 2 * expected.backward(full_finetune=full)
    return n_img, n_txt


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_analytic_flops_match_torch_counter_on_tiny_ltx2(full, tiny_pipeline_path):
    """LTX-2: both streams, the text, audio-to-video and video-to-audio attention; LoRA on the video stream only (the
    audio stream's first-block layers get no gradient until the video-to-audio attention)."""
    from diffusers import DiffusionPipeline

    from flowgrpo.models import get_family_adapter

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("ltx2")))
    adapter = get_family_adapter(pipe, num_frames=9)
    cpu = torch.device("cpu")
    with torch.no_grad():
        embeds = adapter.encode_prompts(["a cat", "a dog"], 32, cpu)
    latents = adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0), cpu, torch.float32)
    audio_tokens = adapter.audio_sequence_length(latents)
    n_img, n_txt = _check_adapter_flops("ltx2", pipe, adapter, embeds, latents, full, audio_tokens)
    frames, h, w, _, audio_frames, _, _ = adapter._latent_dims(32, 32)
    assert (n_img, n_txt, audio_tokens) == (frames * h * w, 32, audio_frames) and audio_tokens > 0


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_analytic_flops_match_torch_counter_on_tiny_hunyuanvideo15(full, tiny_pipeline_path):
    """HunyuanVideo 1.5: the token refiner, the ByT5 and image projections, the joint blocks over the 729 + 256 + 1000
    context tokens (the last block's text outputs computed and discarded)."""
    from diffusers import DiffusionPipeline

    from flowgrpo.models import get_family_adapter

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("hunyuanvideo15")))
    adapter = get_family_adapter(pipe, num_frames=5)
    cpu = torch.device("cpu")
    with torch.no_grad():
        embeds = adapter.encode_prompts(["a cat", 'a sign saying "hi"'], 32, cpu)
    latents = adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0), cpu, torch.float32)
    n_img, n_txt = _check_adapter_flops("hunyuanvideo15", pipe, adapter, embeds, latents, full)
    assert (n_img, n_txt) == (3 * 8 * 8, 729 + 256 + 1000)


def test_analytic_flops_match_torch_counter_on_full_size_ltx2():
    """LTX-2 (19B) at full size on the meta device: 9 frames of 256 x 256 (2 x 8 x 8 video tokens), their 9 audio
    latent frames, 64 context tokens."""
    from diffusers import LTX2VideoTransformer3DModel

    from flowgrpo.benchmarking.full_size_video import LTX2_TRANSFORMER

    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**LTX2_TRANSFORMER)
    n_img, n_audio, n_txt = 2 * 8 * 8, 9, 64
    meta = dict(device="meta")
    kwargs = dict(hidden_states=torch.empty(1, n_img, 128, **meta), audio_hidden_states=torch.empty(1, n_audio, 128, **meta),
                  encoder_hidden_states=torch.empty(1, n_txt, 3840, **meta),
                  audio_encoder_hidden_states=torch.empty(1, n_txt, 3840, **meta),
                  timestep=torch.empty(1, **meta), sigma=torch.empty(1, **meta),
                  encoder_attention_mask=torch.ones(1, n_txt, **meta),
                  audio_encoder_attention_mask=torch.ones(1, n_txt, **meta),
                  num_frames=2, height=8, width=8, fps=24.0, audio_num_frames=n_audio, use_cross_timestep=True,
                  return_dict=False)
    expected = transformer_forward_flops("ltx2", dict(model.config), n_img, n_txt, audio_tokens=n_audio)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert count_flops(model, **kwargs) == expected.total
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert 18.5 < params < 19.5, params


def test_analytic_flops_match_torch_counter_on_full_size_hunyuanvideo15():
    """HunyuanVideo 1.5 (8.3B, 480p text-to-video) at full size on the meta device: 5 frames of 256 x 256 (2 x 16 x 16
    video tokens) and the pipeline's 729 + 256 + 1000 context tokens.

    The model's forward checks whether the image embeddings are all zero and reorders the context by its masks (Python
    branches on tensor values, which the meta device cannot take); that step has no matmul, so its submodules run here
    in the forward's order on a context of the reordered length, with the real blocks, refiner and embedders.
    """
    from diffusers import HunyuanVideo15Transformer3DModel

    from flowgrpo.benchmarking.full_size_video import HUNYUANVIDEO15_480P_T2V_TRANSFORMER

    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel(**HUNYUANVIDEO15_480P_T2V_TRANSFORMER)
    n_img, n_ctx = 2 * 16 * 16, 729 + 256 + 1000

    def forward():
        with torch.device("meta"):
            latents, timestep = torch.empty(1, 65, 2, 16, 16), torch.empty(1)
            text, text_mask = torch.empty(1, 1000, 3584), torch.ones(1, 1000)
            rotary = model.rope(latents)
            temb = model.time_embed(timestep)
            hidden = model.x_embedder(latents)
            parts = [model.image_embedder(torch.empty(1, 729, 1152)), model.context_embedder_2(torch.empty(1, 256, 1472)),
                     model.context_embedder(text, timestep, text_mask)]
            context, mask = torch.cat(parts, dim=1), torch.ones(1, n_ctx)
            for block in model.transformer_blocks:
                hidden, context = block(hidden, context, temb, mask, rotary)
            return model.proj_out(model.norm_out(hidden, temb))

    expected = transformer_forward_flops("hunyuanvideo15", dict(model.config), n_img, n_ctx)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert count_flops(forward) == expected.total
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert 8.0 < params < 8.6, params


@pytest.mark.parametrize("name", ["ltx2-random", "hunyuanvideo15-random"])
def test_full_size_video_presets_build_on_the_meta_device(name, monkeypatch):
    """The presets' build code on the meta device: valid pipelines of the released sizes, adapters that accept the
    preset's clip, and a clear error without CUDA."""
    from flowgrpo.benchmarking import get_preset
    from flowgrpo.benchmarking.presets import _build_full_size, build_preset_pipeline
    from flowgrpo.models import get_family_adapter

    preset = get_preset(name)
    pipe = _build_full_size(preset, seed=0, device="meta")
    sizes = {k: sum(p.numel() for p in getattr(pipe, k).parameters()) / 1e9
             for k in ("transformer", "text_encoder", "vae")}
    kwargs = preset.config_kwargs()
    adapter = get_family_adapter(pipe, num_frames=kwargs["num_frames"])
    assert adapter.family == preset.family and preset.lora_targets == adapter.default_lora_target_modules
    if name == "ltx2-random":  # 19 B transformer, Gemma 3 12B (with SigLIP), the video VAE; 8k + 1 frames, 32x sizes
        assert 18.5 < sizes["transformer"] < 19.5 and 11.5 < sizes["text_encoder"] < 12.5, sizes
        assert pipe.vae_spatial_compression_ratio == 32 and pipe.vae_temporal_compression_ratio == 8
        frames, h, w, *_ = adapter._latent_dims(preset.resolution, kwargs["width"])
        assert (frames, h, w, adapter.audio_sequence_length(None)) == (5, 16, 24, 34)
    else:  # 8.3 B transformer, Qwen2.5-VL-7B's text model, the 16x VAE; 4k + 1 frames
        assert 8.0 < sizes["transformer"] < 8.6 and 7.0 < sizes["text_encoder"] < 7.8, sizes
        assert adapter._latent_dims(preset.resolution, kwargs["width"]) == (9, 30, 52)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"CUDA GPU.*small-cpu"):
        build_preset_pipeline(preset)


@pytest.mark.parametrize("family, bad, message", [
    ("ltx2", dict(num_frames=4), r"num_frames=4: this LTX-2 VAE compresses time 2x.*use 3 or 5"),
    ("ltx2", dict(resolution=48), r"divisible by 32, got 48 x 48; use e.g. 32 x 32"),
    ("hunyuanvideo15", dict(num_frames=4), r"num_frames=4: this HunyuanVideo 1.5 VAE compresses time 2x.*use 3 or 5"),
    # (the config already wants multiples of 16, the released VAE's factor: a 32x VAE config shows the check)
    ("hunyuanvideo15", dict(resolution=48), r"48 x 48: HunyuanVideo 1.5 needs sides divisible by 32; use e.g. 32 x 32"),
])
def test_video_frames_and_sizes_are_checked_before_loading(family, bad, message, tiny_pipeline_path, tmp_path):
    """The frame count and the size against the folder's VAE config (the tiny VAEs compress time 2x; LTX-2's pipeline
    wants sides divisible by 32, HunyuanVideo 1.5's its VAE's spatial factor), from the folder's configs alone."""
    from flowgrpo.trainer.online_config import OnlineRLConfig
    from flowgrpo.trainer.policy.loading import check_family_settings, read_pipeline_index

    path = str(tiny_pipeline_path(family))
    index = read_pipeline_index(path, {})
    assert index["_vae_config"]["_class_name"].startswith("AutoencoderKL")
    if family == "hunyuanvideo15" and "resolution" in bad:
        index["_vae_config"]["spatial_compression_ratio"] = 32
    good = dict(num_frames=5, resolution=32)
    check_family_settings(index, OnlineRLConfig(output_dir=str(tmp_path), **good), None, (None,))
    args = OnlineRLConfig(output_dir=str(tmp_path), **{**good, **bad})
    with pytest.raises(ValueError, match=message):
        check_family_settings(index, args, None, (None,))


@pytest.mark.parametrize("recipe, family", [("ltx2_t2v.yaml", "ltx2"), ("hunyuanvideo15_t2v.yaml", "hunyuanvideo15")])
def test_video_recipes_suit_the_released_vaes(recipe, family):
    """The shipped recipes' frames and sizes pass the checks against the released VAEs' configs (LTX-2: 8x in time;
    HunyuanVideo 1.5: 4x in time, 16x in space), and a frame count off the grid is refused."""
    from pathlib import Path

    import yaml

    from flowgrpo.benchmarking.full_size_video import LTX2_VAE
    from flowgrpo.models import family_adapter_class

    settings = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / recipe).read_text())
    vae = dict(LTX2_VAE) if family == "ltx2" else {"temporal_compression_ratio": 4, "spatial_compression_ratio": 16}
    adapter_cls = family_adapter_class("LTX2Pipeline" if family == "ltx2" else "HunyuanVideo15Pipeline")
    adapter_cls.check_video_settings(settings["num_frames"], settings["height"], settings["width"], vae)
    with pytest.raises(ValueError, match="k \\+ 1 frames"):
        adapter_cls.check_video_settings(settings["num_frames"] + 2, settings["height"], settings["width"], vae)


def test_harness_counts_ltx2_audio_tokens(tmp_path):
    """One measured step of a tiny LTX-2 preset through the harness: the FLOP record carries the audio tokens and its
    per-sample forward is the analytic count of both streams."""
    import dataclasses

    from flowgrpo.benchmarking import get_preset
    from flowgrpo.benchmarking.harness import run_benchmark
    from flowgrpo.models.ltx2 import LTX2_LORA_TARGET_MODULES
    from flowgrpo.testing import build_tiny_pipeline

    preset = dataclasses.replace(get_preset("tiny"), name="tiny-ltx2", family="ltx2", resolution=32,
                                 reward="jpeg_compressibility", lora_targets=LTX2_LORA_TARGET_MODULES,
                                 guidance_scale=2.0, max_sequence_length=32, extra_args={"num_frames": 5})
    result = run_benchmark(preset, steps=1, warmup_steps=0, output_dir=str(tmp_path), log=None)
    flops = result["flops"]
    assert (flops["image_tokens"], flops["text_tokens"], flops["audio_tokens"]) == (3 * 16 * 16, 32, 5)
    config = dict(build_tiny_pipeline("ltx2").transformer.config)
    expected = transformer_forward_flops("ltx2", config, 768, 32, preset.lora_rank, list(LTX2_LORA_TARGET_MODULES),
                                         audio_tokens=5)
    assert flops["forward_per_sample"] == expected.total and flops["batch_per_call"] == 4
