"""Generation settings that default to the model's own, on every tiny family (flowgrpo.models.defaults).

What must hold for each family: the defaults resolve from the component configs alone (the size as the stock pipeline
computes it, the text length, the published steps and guidance; the tiny pipelines' own ``generation_defaults.json``
where the family's size would be slow on a CPU); a short rollout at them works; each value the model cannot take is
refused when the trainer is built, from a folder that holds the configs but no weight at all, so the refusal comes
before anything is loaded; ``flowgrpo plan`` refuses the same values with the same words.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
from datasets import Dataset
from peft import LoraConfig
from support.family_cases import brightness_reward, dataset_rows

from flowgrpo import DiffusionNFTConfig, FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.models import family_adapter_class
from flowgrpo.models.defaults import (
    CHECKPOINT_DEFAULTS_FILES,
    GIVEN,
    configs_from_pipeline,
    read_model_configs,
    resolve_generation_settings,
)
from flowgrpo.testing import TINY_FAMILIES, TINY_GENERATION_DEFAULTS, TINY_VARIANTS

CASES = [(family, variant) for family in TINY_FAMILIES for variant in (None, *TINY_VARIANTS.get(family, ()))]
CASE_IDS = [family if variant is None else f"{family}-{variant}" for family, variant in CASES]

#: (steps, guidance, text tokens) each tiny pipeline resolves to: its family's published steps and guidance (the
#: model card, else the stock pipeline's call defaults; a distilled variant its few steps and no guidance) and the
#: pipeline's text length capped by its encoder.
PUBLISHED = {
    "sd3": (28, 7.0, 256), "flux": (50, 3.5, 512), "flux_kontext": (28, 2.5, 512), "qwenimage": (50, 4.0, 512),
    "qwenimage_edit": (50, 4.0, 512), "qwenimage_edit_plus": (40, 4.0, 512), "wan": (50, 5.0, 512),
    "wan-two_experts": (40, 4.0, 512), "flux2_klein": (50, 4.0, 512), "flux2_klein-distilled": (4, 1.0, 512),
    "zimage": (50, 5.0, 512), "flux2": (50, 4.0, 512), "qwenimage21": (3, 1.0, 512), "wan_i2v": (50, 5.0, 512),
    "wan_i2v-two_experts": (50, 5.0, 512), "wan_i2v-ti2v": (50, 5.0, 512), "ltx2": (30, 3.0, 256),
    "hunyuanvideo15": (50, 3.0, 1000),
}
#: Families whose stock pipeline computes its default size as default_sample_size * vae_scale_factor.
SAMPLE_SIZE_FAMILIES = ("sd3", "flux", "flux_kontext", "qwenimage", "qwenimage_edit", "qwenimage_edit_plus", "flux2",
                        "flux2_klein")


def configs_only(path: Path, target: Path) -> Path:
    """A copy of a pipeline folder with its JSON files only (model_index.json, every component's config, the
    checkpoint's own defaults) and no weight or tokenizer model: loading it fails, so an error raised on it comes from
    the checks that run before loading."""
    for source in Path(path).rglob("*.json"):
        if source.name in ("tokenizer.json", "vocab.json"):
            continue
        destination = target / source.relative_to(path)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, destination)
    return target


def _name(family: str, variant: str | None) -> str:
    return family if variant is None else f"{family}-{variant}"


@pytest.mark.parametrize("family, variant", CASES, ids=CASE_IDS)
def test_every_tiny_family_resolves_its_defaults(family, variant, tiny_pipeline_path):
    configs = read_model_configs(tiny_pipeline_path(family, variant))
    settings = resolve_generation_settings(configs, {})
    values, sources, profile = settings.values, settings.sources, settings.profile
    steps, guidance, text = PUBLISHED[_name(family, variant)]
    assert (values["num_inference_steps"], values["eval_num_inference_steps"]) == (steps, steps)
    assert (values["guidance_scale"], values["eval_guidance_scale"]) == (guidance, guidance)
    assert values["max_sequence_length"] == text == profile.text.default
    own = TINY_GENERATION_DEFAULTS.get(family, {})
    assert (values["height"], values["width"]) == ((own["resolution"],) * 2 if own else (profile.height, profile.width))
    assert values["num_frames"] == own.get("num_frames", 1)
    assert sources["height"] == ("generation_defaults.json" if own else profile.size_why)
    assert sources["num_inference_steps"] == profile.published.source and GIVEN not in sources.values()
    assert settings.warnings == []
    # without the tiny pipeline's own file: the family's size and frames
    bare = resolve_generation_settings(read_model_configs(tiny_pipeline_path(family, variant),
                                                          checkpoint_defaults=False), {"height": 32, "width": 32})
    assert bare.values["num_frames"] == profile.num_frames == (81 if family.startswith("wan") and variant != "ti2v"
                                                                else 121 if bare.profile.num_frames > 1 else 1)


@pytest.mark.parametrize("family", SAMPLE_SIZE_FAMILIES + ("hunyuanvideo15",))
def test_family_size_is_the_stock_pipelines_and_a_loaded_pipeline_reads_the_same(family, tiny_pipeline_path):
    from diffusers import DiffusionPipeline

    path = tiny_pipeline_path(family)
    pipe = DiffusionPipeline.from_pretrained(str(path))
    profile = family_adapter_class(pipe).generation_profile(read_model_configs(path, checkpoint_defaults=False))
    if family == "hunyuanvideo15":  # the 16:9 bucket of its target size, as the stock call picks it
        expected = pipe.video_processor.calculate_default_height_width(9, 16, pipe.target_size)
    else:
        expected = (pipe.default_sample_size * pipe.vae_scale_factor,) * 2
    assert (profile.height, profile.width) == tuple(expected)
    loaded = configs_from_pipeline(pipe)
    assert loaded.checkpoint_defaults == read_model_configs(path).checkpoint_defaults
    assert family_adapter_class(pipe).generation_profile(loaded) == dataclasses.replace(
        profile, pipeline_class=loaded.pipeline_class)


def _trainer(path, family: str, output_dir: Path, config_class=FlowGRPOConfig, **kwargs):
    """A trainer on the tiny pipeline with every generation setting left to the model except what ``kwargs`` gives."""
    case = type("Case", (), {"images_per_row": 2 if family == "qwenimage_edit_plus" else
                             1 if family in ("flux_kontext", "qwenimage_edit", "wan_i2v") else 0})()
    rows = dataset_rows(case, n=2)  # the editing families' source images
    args = config_class(output_dir=str(output_dir), report_to=[], per_device_train_batch_size=2, num_generations=2,
                        max_steps=1, learning_rate=1e-3, beta=0.0, save_strategy="no", disable_tqdm=True, seed=0,
                        log_images_steps=0, dtype="float32", **kwargs)
    return FlowGRPOTrainer(model=str(path), reward_funcs=brightness_reward, args=args,
                           train_dataset=Dataset.from_dict(rows),
                           peft_config=LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian"))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_rollout_at_the_defaults_works(family, tiny_pipeline_path, tmp_path, caplog):
    """One short training step at the model's own size, frames, text length and guidance. The step count is the one
    setting given (2): the families' own 28-50 steps are checked by the resolution test, and would only repeat the
    same transformer call."""
    caplog.set_level(logging.INFO, logger="flowgrpo.models.defaults")
    trainer = _trainer(tiny_pipeline_path(family), family, tmp_path, num_inference_steps=2)
    settings, args = trainer.generation_settings, trainer.args
    assert [r.getMessage() for r in caplog.records if r.name == "flowgrpo.models.defaults"] == [settings.describe()]
    assert settings is not None and settings.sources["num_inference_steps"] == GIVEN
    assert [getattr(args, name) for name in settings.values] == list(settings.values.values())  # written into args
    assert args.to_dict()["guidance_scale"] == PUBLISHED[family][1] and args.max_sequence_length == PUBLISHED[family][2]
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.state.log_history[0]["reward"] >= 0
    assert any(line.startswith("- generation: ") and "resolved from the model" in line
               for line in trainer._card_extra_sections().splitlines())


def _impossible_values(configs) -> list[tuple[dict, str]]:
    """Each value this model cannot take, with the words its refusal must hold."""
    profile = family_adapter_class(configs.pipeline_class).generation_profile(configs)
    cases = []
    if profile.size.max_side is not None:  # beyond the transformer's positional range
        side = profile.size.max_side + profile.size.multiple
        cases.append(({"height": side, "width": 32}, rf"height={side} cannot be used with .*sides end at "
                                                     rf"{profile.size.max_side}\. Allowed: multiples of "
                                                     rf"{profile.size.multiple} up to {profile.size.max_side}"))
    if profile.size.multiple > 16:  # not a multiple of the VAE factor times the patch size (the config checks 16)
        side = profile.size.multiple + 16
        cases.append(({"height": 32 if profile.size.multiple == 32 else profile.size.multiple, "width": side},
                      rf"(width={side} cannot be used with .*multiples of {profile.size.multiple}.*Use "
                      rf"{profile.size.multiple} or {2 * profile.size.multiple}|"  # or the family's own words (LTX-2)
                      rf"divisible by {profile.size.multiple}, got 32 x {side})"))
    text = profile.text
    if text.used and text.exact is not None:
        cases.append(({"max_sequence_length": 256}, rf"max_sequence_length=256 cannot be used with .*Allowed: exactly "
                                                    rf"{text.exact}"))
    elif text.used and text.limit is not None:
        cases.append(({"max_sequence_length": text.limit + 1},
                      rf"max_sequence_length={text.limit + 1} cannot be used with .*Allowed: 1 to {text.limit}\. "
                      rf"Set max_sequence_length to {text.limit} or less"))
    return cases


@pytest.mark.parametrize("family, variant", CASES, ids=CASE_IDS)
def test_impossible_values_are_refused_before_anything_loads(family, variant, tiny_pipeline_path, tmp_path):
    path = tiny_pipeline_path(family, variant)
    folder = configs_only(path, tmp_path / "configs-only")
    cases = _impossible_values(read_model_configs(folder))
    if family not in ("qwenimage21", "hunyuanvideo15"):  # the two families that do not read max_sequence_length
        assert any("max_sequence_length" in given for given, _ in cases)
    for k, (given, words) in enumerate(cases):
        with pytest.raises(ValueError, match=words):
            _trainer(folder, family, tmp_path / f"o{k}", **given)
    if not cases:
        return
    # the same refusal from the folder with weights: it is raised before anything loads there too
    given, words = cases[0]
    with pytest.raises(ValueError, match=words):
        _trainer(path, family, tmp_path / "weights", **given)


def test_the_index_unreadable_before_loading_is_resolved_right_after(tiny_pipeline_path, tmp_path, monkeypatch):
    """A Hub id not in the cache offline has no readable model_index.json before loading: the settings are resolved
    from the loaded pipeline, before any component moves to a device or any prompt is encoded."""
    import flowgrpo.trainer.online_trainer as online_trainer
    from flowgrpo.models.base import ModelFamilyAdapter

    monkeypatch.setattr(online_trainer, "read_pipeline_index", lambda model, kwargs: None)
    encoded = []
    monkeypatch.setattr(ModelFamilyAdapter, "__init__", lambda self, *a, **k: encoded.append(1))
    with pytest.raises(ValueError, match=r"max_sequence_length=513 cannot be used with .*Allowed: 1 to 512"):
        _trainer(tiny_pipeline_path("sd3"), "sd3", tmp_path / "o", max_sequence_length=513)
    assert encoded == []  # refused before the family adapter (and so before any device move or encoding)


def test_cfg_free_algorithms_and_guidance_warnings(tiny_pipeline_path, tmp_path):
    configs = read_model_configs(tiny_pipeline_path("sd3"))
    cfg_free = "DiffusionNFTConfig: CFG-free rollouts"
    settings = resolve_generation_settings(configs, {}, cfg_free=cfg_free)
    assert (settings.values["guidance_scale"], settings.values["eval_guidance_scale"]) == (1.0, 1.0)
    assert settings.sources["guidance_scale"] == cfg_free
    zimage = resolve_generation_settings(read_model_configs(tiny_pipeline_path("zimage")), {}, cfg_free=cfg_free)
    assert zimage.values["guidance_scale"] == 0.0  # Z-Image guides above 0
    flux = resolve_generation_settings(read_model_configs(tiny_pipeline_path("flux")), {}, cfg_free=cfg_free)
    assert flux.values["guidance_scale"] == 3.5  # an embedding: one pass already, the model's value is kept
    args = DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[])
    assert args.guidance_scale is None and args._cfg_free_rollouts == cfg_free
    # a guidance the family ignores is a warning, not an error
    klein = resolve_generation_settings(read_model_configs(tiny_pipeline_path("flux2_klein", "distilled")),
                                        {"guidance_scale": 4.0})
    assert len(klein.warnings) == 1 and "guidance_scale=4 has no effect on" in klein.warnings[0]
    assert "one pass at any guidance" in klein.warnings[0]
    embedded = resolve_generation_settings(read_model_configs(tiny_pipeline_path("flux")), {}, negative_prompt="ugly")
    assert len(embedded.warnings) == 1 and "negative_prompt='ugly' is not used" in embedded.warnings[0]
    folder = configs_only(tiny_pipeline_path("zimage"), tmp_path / "turbo")  # a checkpoint that says it is distilled
    (folder / CHECKPOINT_DEFAULTS_FILES[0]).write_text(json.dumps(
        {"generation": {"resolution": 32, "num_inference_steps": 8, "guidance_scale": 0.0, "distilled": True}}))
    turbo = resolve_generation_settings(read_model_configs(folder), {"guidance_scale": 3.0})
    assert turbo.values["num_inference_steps"] == 8 and "distilled to sample without it" in turbo.warnings[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OSError, match="no file named"):  # no weights: the warning came before loading failed
            _trainer(folder, "zimage", tmp_path / "o", guidance_scale=3.0)
    assert any("distilled to sample without it" in str(w.message) for w in caught)


def test_a_checkpoints_own_defaults_file_is_checked(tiny_pipeline_path, tmp_path):
    folder = configs_only(tiny_pipeline_path("flux"), tmp_path / "flux")
    (folder / CHECKPOINT_DEFAULTS_FILES[0]).write_text(json.dumps({"generation": {"resolutoin": 32}}))
    with pytest.raises(ValueError, match=r"generation_defaults.json: unknown generation default\(s\) \['resolutoin'\]"):
        read_model_configs(folder)


def test_plan_refuses_the_same_values_with_the_same_words(tiny_pipeline_path, tmp_path):
    from flowgrpo.plan.cli import main as plan_main
    from flowgrpo.plan.cli import plan_recipe

    path = tiny_pipeline_path("sd3")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {path}\ndataset_name: prompts.txt\nreward_funcs: [jpeg_compressibility]\n"
                      "use_cpu: true\nper_device_train_batch_size: 2\nnum_generations: 2\nnum_inference_steps: 2\n")
    with pytest.raises(ValueError) as from_trainer:
        _trainer(path, "sd3", tmp_path / "o", num_inference_steps=2, resolution=528)
    with pytest.raises(ValueError) as from_plan:
        plan_recipe(str(recipe), ["--resolution", "528"], with_suggestions=False)
    assert str(from_plan.value) == str(from_trainer.value)
    assert "height=528 cannot be used with" in str(from_plan.value)
    assert plan_main([str(recipe), "--max_sequence_length", "600", "--no_suggestions"]) == 2
    # unset, the plan is made at the model's own settings (64 px, 256 T5 tokens for the tiny SD3)
    planned = plan_recipe(str(recipe), [], with_suggestions=False)
    assert planned["details"]["model"] and planned["fits"] in (True, False)


def test_the_docs_table_is_made_from_the_adapters():
    from flowgrpo.plan.defaults_table import TABLE_END, TABLE_START, defaults_rows, defaults_table

    page = (Path(__file__).resolve().parents[2] / "docs" / "model_families.md").read_text(encoding="utf-8")
    written = page[page.index(TABLE_START) + len(TABLE_START):page.index(TABLE_END)].strip()
    assert written == defaults_table(), "docs/model_families.md: run python scripts/model_defaults_table.py"
    rows = {row["model"].strip("`"): row for row in defaults_rows()}
    expected = {  # the released checkpoints: size, frames, steps, guidance, text tokens
        "stabilityai/stable-diffusion-3.5-medium": ("1024 x 1024", "1", "40", "4.5", "256"),
        "black-forest-labs/FLUX.1-dev": ("1024 x 1024", "1", "50", "3.5", "512"),
        "black-forest-labs/FLUX.2-klein-4B": ("1024 x 1024", "1", "4", "1", "512"),
        "black-forest-labs/FLUX.2-klein-base-4B": ("1024 x 1024", "1", "50", "4", "512"),
        "Tongyi-MAI/Z-Image-Turbo": ("1024 x 1024", "1", "8", "0", "512"),
        "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": ("480 x 832", "81", "50", "5", "512"),
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": ("704 x 1280", "121", "50", "5", "512"),
        "Lightricks/LTX-2": ("512 x 768", "121", "30", "3", "1024"),
    }
    for name, (size, frames, steps, guidance, text) in expected.items():
        row = rows[name]
        assert (row["size"].split(" (")[0], row["frames"], row["steps"], row["guidance"].split(" ")[0],
                row["text tokens"]) == (size, frames, steps, guidance, text), name
    assert "at most 6144" in rows["stabilityai/stable-diffusion-3.5-medium"]["size"]  # pos_embed_max_size 384
    assert "distilled" in rows["black-forest-labs/FLUX.2-klein-4B"]["guidance"]


def test_checks_that_need_the_step_count_run_once_it_is_resolved(tiny_pipeline_path, tmp_path):
    from flowgrpo.models.defaults import resolve_config_settings

    args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], sde_window_size=2, base_model_tail_steps=3)
    assert args.sde_window_range is None and args.image_size == (None, None)  # waiting for the model's step count
    resolve_config_settings(read_model_configs(tiny_pipeline_path("sd3")), args)
    assert (args.num_inference_steps, args.sde_window_range, args.image_size) == (28, [0, 14], (64, 64))
    assert args.resolution == 64 and args.evaluation_guidance_scales == [7.0]
    distilled = read_model_configs(tiny_pipeline_path("flux2_klein", "distilled"))  # 4 steps
    with pytest.raises(ValueError, match=r"sde_window_size=5 must be at most num_inference_steps - 1 = 3"):
        resolve_config_settings(distilled, FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], sde_window_size=5))
    with pytest.raises(ValueError, match=r"base_model_tail_steps=4 must be in \[0, num_inference_steps=4\)"):
        resolve_config_settings(distilled, FlowGRPOConfig(output_dir=str(tmp_path), report_to=[],
                                                          base_model_tail_steps=4))
    with pytest.raises(ValueError, match=r"timestep_fraction=0.2 of num_inference_steps=4 trains"):
        resolve_config_settings(distilled, DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[],
                                                              timestep_fraction=0.2))
