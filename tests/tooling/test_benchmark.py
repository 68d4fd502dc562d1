"""The benchmark harness: analytic FLOPs against torch's counter, the presets, and a one-step smoke run.

No test asserts a time.
"""

import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from flowgrpo.benchmarking import PRESETS, get_preset, step_flops, transformer_forward_flops
from flowgrpo.benchmarking.flops import count_flops
from flowgrpo.benchmarking.full_size_families import (
    FLUX2_DEV_TRANSFORMER,
    FLUX2_KLEIN_4B_TRANSFORMER,
    ZIMAGE_TURBO_TRANSFORMER,
)
from flowgrpo.benchmarking.harness import overhead_bound
from flowgrpo.benchmarking.presets import (
    FLUX_DEV_TRANSFORMER,
    QWEN_IMAGE_TRANSFORMER,
    SD35M_TRANSFORMER,
    WAN_1_3B_TRANSFORMER,
    WAN_14B_TRANSFORMER,
    WAN_LORA_TARGETS,
    build_preset_pipeline,
)

ROOT = Path(__file__).resolve().parents[2]
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def _inputs(family, batch, device="cpu"):
    """Transformer inputs for a 64 px tiny model: 16 image tokens, 93 (SD3) or 16 (FLUX) text tokens."""
    if family == "sd3":
        return 16, 93, dict(hidden_states=torch.randn(batch, 16, 8, 8, device=device),
                            timestep=torch.full((batch,), 500.0, device=device),
                            encoder_hidden_states=torch.randn(batch, 93, 96, device=device),
                            pooled_projections=torch.randn(batch, 80, device=device))
    return 16, 16, dict(hidden_states=torch.randn(batch, 16, 64, device=device),
                        timestep=torch.full((batch,), 0.5, device=device),
                        guidance=torch.full((batch,), 3.5, device=device),
                        pooled_projections=torch.randn(batch, 32, device=device),
                        encoder_hidden_states=torch.randn(batch, 16, 96, device=device),
                        txt_ids=torch.zeros(16, 3, device=device), img_ids=torch.zeros(16, 3, device=device))


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_analytic_flops_match_torch_counter_on_tiny_models_with_lora(family):
    from peft import LoraConfig, get_peft_model

    from flowgrpo.testing import build_tiny_pipeline

    transformer = build_tiny_pipeline(family).transformer
    config = dict(transformer.config)
    model = get_peft_model(transformer, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    batch = 2
    n_img, n_txt, kwargs = _inputs(family, batch)
    expected = transformer_forward_flops(family, config, n_img, n_txt, lora_rank=4, lora_targets=LORA_TARGETS)
    assert expected.lora > 0
    with sdpa_kernel(SDPBackend.MATH):  # the math backend decomposes into matmuls that the counter sees
        with torch.no_grad():
            assert count_flops(model, **kwargs) == batch * expected.total
        out = {}
        assert count_flops(lambda: out.setdefault("v", model(**kwargs)[0])) == batch * expected.total
        backward = count_flops(lambda: out["v"].float().square().mean().backward())
    assert backward == batch * expected.backward(full_finetune=False)


def _family_inputs(family, batch, device="cpu"):
    """Inputs of a 32 px call of the tiny Qwen-Image / Wan transformers (5 frames), and their token counts."""
    if family == "qwenimage":  # 4 packed image tokens, 7 text tokens
        return 4, 7, dict(hidden_states=torch.randn(batch, 4, 64, device=device),
                          timestep=torch.full((batch,), 0.5, device=device),
                          encoder_hidden_states=torch.randn(batch, 7, 32, device=device),
                          encoder_hidden_states_mask=None, img_shapes=[[(1, 2, 2)]] * batch)
    return 8, 9, dict(hidden_states=torch.randn(batch, 16, 2, 4, 4, device=device),  # 2 latent frames of 2x2 patches
                      timestep=torch.full((batch,), 500.0, device=device),
                      encoder_hidden_states=torch.randn(batch, 9, 48, device=device))


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("family", ["qwenimage", "wan"])
def test_analytic_flops_match_torch_counter_on_tiny_qwenimage_and_wan(family, full):
    """Forward and backward, LoRA on the family's default targets or full fine-tuning."""
    from peft import LoraConfig, get_peft_model

    from flowgrpo.models import QwenImageAdapter, WanAdapter
    from flowgrpo.testing import build_tiny_pipeline

    targets = list((QwenImageAdapter if family == "qwenimage" else WanAdapter).default_lora_target_modules)
    batch = 2
    n_img, n_txt, kwargs = _family_inputs(family, batch)
    transformer = build_tiny_pipeline(family).transformer
    config = dict(transformer.config)
    if full:
        model, expected = transformer.requires_grad_(True), transformer_forward_flops(family, config, n_img, n_txt)
    else:
        model = get_peft_model(transformer, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        expected = transformer_forward_flops(family, config, n_img, n_txt, lora_rank=4, lora_targets=targets)
        assert expected.lora > 0
    with sdpa_kernel(SDPBackend.MATH):
        out = {}
        assert count_flops(lambda: out.setdefault("v", model(**kwargs)[0])) == batch * expected.total
        backward = count_flops(lambda: out["v"].float().square().mean().backward())
    assert backward == batch * expected.backward(full_finetune=full)


def test_analytic_flops_full_finetune_backward_on_tiny_sd3():
    from flowgrpo.testing import build_tiny_pipeline

    transformer = build_tiny_pipeline("sd3").transformer.requires_grad_(True)
    n_img, n_txt, kwargs = _inputs("sd3", 1)
    expected = transformer_forward_flops("sd3", dict(transformer.config), n_img, n_txt)
    with sdpa_kernel(SDPBackend.MATH):
        out = transformer(**kwargs)[0]
        backward = count_flops(lambda: out.square().mean().backward())
    # Weight gradients of every linear (the embedders' too) plus input gradients where autograd needs them.
    assert backward == expected.backward(full_finetune=True)


@pytest.mark.parametrize("family, config", [("sd3", SD35M_TRANSFORMER), ("flux", FLUX_DEV_TRANSFORMER)])
def test_analytic_flops_match_torch_counter_on_full_size_architectures(family, config):
    """The full-size SD3.5-Medium / FLUX.1-dev transformers, built on the meta device (nothing is computed)."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    cls = SD3Transformer2DModel if family == "sd3" else FluxTransformer2DModel
    with torch.device("meta"):
        model = cls(**config)
    batch = 1
    if family == "sd3":  # 512 px: 64x64 latents, patch 2 -> 1024 image tokens; 77 CLIP + 256 T5 text tokens
        n_img, n_txt = 1024, 333
        kwargs = dict(hidden_states=torch.empty(batch, 16, 64, 64, device="meta"),
                      timestep=torch.empty(batch, device="meta"),
                      encoder_hidden_states=torch.empty(batch, n_txt, 4096, device="meta"),
                      pooled_projections=torch.empty(batch, 2048, device="meta"))
    else:
        n_img, n_txt = 1024, 256
        kwargs = dict(hidden_states=torch.empty(batch, n_img, 64, device="meta"),
                      timestep=torch.empty(batch, device="meta"), guidance=torch.empty(batch, device="meta"),
                      pooled_projections=torch.empty(batch, 768, device="meta"),
                      encoder_hidden_states=torch.empty(batch, n_txt, 4096, device="meta"),
                      txt_ids=torch.zeros(n_txt, 3, device="meta"), img_ids=torch.zeros(n_img, 3, device="meta"))
    expected = transformer_forward_flops(family, dict(model.config), n_img, n_txt)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert count_flops(model, **kwargs) == expected.total
    params = sum(p.numel() for p in model.parameters())
    assert (params > 2.2e9) if family == "sd3" else (params > 11e9)


@pytest.mark.parametrize("family, config", [("qwenimage", QWEN_IMAGE_TRANSFORMER), ("wan", WAN_1_3B_TRANSFORMER),
                                            ("wan", WAN_14B_TRANSFORMER)], ids=["qwen-image", "wan-1.3b", "wan-14b"])
def test_analytic_flops_match_torch_counter_on_full_size_qwenimage_and_wan(family, config):
    """Qwen-Image (20 B) and Wan 2.1 (1.3 B, 14 B) at full size on the meta device, at their benchmark shapes."""
    from diffusers import QwenImageTransformer2DModel, WanTransformer3DModel

    with torch.device("meta"):
        model = (QwenImageTransformer2DModel if family == "qwenimage" else WanTransformer3DModel)(**config)
    if family == "qwenimage":  # 512 px: 32x32 packed tokens; a 40-token prompt
        n_img, n_txt = 1024, 40
        kwargs = dict(hidden_states=torch.empty(1, n_img, 64, device="meta"), timestep=torch.empty(1, device="meta"),
                      encoder_hidden_states=torch.empty(1, n_txt, 3584, device="meta"),
                      encoder_hidden_states_mask=None, img_shapes=[[(1, 32, 32)]])
    else:  # 33 frames of 480x832: 9 latent frames of 30x52 patches; 512 text tokens
        n_img, n_txt = 9 * 30 * 52, 512
        kwargs = dict(hidden_states=torch.empty(1, 16, 9, 60, 104, device="meta"),
                      timestep=torch.empty(1, device="meta"),
                      encoder_hidden_states=torch.empty(1, n_txt, 4096, device="meta"))
    expected = transformer_forward_flops(family, dict(model.config), n_img, n_txt)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert count_flops(model, **kwargs) == expected.total
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert {"qwenimage": 20 < params < 21, "wan": 1.2 < params < 1.6 or 13.5 < params < 15}[family], params


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("family", ["flux2_klein", "flux2", "zimage", "qwenimage21", "qwenimage_edit_plus"])
def test_analytic_flops_match_torch_counter_on_tiny_later_families(family, full, tiny_pipeline_path):
    """FLUX.2 [klein] / [dev] (two reference images), Z-Image, Qwen-Image 2.1 and Qwen-Image-Edit-Plus (two source
    images), called through their adapters: forward and backward, LoRA on the family's default targets or full
    fine-tuning. Qwen-Image 2.1's per-sample layers run one extra row per call, counted exactly for one sample."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model
    from PIL import Image

    from flowgrpo.models import get_family_adapter

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path(family)))
    adapter = get_family_adapter(pipe)
    targets = list(adapter.default_lora_target_modules)
    cpu = torch.device("cpu")
    batch = 1 if family == "qwenimage21" else 2
    two_sources = family in ("flux2", "qwenimage_edit_plus")
    references = [[Image.new("RGB", (32, 32), (200, 30, 30)), Image.new("RGB", (32, 32), (30, 30, 200))]] * batch
    with torch.no_grad():
        embeds = adapter.encode_prompts(["a cat", "a dog"][:batch], 20, cpu, images=references if two_sources else None,
                                        height=32, width=32)
    latents = adapter.prepare_latents(batch, 32, 32, torch.Generator().manual_seed(0), cpu, torch.float32)
    n_img, n_txt = adapter.sequence_lengths(embeds, latents)
    assert n_img == (12 if two_sources else 4)  # 2x2 target tokens (and two 2x2 references)
    config = dict(pipe.transformer.config)
    if full:
        model, expected = pipe.transformer.requires_grad_(True), transformer_forward_flops(family, config, n_img, n_txt)
    else:
        model = get_peft_model(pipe.transformer, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        expected = transformer_forward_flops(family, config, n_img, n_txt, lora_rank=4, lora_targets=targets)
        assert expected.lora > 0
    guidance = 0.0 if family == "zimage" else 1.0  # one pass
    with sdpa_kernel(SDPBackend.MATH):
        out = {}
        assert count_flops(lambda: out.setdefault("v", adapter.predict_velocity(
            model, latents, torch.full((batch,), 500.0), embeds, guidance, None, 32, 32))) == batch * expected.total
        backward = count_flops(lambda: out["v"].float().square().mean().backward())
    assert backward == batch * expected.backward(full_finetune=full)


@pytest.mark.parametrize("family, config", [("flux2_klein", FLUX2_KLEIN_4B_TRANSFORMER), ("flux2", FLUX2_DEV_TRANSFORMER),
                                            ("zimage", ZIMAGE_TURBO_TRANSFORMER)],
                         ids=["flux2-klein-4b", "flux2-dev", "zimage-turbo"])
def test_analytic_flops_match_torch_counter_on_full_size_later_families(family, config):
    """FLUX.2 [klein] 4B, FLUX.2 [dev] (32 B) and Z-Image Turbo (6 B) at full size on the meta device, at 512 px."""
    from diffusers import Flux2Transformer2DModel, ZImageTransformer2DModel

    with torch.device("meta"):
        model = (ZImageTransformer2DModel if family == "zimage" else Flux2Transformer2DModel)(**config)
    if family == "zimage":  # 64x64 latents (1024 patches); a 100-token prompt (both padded to multiples of 32)
        n_img, n_txt = 1024, 100
        args = ([torch.empty(16, 1, 64, 64, device="meta")], torch.empty(1, device="meta"),
                [torch.empty(n_txt, 2560, device="meta")])
        kwargs = {}
    else:  # 32x32 packed tokens (FLUX.2 [dev]: plus one 512 px reference image); 512 padded text tokens
        n_img, n_txt = (2048 if family == "flux2" else 1024), 512
        args = ()
        kwargs = dict(hidden_states=torch.empty(1, n_img, 128, device="meta"), timestep=torch.empty(1, device="meta"),
                      guidance=torch.empty(1, device="meta") if family == "flux2" else None,
                      encoder_hidden_states=torch.empty(1, n_txt, config["joint_attention_dim"], device="meta"),
                      txt_ids=torch.zeros(1, n_txt, 4, device="meta"), img_ids=torch.zeros(1, n_img, 4, device="meta"))
    expected = transformer_forward_flops(family, dict(model.config), n_img, n_txt)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert count_flops(model, *args, **kwargs) == expected.total
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert {"flux2_klein": 3.8 < params < 4.0, "flux2": 31 < params < 33, "zimage": 6.0 < params < 6.3}[family], params


@pytest.mark.parametrize("family", ["qwenimage21", "qwenimage_edit_plus"])
def test_analytic_flops_match_torch_counter_on_full_size_qwenimage21_and_edit_plus(family, monkeypatch):
    """Qwen-Image 2.1 (7.1 B) with a 40-token prompt, and Qwen-Image (20 B) editing with two source images, at 512 px
    on the meta device. Qwen-Image 2.1 locates its image tokens with data-dependent ops (``nonzero``), so its masks
    are real CPU tensors; the one place they meet the weights (selecting the modulation rows, element-wise, no
    FLOPs) gets the mask on the weights' device."""
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel

    from flowgrpo.benchmarking.full_size_families import QWENIMAGE21_TRANSFORMER

    if family == "qwenimage21":
        import diffusers.models.transformers.transformer_qwenimage21 as module

        select = module._select_modulation_rows
        monkeypatch.setattr(module, "_select_modulation_rows",
                            lambda params, mask: select(params, None if mask is None else mask.to(params.device)))
        with torch.device("meta"):
            model = QwenImage21Transformer2DModel(**QWENIMAGE21_TRANSFORMER)
        n_img, n_txt = 1024, 40
        img_mask = torch.cat([torch.zeros(1, n_txt, dtype=torch.bool), torch.ones(1, n_img // 4, dtype=torch.bool)], 1)
        kwargs = dict(hidden_states=torch.empty(1, n_img, 64, device="meta"), timestep=torch.empty(1, device="meta"),
                      encoder_hidden_states=torch.empty(1, n_txt, 4096, device="meta"), img_shapes=[[(1, 32, 32)]],
                      img_mask=img_mask)
    else:
        with torch.device("meta"):
            model = QwenImageTransformer2DModel(**QWEN_IMAGE_TRANSFORMER)
        n_img, n_txt = 3 * 1024, 120  # the target and two sources of 32x32 packed tokens
        kwargs = dict(hidden_states=torch.empty(1, n_img, 64, device="meta"), timestep=torch.empty(1, device="meta"),
                      encoder_hidden_states=torch.empty(1, n_txt, 3584, device="meta"),
                      encoder_hidden_states_mask=None, img_shapes=[[(1, 32, 32)] * 3])
    expected = transformer_forward_flops(family, dict(model.config), n_img, n_txt)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert count_flops(model, **kwargs) == expected.total
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert (7.0 < params < 7.2) if family == "qwenimage21" else (20 < params < 21), params


def test_step_flops_counts_calls_and_cfg():
    fwd = transformer_forward_flops("sd3", dict(SD35M_TRANSFORMER), 1024, 333, 32, LORA_TARGETS)
    plain = step_flops(fwd, micro_batches=8, micro_batch_size=8, num_inference_steps=10, trained_steps=3, cfg=False)
    assert (plain.rollout_forwards, plain.training_passes, plain.reference_forwards) == (80, 24, 0)
    assert plain.rollout == 80 * 8 * fwd.total
    assert plain.training == 24 * 8 * (fwd.total + fwd.backward())
    cfg = step_flops(fwd, micro_batches=8, micro_batch_size=8, num_inference_steps=10, trained_steps=3, cfg=True,
                     beta=0.04, gradient_checkpointing=True)
    assert cfg.batch_per_call == 16 and cfg.rollout == 2 * plain.rollout
    assert cfg.training == 24 * 16 * (2 * fwd.total + fwd.backward())
    assert cfg.reference == 24 * 16 * fwd.base
    assert cfg.total == cfg.rollout + cfg.training + cfg.reference
    # LoRA training: the backward is well under the "2 x forward" of full training, more than one forward.
    assert fwd.total < fwd.backward() < fwd.backward(full_finetune=True)


def test_gpu_presets_match_the_issue():
    sd = get_preset("sd35m-random")
    cfg = SD35M_TRANSFORMER
    assert (cfg["num_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"]) == (24, 24, 64)
    assert (cfg["joint_attention_dim"], cfg["caption_projection_dim"], cfg["pooled_projection_dim"]) == (4096, 1536,
                                                                                                          2048)
    assert cfg["dual_attention_layers"] == list(range(13)) and cfg["qk_norm"] == "rms_norm"
    for preset in (sd, get_preset("flux-random")):
        assert preset.device == "cuda" and preset.dtype == "bfloat16" and preset.resolution == 512
        assert (preset.num_prompts, preset.num_generations, preset.num_inference_steps) == (8, 8, 10)
        assert preset.sde_window_size == 3 and preset.reward == "ocr"
        kwargs = preset.config_kwargs()
        assert kwargs["gradient_accumulation_steps"] * kwargs["per_device_train_batch_size"] == 64
    small = get_preset("small-cpu")
    assert (small.resolution, small.num_prompts, small.num_generations, small.num_inference_steps,
            small.sde_window_size, small.reward) == (128, 2, 4, 6, 2, "ocr")
    assert set(PRESETS) >= {"tiny", "small-cpu", "toy", "sd35m-random", "flux-random", "qwenimage-random", "wan-random"}
    toy = get_preset("toy")  # the settings of recipes/toy.yaml
    assert (toy.resolution, toy.num_prompts, toy.num_generations, toy.num_inference_steps, toy.sde_window_size,
            toy.guidance_scale, toy.reward, toy.reward_weights) == (32, 4, 8, 8, 2, 3.0,
                                                                    ("toy_shape_score", "toy_color"), (1.0, 0.5))
    assert all(p.threads == "auto" for p in PRESETS.values())
    qwen, wan = get_preset("qwenimage-random"), get_preset("wan-random")
    assert (qwen.family, wan.family) == ("qwenimage", "wan") and wan.lora_targets == WAN_LORA_TARGETS
    assert wan.config_kwargs()["num_frames"] == 33 and wan.config_kwargs()["width"] == 832


def test_gpu_presets_fail_clearly_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("sd35m-random", "flux-random", "qwenimage-random", "wan-random", "flux2-klein-random", "flux2-random",
                 "zimage-random", "qwenimage21-random", "qwenimage-edit-plus-random",
                 "wan-i2v-random"):
        with pytest.raises(RuntimeError, match=r"CUDA GPU.*small-cpu"):
            build_preset_pipeline(get_preset(name))


@pytest.mark.parametrize("name", ["sd35m-random", "flux-random", "qwenimage-random", "wan-random", "flux2-klein-random",
                                  "flux2-random", "zimage-random", "qwenimage21-random", "qwenimage-edit-plus-random",
                                  "wan-i2v-random"])
def test_full_size_pipelines_build_on_the_meta_device(name):
    """The GPU presets' build code, on the meta device: the configs make valid pipelines of the real sizes."""
    from flowgrpo.benchmarking.presets import _build_full_size
    from flowgrpo.models import get_family_adapter

    pipe = _build_full_size(get_preset(name), seed=0, device="meta")
    sizes = {k: sum(p.numel() for p in v.parameters()) / 1e9 for k, v in pipe.components.items()
             if isinstance(v, torch.nn.Module)}
    assert get_family_adapter(pipe).family == get_preset(name).family
    assert all(p.dtype == torch.bfloat16 for p in pipe.transformer.parameters())
    if name == "sd35m-random":
        assert 2.2 < sizes["transformer"] < 2.6 and 4.6 < sizes["text_encoder_3"] < 4.9  # SD3.5-M, T5-XXL encoder
        assert 0.6 < sizes["text_encoder_2"] < 0.75 and 0.1 < sizes["text_encoder"] < 0.15  # CLIP-G, CLIP-L
    elif name == "flux-random":
        assert 11.5 < sizes["transformer"] < 12.2 and 4.6 < sizes["text_encoder_2"] < 4.9
    elif name == "qwenimage-random":  # Qwen-Image 20 B, Qwen2.5-VL-7B (with its vision tower), the 127 M VAE
        assert 20 < sizes["transformer"] < 21 and 8.0 < sizes["text_encoder"] < 8.5 and 0.1 < sizes["vae"] < 0.15
    elif name == "flux2-klein-random":  # FLUX.2 [klein] 4B, Qwen3-4B, the 84 M FLUX.2 VAE
        assert 3.8 < sizes["transformer"] < 4.0 and 3.9 < sizes["text_encoder"] < 4.5 and 0.08 < sizes["vae"] < 0.09
    elif name == "flux2-random":  # FLUX.2 [dev] 32 B, Mistral Small 3.1 24 B with its Pixtral tower
        assert 31 < sizes["transformer"] < 33 and 23.5 < sizes["text_encoder"] < 24.5
    elif name == "zimage-random":  # Z-Image Turbo 6.2 B, Qwen3-4B (the model, without the LM head), the FLUX.1 VAE
        assert 6.0 < sizes["transformer"] < 6.3 and 3.9 < sizes["text_encoder"] < 4.1 and 0.08 < sizes["vae"] < 0.09
    elif name == "wan-i2v-random":  # Wan 2.1 I2V-14B (16.4 B with the image keys / values), ViT-H/14, UMT5-XXL
        assert 16.0 < sizes["transformer"] < 16.8 and 0.6 < sizes["image_encoder"] < 0.7
        assert 5.5 < sizes["text_encoder"] < 5.9 and 0.1 < sizes["vae"] < 0.15
        adapter = get_family_adapter(pipe, num_frames=33)
        assert adapter.uses_image_encoder and adapter.sde_scheduler_config()["shift"] == 3.0
    elif name == "qwenimage21-random":  # Qwen-Image 2.1 7.1 B, Qwen3-VL-8B (with its vision tower)
        assert 7.0 < sizes["transformer"] < 7.2 and 8.5 < sizes["text_encoder"] < 9.0
    elif name == "qwenimage-edit-plus-random":  # the Qwen-Image model and encoder, with the processor
        assert 20 < sizes["transformer"] < 21 and 8.0 < sizes["text_encoder"] < 8.5 and pipe.processor is not None
    else:  # Wan 2.1 1.3 B, UMT5-XXL encoder, the 127 M VAE; the UniPC schedule keeps its flow_shift
        assert 1.3 < sizes["transformer"] < 1.5 and 5.5 < sizes["text_encoder"] < 5.9 and 0.1 < sizes["vae"] < 0.15
        adapter = get_family_adapter(pipe, num_frames=33)
        assert adapter.sde_scheduler_config()["shift"] == 3.0
    if name not in ("wan-random", "qwenimage21-random", "wan-i2v-random"):
        assert pipe.vae_scale_factor == 8


def test_small_cpu_transformer_size():
    from diffusers import SD3Transformer2DModel

    from flowgrpo.benchmarking.presets import SMALL_CPU_TRANSFORMER

    with torch.device("meta"):
        model = SD3Transformer2DModel(**SMALL_CPU_TRANSFORMER)
    assert 30e6 <= sum(p.numel() for p in model.parameters()) <= 50e6


def _run_script(capsys, *args) -> tuple[int, str, str]:
    """``scripts/benchmark.py``'s ``main`` in this process (the script's own code, without a second interpreter's
    start-up): returns the exit status, stdout and stderr."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    status = script.main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_script_refuses_gpu_preset_without_cuda(capsys):
    status, _, err = _run_script(capsys, "--preset", "sd35m-random", "--steps", "1")
    assert status == 2
    assert "CUDA" in err and "Traceback" not in err


def test_tiny_preset_smoke(tmp_path, capsys):
    """One measured step of the tiny preset through the script; the JSON is complete and self-consistent."""
    out = tmp_path / "bench.json"
    status, stdout, err = _run_script(capsys, "--preset", "tiny", "--steps", "1", "--warmup-steps", "0", "--json",
                                      str(out))
    assert status == 0, err[-4000:]
    assert "overhead_ratio" in stdout
    result = json.loads(out.read_text())
    for key in ("step_time_s", "images_per_s", "peak_memory_mb", "breakdown", "floor_time_s", "overhead_ratio"):
        assert key in result, key
    assert result["preset"] == "tiny" and result["steps"] == 1 and len(result["step_times_s"]) == 1
    step = result["step_time_s"]
    assert step > 0 and result["floor_time_s"] > 0 and result["peak_memory_mb"] > 0
    assert result["images_per_s"] == pytest.approx(result["images_per_step"] / step)
    assert result["overhead_ratio"] == pytest.approx(step / result["floor_time_s"])
    breakdown = result["breakdown"]
    assert set(breakdown) == {"text_encoding", "rollout", "vae_decode", "reward", "training_forward",
                              "training_backward", "optimizer", "other"}
    assert sum(breakdown.values()) == pytest.approx(step, rel=1e-6)  # one step: "other" closes the sum
    assert all(v >= 0 for k, v in breakdown.items() if k != "other")
    assert result["breakdown"]["rollout"] > 0 and result["breakdown"]["training_backward"] > 0
    flops = result["flops"]
    assert flops["rollout_forwards"] == 2 * 4 and flops["training_passes"] == 2 * 2
    assert flops["total"] == flops["rollout"] + flops["training"] + flops["reference"]
    assert result["achieved_flops_per_s"] == pytest.approx(flops["total"] / step)


def test_tiny_preset_times_train_timesteps_per_pass_side_by_side(tmp_path, capsys):
    """``--ab timesteps_per_pass``: K = all and 1 on alternate steps, each arm's training phase and its floor's; and
    ``--passes-rounds``: one more generation's training phase at each K, nothing in the background."""
    out = tmp_path / "bench.json"
    status, stdout, err = _run_script(capsys, "--preset", "tiny", "--steps", "2", "--warmup-steps", "0", "--ab",
                                      "timesteps_per_pass", "--passes-rounds", "1", "--json", str(out))
    assert status == 0, err[-4000:]
    result = json.loads(out.read_text())
    ab = result["ab"]
    assert ab["switches"] == ["train_timesteps_per_pass: all (on) / 1 (off)"]
    for arm in ("on", "off"):
        assert ab[arm]["steps"] == 1 and len(ab[arm]["training_phase_s"]) == 1
        assert ab[arm]["training_phase_s"][0] > 0 and ab[arm]["floor_training_s"][0] > 0
    passes = result["timesteps_per_pass"]
    assert passes["trained_timesteps"] == 2 and passes["rounds"] == 1
    assert [passes["arms"][k]["passes_per_micro_batch"] for k in ("1", "all")] == [2, 1]
    # 2 images a micro-batch without CFG: the embedders' 2-row matmuls change kernels at 4 rows (the last bit only)
    assert all(passes["arms"][k]["on_policy_ratio_max_dev"] <= 1e-6 for k in ("1", "all"))
    assert "training phase of one generation" in stdout


def test_overhead_bound_prices_the_background_at_the_main_threads_second_core():
    """Each core-second of background work costs at least 1 - 1/s of the main thread's time, s the smaller speed-up;
    a main thread that gains nothing from its threads pays nothing."""
    overlapped = {"reward_compute_s": 0.3, "vae_decode_s": 0.1, "sampling_s": 2.0, "training_s": 1.0}
    assert overhead_bound(overlapped, 2.0, {"rollout": 1.6, "training": 2.0}) == pytest.approx(1 + 0.4 * 0.375 / 2)
    assert overhead_bound(overlapped, 2.0, {"rollout": 0.9, "training": 1.5}) == 1.0


def test_thread_speedup_needs_a_cpu_floor(capsys):
    status, _out, err = _run_script(capsys, "--preset", "tiny", "--steps", "1", "--no-floor", "--thread-speedup")
    assert status == 2 and "thread_speedup" in err and "--no-floor" in err


def test_tiny_preset_reports_the_thread_timeline_where_the_main_thread_yields(tmp_path, capsys, monkeypatch):
    """Where the main thread yields to the background (here: the tiny model treated as large, 2 cores), every
    measured step reports how long the main thread ran at each thread count against the busy background tasks; the
    states add up to about the step's time (the floor measurement is excluded)."""
    import flowgrpo.cpu_threads as cpu_threads

    previous_threads, previous_plan = torch.get_num_threads(), cpu_threads.current_cpu_thread_plan()
    monkeypatch.setattr(cpu_threads, "ALL_CORES_MIN_PARAMETERS", 0)
    monkeypatch.setenv(cpu_threads.CPU_THREADS_ENV, "2")
    monkeypatch.delenv(cpu_threads.CPU_SPLIT_ENV, raising=False)
    out = tmp_path / "bench.json"
    try:
        status, stdout, err = _run_script(capsys, "--preset", "tiny", "--steps", "2", "--warmup-steps", "1",
                                          "--json", str(out), "--thread-speedup")
    finally:
        torch.set_num_threads(previous_threads)
        cpu_threads.apply_cpu_thread_plan(previous_plan)
    assert status == 0, err[-4000:]
    result = json.loads(out.read_text())
    # The floor timed at 1 and 2 threads (the tiny model gains little or loses from a second thread: only the
    # bookkeeping is checked here), and the bound it gives.
    speedup = result["floor_thread_speedup"]
    assert speedup["threads"] == 2 and speedup["rounds"] == 2
    for phase in ("rollout", "training", "total"):
        times = speedup[f"{phase}_s"]
        assert speedup[phase] == pytest.approx(times["1"] / times["2"]) and times["1"] > 0 and times["2"] > 0
    assert result["overhead_bound"] == pytest.approx(overhead_bound(result["overlapped"], result["floor_time_s"],
                                                                    speedup))
    assert result["overhead_bound"] >= 1.0 and "overhead_bound" in stdout
    timeline = result["thread_timeline_s"]
    assert "main=2 busy=0" in timeline and all(v >= 0 for v in timeline.values())
    assert set(timeline) <= {f"main={m} busy={b}" for m in (1, 2) for b in (0, 1, 2)}
    mean_step = sum(result["step_times_s"]) / len(result["step_times_s"])
    assert sum(timeline.values()) == pytest.approx(mean_step, rel=0.05, abs=0.02)
    assert "busy background tasks" in stdout


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
@pytest.mark.parametrize("variant", [None, "ti2v"], ids=["wan21_i2v", "ti2v"])
def test_analytic_flops_match_torch_counter_on_tiny_wan_i2v(variant, full, tiny_pipeline_path):
    """Wan image-to-video through its adapter (36 input channels; Wan 2.1: CLIP image tokens with their own keys and
    values in every cross-attention), forward and backward, LoRA on the family's default targets or full fine-tuning.
    TI2V (per-token timesteps) runs its time embedding on every token: not in the per-sample count, so only the
    block-level counts are compared there (the embedder rows are checked to be the difference)."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model
    from PIL import Image

    from flowgrpo.models import get_family_adapter

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path("wan_i2v", variant)))
    adapter = get_family_adapter(pipe, num_frames=5)
    targets = list(adapter.default_lora_target_modules)
    cpu = torch.device("cpu")
    sources = [Image.new("RGB", (32, 32), (200, 30, 30)), Image.new("RGB", (32, 32), (30, 30, 200))]
    with torch.no_grad():
        embeds = adapter.encode_prompts(["a cat", "a dog"], 512, cpu, images=sources, height=32, width=32)
    latents = adapter.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0), cpu, torch.float32)
    n_img, n_txt = adapter.sequence_lengths(embeds, latents)
    assert n_img == 8 and n_txt == (512 + 17 if variant is None else 512)  # 2 frames of 2x2; 17 CLIP tokens
    config = dict(pipe.transformer.config)
    if full:
        model, expected = pipe.transformer.requires_grad_(True), transformer_forward_flops("wan_i2v", config, n_img,
                                                                                            n_txt)
    else:
        model = get_peft_model(pipe.transformer, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        expected = transformer_forward_flops("wan_i2v", config, n_img, n_txt, lora_rank=4, lora_targets=targets)
        assert expected.lora > 0
    extra = 0
    if variant == "ti2v":  # the time embedding's three linears run on all n_img tokens instead of once
        d = config["num_attention_heads"] * config["attention_head_dim"]
        extra = 2 * (n_img - 1) * (config["freq_dim"] * d + d * d + d * 6 * d)
    with sdpa_kernel(SDPBackend.MATH):
        out = {}
        assert count_flops(lambda: out.setdefault("v", adapter.predict_velocity(
            model, latents, torch.full((2,), 500.0), embeds, 1.0, None, 32, 32))) == 2 * (expected.total + extra)
        backward = count_flops(lambda: out["v"].float().square().mean().backward())
    if variant is None:  # (TI2V's per-token conditioning changes what the backward reaches)
        assert backward == 2 * expected.backward(full_finetune=full)


def test_analytic_flops_match_torch_counter_on_full_size_wan_i2v():
    """Wan 2.1 I2V-14B at full size on the meta device: 33 frames of 480x832, 257 CLIP tokens and 512 text tokens."""
    from diffusers import WanTransformer3DModel

    from flowgrpo.benchmarking.full_size_video import WAN_I2V_14B_TRANSFORMER

    with torch.device("meta"):
        model = WanTransformer3DModel(**WAN_I2V_14B_TRANSFORMER)
    n_img, n_txt = 9 * 30 * 52, 257 + 512
    kwargs = dict(hidden_states=torch.empty(1, 36, 9, 60, 104, device="meta"), timestep=torch.empty(1, device="meta"),
                  encoder_hidden_states=torch.empty(1, 512, 4096, device="meta"),
                  encoder_hidden_states_image=torch.empty(1, 257, 1280, device="meta"))
    expected = transformer_forward_flops("wan_i2v", dict(model.config), n_img, n_txt)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        assert count_flops(model, **kwargs) == expected.total
    params = sum(p.numel() for p in model.parameters()) / 1e9
    assert 16.0 < params < 16.8, params  # 14B blocks plus the image keys / values: 16.4 B
