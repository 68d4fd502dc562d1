"""The offline tiny pipelines of every family: build, save, reload with stock diffusers, generate, tokenize,
determinism."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    FluxKontextPipeline,
    FluxPipeline,
    QwenImageEditPipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    WanPipeline,
)
from PIL import Image

from flowgrpo.testing import TINY_FAMILIES, build_tiny_pipeline, cached_tiny_pipeline_path, save_tiny_pipeline
from flowgrpo.testing.tiny_qwenimage import ImageOnlyQwen2VLProcessor
from flowgrpo.testing.tiny_tokenizers import QWEN_TEMPLATE_PREFIXES

REPO_ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [
    'a sign that says "OPEN 24 HOURS"',
    "a chalkboard with the words 'Happy Birthday!' written on it",
    "it's 10:45, isn't it? we'll see; they're late & you've 3.5% left...",
    "a price tag: $19.99 (was $25), item #42 - 50% off [final] {sale} <new>",
    "A Photo Of 2 Cats And 1 Dog, f/1.8, 85mm; e = mc^2 @ home ~ 100/100",
    "zebra quokka xylophone jigsaw",
]
CURLY_PROMPTS = ["a storefront with “Bakery & Café” above the door", "a neon sign that says ‘Let’s dance…’"]


@pytest.fixture(scope="module")
def loaded(tiny_pipeline_path):
    """Every tiny pipeline as stock ``DiffusionPipeline.from_pretrained`` loads it from disk."""
    return {family: DiffusionPipeline.from_pretrained(tiny_pipeline_path(family)) for family in TINY_FAMILIES}


def _squash(text: str) -> str:
    return "".join(unicodedata.normalize("NFKC", text).lower().split())


def _clip_tokenizers(loaded):
    return [loaded["sd3"].tokenizer, loaded["sd3"].tokenizer_2, loaded["flux"].tokenizer]


def _t5_tokenizers(loaded):
    return [loaded["sd3"].tokenizer_3, loaded["flux"].tokenizer_2]


def _state(pipe) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)
            for key, value in module.state_dict().items()}


def _folder_bytes(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


# --- loading and generation -----------------------------------------------------------------------------------------


def test_reloads_as_stock_pipelines(loaded):
    sd3, flux = loaded["sd3"], loaded["flux"]
    assert isinstance(sd3, StableDiffusion3Pipeline) and isinstance(flux, FluxPipeline)
    t5_width = sd3.text_encoder_3.config.d_model
    assert sd3.transformer.config.joint_attention_dim == t5_width
    assert sd3.transformer.config.pooled_projection_dim == (
        sd3.text_encoder.config.projection_dim + sd3.text_encoder_2.config.projection_dim)
    assert sd3.text_encoder.config.hidden_size + sd3.text_encoder_2.config.hidden_size <= t5_width
    assert flux.transformer.config.joint_attention_dim == flux.text_encoder_2.config.d_model
    assert flux.transformer.config.pooled_projection_dim == flux.text_encoder.config.hidden_size
    assert flux.scheduler.config.use_dynamic_shifting and sd3.scheduler.config.shift == 3.0
    for pipe in (sd3, flux):
        assert pipe.vae_scale_factor == 8
        assert all(p.dtype == torch.float32 for _, m in pipe.components.items() if isinstance(m, torch.nn.Module)
                   for p in m.parameters())


def test_newer_families_reload_as_stock_pipelines(loaded):
    qwen, edit, wan, kontext = (loaded[f] for f in ("qwenimage", "qwenimage_edit", "wan", "flux_kontext"))
    assert isinstance(qwen, QwenImagePipeline) and isinstance(edit, QwenImageEditPipeline)
    assert isinstance(wan, WanPipeline) and isinstance(kontext, FluxKontextPipeline)
    assert isinstance(edit.processor, ImageOnlyQwen2VLProcessor) and edit.processor.tokenizer is not None
    for pipe in (qwen, edit):
        text = pipe.text_encoder.config.text_config
        assert pipe.transformer.config.joint_attention_dim == text.hidden_size
        assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
        assert pipe.vae_scale_factor == 8 and not pipe.transformer.config.guidance_embeds
        assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift_terminal == 0.02
    assert wan.transformer.config.text_dim == wan.text_encoder.config.d_model
    assert (wan.vae_scale_factor_temporal, wan.vae_scale_factor_spatial) == (4, 8)
    assert wan.transformer_2 is None and wan.config.boundary_ratio is None
    assert any(n.endswith("attn1.to_q") for n, _ in wan.transformer.named_modules())
    assert kontext.transformer.config.guidance_embeds  # FLUX.1-dev style guidance embedding, as Kontext [dev]


def test_qwen_template_prefixes_have_exactly_the_dropped_token_counts(loaded):
    """The Qwen pipelines cut a fixed number of hidden states (their system prompt): the tokenizer must agree."""
    for family, pipe in (("qwenimage", loaded["qwenimage"]), ("qwenimage_edit", loaded["qwenimage_edit"])):
        prefix, count = QWEN_TEMPLATE_PREFIXES[family]
        assert pipe.prompt_template_encode.startswith(prefix)
        assert pipe.prompt_template_encode_start_idx == count == len(pipe.tokenizer(prefix).input_ids)
        for prompt in PROMPTS + CURLY_PROMPTS:
            text = pipe.prompt_template_encode.format(prompt)
            full = pipe.tokenizer(text).input_ids
            assert pipe.tokenizer.decode(full[count:]) == text[len(prefix):]  # the cut falls right after the prefix
            ids = pipe.tokenizer(prompt).input_ids
            assert pipe.tokenizer.decode(ids) == prompt and len(ids) < len(prompt.encode("utf-8"))
    image_pad = loaded["qwenimage_edit"].tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert loaded["qwenimage_edit"].text_encoder.config.image_token_id == image_pad


def test_two_expert_wan_variant(tiny_pipeline_path):
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline_path("wan", "two_experts"))
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2 is not None
    first, second = (dict(t.named_parameters()) for t in (pipe.transformer, pipe.transformer_2))
    assert first.keys() == second.keys() and any(not torch.equal(first[k], second[k]) for k in first)
    with pytest.raises(ValueError, match="two_experts"):
        build_tiny_pipeline("wan", variant="three_experts")
    with pytest.raises(ValueError, match="no variants"):
        build_tiny_pipeline("sd3", variant="two_experts")


def _family_kwargs(family: str, size: tuple[int, int], batch: int) -> dict:
    """What each family's call needs besides the prompt: frames (Wan), a source image (the editing pipelines)."""
    source = Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size, 3), dtype=np.uint8))
    if family == "wan":
        return {"num_frames": 5}
    if family == "hunyuanvideo15":  # its guider holds the guidance scale; no max_sequence_length argument
        return {"num_frames": 5, "negative_prompt": [""] * batch}
    if family == "ltx2":  # CFG only; 5 frames (the tiny VAE compresses time 2x)
        return {"num_frames": 5, "frame_rate": 24.0, "guidance_scale": 3.0, "stg_scale": 0.0, "modality_scale": 1.0,
                "guidance_rescale": 0.0, "audio_guidance_scale": 3.0, "audio_stg_scale": 0.0,
                "audio_modality_scale": 1.0, "audio_guidance_rescale": 0.0, "negative_prompt": [""] * batch}
    if family == "wan_i2v":  # the first frame (for the one prompt of a call)
        return {"num_frames": 5, "image": source, "negative_prompt": [""] * batch}
    if family == "flux_kontext":
        return {"image": [source] * batch, "max_area": size[0] * size[1], "_auto_resize": False}
    if family == "qwenimage_edit":
        return {"image": [source] * batch}
    if family == "qwenimage_edit_plus":  # two source images (for the one prompt of a call)
        return {"image": [source, source.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]}
    if family == "qwenimage21":  # true CFG by its own name; no max_sequence_length; its sample_sigmas set the steps
        return {"true_cfg_scale": 3.5, "negative_prompt": [""] * batch}
    return {"guidance_scale": 3.5}


def _generate(pipe, family: str, prompts: list[str], size: tuple[int, int], **kwargs):
    """One call of the family's pipeline (Qwen-Image-Edit-Plus and Wan image-to-video take one prompt per call: one
    call per prompt)."""
    if family in ("qwenimage_edit_plus", "wan_i2v", "hunyuanvideo15"):  # (HunyuanVideo 1.5: its VAE decodes one)
        outs = [_generate(pipe, f"{family}_one", [p], size, **kwargs) for p in prompts]
        return np.concatenate(outs) if isinstance(outs[0], np.ndarray) else torch.cat(outs)
    if family == "wan_i2v_one":  # Wan 2.1 I2V's attention assumes 512 text tokens next to the image tokens
        kwargs["max_sequence_length"] = 512
    if family in ("qwenimage21", "hunyuanvideo15_one"):
        kwargs.pop("max_sequence_length", None)
    out = pipe(prompt=prompts, height=size[0], width=size[1], **kwargs,
               **_family_kwargs(family.removesuffix("_one"), size, len(prompts)))
    return out.frames if family in ("wan", "wan_i2v_one", "ltx2", "hunyuanvideo15_one") else out.images


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_generates_finite_images_of_requested_size(loaded, family, monkeypatch):
    pipe = loaded[family]
    pipe.set_progress_bar_config(disable=True)
    if family == "qwenimage_edit":  # its call resizes the source to ~1024^2 (slow on a CPU); keep it at 64 px
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_module

        monkeypatch.setattr(edit_module, "calculate_dimensions", lambda area, ratio: (64, 64, None))
    if family == "qwenimage_edit_plus":  # the same for its sources (~384^2 for the encoder, ~1024^2 for the VAE)
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module

        monkeypatch.setattr(plus_module, "calculate_dimensions", lambda area, ratio: (64, 64))
    channels = 4 if family == "qwenimage21" else 3  # Qwen-Image 2.1's VAE decodes RGBA
    out = _generate(pipe, family, ["a red circle above a blue square", 'a sign that says "HELLO"'], (64, 64),
                    num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0))
    images = out[:, 2] if family in ("wan", "wan_i2v", "ltx2", "hunyuanvideo15") else out  # videos: the middle of 5 frames
    assert images.shape == (2, 64, 64, channels)
    assert np.isfinite(images).all()
    assert np.abs(images[0] - images[1]).mean() > 1e-3  # different prompts and noise, different images
    if family in ("qwenimage_edit", "qwenimage_edit_plus"):
        return
    # Two steps: with one, Qwen-Image's shift_terminal stretch divides 0 by 0 (NaN sigmas, a diffusers limit)
    size = (32, 64) if family in ("qwenimage21", "ltx2", "hunyuanvideo15") else (32, 48)  # Qwen-Image 2.1, LTX-2: sides of 32k
    small = _generate(pipe, family, ["a green star"], size, num_inference_steps=2, max_sequence_length=32,
                      output_type="pt", generator=torch.Generator().manual_seed(1))
    expected = (1, 5, 3, *size) if family in ("wan", "wan_i2v", "ltx2", "hunyuanvideo15") else (1, channels, *size)
    assert small.shape == expected and torch.isfinite(small).all()


# --- tokenizers ------------------------------------------------------------------------------------------------------


def test_clip_tokenizers_round_trip_without_unknowns(loaded):
    for tokenizer in _clip_tokenizers(loaded):
        assert tokenizer.model_max_length == 77
        for prompt in PROMPTS + CURLY_PROMPTS:
            ids = tokenizer(prompt).input_ids
            assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
            assert tokenizer.unk_token_id not in ids[1:-1], prompt  # CLIP's unknown token is <|endoftext|>
            assert len(ids) < len(prompt.encode("utf-8")) + 2  # merges were learned, not one token per byte
            # Decode without dropping special tokens: SD3's second tokenizer pads with "!", which is a real character.
            assert _squash(tokenizer.decode(ids[1:-1])) == _squash(prompt)


def test_t5_tokenizers_round_trip_without_unknowns(loaded):
    for tokenizer in _t5_tokenizers(loaded):
        assert tokenizer.model_max_length == 512
        assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
        for prompt in PROMPTS + CURLY_PROMPTS:
            ids = tokenizer(prompt).input_ids
            assert ids[-1] == tokenizer.eos_token_id
            assert tokenizer.unk_token_id not in ids, (prompt, tokenizer.convert_ids_to_tokens(ids))
            assert _squash(tokenizer.decode(ids, skip_special_tokens=True)) == _squash(prompt)
        padded = tokenizer(PROMPTS[:2], padding="max_length", max_length=32, truncation=True).input_ids
        assert all(len(row) == 32 for row in padded)


def test_saved_tokenizers_match_in_memory_ones(loaded):
    fresh = build_tiny_pipeline("sd3")
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        for prompt in PROMPTS:
            assert getattr(fresh, name)(prompt).input_ids == getattr(loaded["sd3"], name)(prompt).input_ids


# --- determinism -----------------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_weights_and_different_seed_different_weights():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = _state(build_tiny_pipeline("flux", seed=0))
    assert torch.equal(torch.rand(3), expected)  # the caller's random stream is untouched

    second = _state(build_tiny_pipeline("flux", seed=0))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)

    other = _state(build_tiny_pipeline("flux", seed=1))
    for component in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        keys = [key for key in first if key.startswith(component + ".")]
        assert any(not torch.equal(first[key], other[key]) for key in keys), component


def test_cli_writes_the_same_folder_as_the_library(tiny_sd3_path, tmp_path):
    output = tmp_path / "cli-sd3"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "make_tiny_pipeline.py"),
                             "--family", "sd3", "--output", str(output), "--seed", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert str(output) in result.stdout and "MB" in result.stdout
    # Another process, same seed: bit-identical weights, tokenizers and configs.
    assert _folder_bytes(output) == _folder_bytes(tiny_sd3_path)



def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_pipeline", REPO_ROOT / "scripts" / "make_tiny_pipeline.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_cli_builds_every_family_and_variant(tmp_path, capsys):
    script = _script()
    assert script.main(["--family", "wan", "--variant", "two_experts", "--output", str(tmp_path / "wan22")]) == 0
    assert "two_experts" in capsys.readouterr().out
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "wan22")
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.875
    assert script.main(["--family", "wan_i2v", "--variant", "ti2v", "--output", str(tmp_path / "ti2v")]) == 0
    pipe = DiffusionPipeline.from_pretrained(tmp_path / "ti2v")
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and pipe.config.expand_timesteps
    assert pipe.image_encoder is None and pipe.transformer.config.in_channels == pipe.vae.config.z_dim
    with pytest.raises(SystemExit):
        script.main(["--family", "qwenimage", "--variant", "two_experts", "--output", str(tmp_path / "x")])
    assert "no variants" in capsys.readouterr().err


def test_cli_refuses_a_non_empty_output(tmp_path, capsys):
    script = _script()
    (tmp_path / "taken.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--family", "flux", "--output", str(tmp_path)])
    assert exit_info.value.code != 0 and "not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["taken.txt"]


def test_saved_folder_is_small(tiny_pipeline_path):
    for family in TINY_FAMILIES:
        path = tiny_pipeline_path(family)
        size = sum(len(data) for data in _folder_bytes(path).values())
        # HunyuanVideo 1.5's ByT5 projection has a hidden width fixed at 2048 in diffusers (4.2 M weights, 17 MB).
        limit = 20 * 2**20 if family == "hunyuanvideo15" else 6 * 2**20
        assert size < limit, (path, size)


# --- caching ---------------------------------------------------------------------------------------------------------


def test_cache_is_reused_and_survives_a_race(tmp_path):
    results: list[Path] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker():
        try:
            barrier.wait()
            results.append(cached_tiny_pipeline_path("flux", seed=2, cache_dir=tmp_path))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert results[0] == results[1] and (results[0] / "model_index.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no staging folders left behind

    stamp = (results[0] / "model_index.json").stat().st_mtime_ns
    assert cached_tiny_pipeline_path("flux", seed=2, cache_dir=tmp_path) == results[0]
    assert (results[0] / "model_index.json").stat().st_mtime_ns == stamp
    assert cached_tiny_pipeline_path("flux", seed=3, cache_dir=tmp_path) != results[0]


def test_rejects_unknown_family_and_bad_seed(tmp_path):
    with pytest.raises(ValueError, match="sd3"):
        build_tiny_pipeline("sdxl")
    with pytest.raises(ValueError, match="seed"):
        save_tiny_pipeline("sd3", tmp_path / "x", seed=-1)


def test_recipes_can_build_every_tiny_family():
    """``build_tiny_pipeline_if_missing`` accepts every tiny family (and the toy world)."""
    from flowgrpo.cli.arguments import TINY_PIPELINE_FAMILIES

    assert set(TINY_PIPELINE_FAMILIES) == set(TINY_FAMILIES) | {"toy"}
