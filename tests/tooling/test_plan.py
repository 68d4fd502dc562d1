"""flowgrpo.plan: exact JSON keys, exact per-GPU states, fake-vs-real fidelity and physical invariants, on the tiny
recipe (the tiny SD3 pipeline, built offline and cached) so that the whole file stays cheap."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from flowgrpo.plan import JSON_KEYS, main, plan_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


def _plan(*overrides: str, **kwargs):
    return plan_recipe(TINY, list(overrides), with_suggestions=False, **kwargs)


def test_json_keys_are_exact(tmp_path):
    out = tmp_path / "plan.json"
    assert main([TINY, "--gpu", "rtx4090-24gb", "--json", str(out), "--no_suggestions"]) == 0
    result = json.loads(out.read_text())
    assert tuple(result) == JSON_KEYS
    assert set(result["gpu"]) == {"name", "memory_gb", "bf16_tflops"}
    assert set(result["phases"]) == {"rollout", "training"}
    assert set(result["breakdown_gb"]) == {"weights", "gradients", "optimizer_states", "activations", "copies",
                                          "reward_model", "overhead"}
    assert result["method"] == "fake_tensors" and result["fits"] is True
    assert result["suggestions"] == []


def test_bad_gpu_name_is_a_clear_error(capsys):
    assert main([TINY, "--gpu", "h100"]) == 2
    assert "h100-80gb" in capsys.readouterr().err


def test_per_gpu_states_are_numel_times_bytes_over_shards():
    from flowgrpo.cli.parser import parse_recipe
    from flowgrpo.plan.accelerate_config import Parallelism
    from flowgrpo.plan.gpus import get_gpu
    from flowgrpo.plan.model_specs import spec_for_model_args
    from flowgrpo.plan.planner import make_plan, plan_inputs

    script, model_args, args = parse_recipe([TINY, "--use_peft", "false"])
    spec = spec_for_model_args(model_args)
    inputs = plan_inputs(script, model_args, args, Parallelism("fsdp", 4, mixed_precision="no"), get_gpu("h100-80gb"),
                         spec)
    plan = make_plan(inputs)
    from flowgrpo.plan.step import build_on_meta

    transformer, _ = build_on_meta(spec)
    numel = sum(p.numel() for p in transformer.parameters())
    # float32 recipe, full fine-tuning, AdamW: weights 4 B, gradients 4 B, two states of 4 B each, over 4 shards
    assert plan.breakdown["optimizer_states"] * 1e9 == pytest.approx(numel * 8 / 4, rel=1e-12)
    block_max = max(sum(p.numel() for p in b.parameters()) for b in transformer.transformer_blocks)
    # sharded float32 gradients plus one block's unsharded float32 gradients before its reduce-scatter
    assert plan.breakdown["gradients"] * 1e9 == pytest.approx(numel * 4 / 4 + block_max * 4, rel=1e-12)


def _preset_case(name: str):
    """(spec, settings) of a CPU benchmark preset: its transformer, the tiny SD3 VAE and encoders, its run."""
    import dataclasses

    from flowgrpo.benchmarking.presets import PRESETS, SMALL_CPU_TRANSFORMER
    from flowgrpo.plan.model_specs import load_model_spec, toy_world_spec
    from flowgrpo.plan.step import StepSettings
    from flowgrpo.testing import cached_tiny_pipeline_path

    preset = PRESETS[name]
    if name == "toy":
        spec = toy_world_spec()
    else:
        spec = load_model_spec(str(cached_tiny_pipeline_path("sd3", seed=0)))
        if name == "small-cpu":
            spec = dataclasses.replace(spec, transformer_config=dict(SMALL_CPU_TRANSFORMER))
    targets = preset.lora_targets if isinstance(preset.lora_targets, str) else tuple(preset.lora_targets)
    settings = StepSettings(
        height=preset.resolution, width=preset.resolution, num_frames=1, micro_batch=preset.per_device_train_batch_size,
        num_inference_steps=preset.num_inference_steps, trained_steps=preset.sde_window_size,
        guidance_scale=preset.guidance_scale, text_tokens=preset.max_sequence_length, dtype=torch.float32,
        use_lora=True, lora_r=preset.lora_rank, lora_alpha=2 * preset.lora_rank, lora_targets=targets,
        checkpointing=False, beta=preset.beta, trained_input="recorded_transition",
        frozen_forwards=("reference",) if preset.beta > 0 else (), loss="ratio", noise_level=0.7, sde_type="sde",
        decode_batch=preset.per_device_train_batch_size)
    return spec, settings


@pytest.mark.parametrize("preset", ["tiny", "small-cpu", "toy"])
def test_fake_step_matches_real_step_and_analytic_flops(preset):
    """The planned step against the same step on real tensors, counted the same way (peaks within 10%), and its
    FLOPs against the analytic counter of flowgrpo.benchmarking.flops (within 2%)."""
    import diffusers

    from flowgrpo.benchmarking.flops import step_flops, transformer_forward_flops
    from flowgrpo.plan.step import run_step

    spec, settings = _preset_case(preset)
    fake = run_step(spec, settings)
    torch.manual_seed(0)
    transformer = getattr(diffusers, spec.transformer_class).from_config(spec.transformer_config)
    vae = getattr(diffusers, spec.vae_class).from_config(spec.vae_config)
    real = run_step(spec, settings, fake=False, real_modules=(transformer, vae))
    for key in ("training_bytes", "rollout_bytes", "decode_bytes"):
        assert getattr(fake, key) == pytest.approx(getattr(real, key), rel=0.10), key
    config = spec.transformer_config
    latent = settings.height // 8 if preset != "toy" else settings.height // 2 ** (len(spec.vae_config[
        "block_out_channels"]) - 1)
    image_tokens = (latent // config["patch_size"]) ** 2
    forward = transformer_forward_flops("sd3", config, image_tokens, 77 + settings.text_tokens,
                                        lora_rank=settings.lora_r, lora_targets=settings.lora_targets)
    analytic = step_flops(forward, micro_batches=1, micro_batch_size=settings.micro_batch,
                          num_inference_steps=settings.num_inference_steps, trained_steps=settings.trained_steps,
                          cfg=settings.guidance_scale > 1, beta=settings.beta)
    assert fake.rollout_flops == pytest.approx(analytic.rollout, rel=0.02)
    assert fake.training_flops == pytest.approx(analytic.training + analytic.reference, rel=0.02)


@pytest.mark.parametrize("preset", ["small-cpu", "toy"])
def test_live_bytes_agree_with_torchs_memtracker(preset):
    """The planner's counter (LiveBytes) against torch's own MemTracker, entered beside it on the same real step:
    each phase's peak of memory made during the phase (MemTracker's peak less the parameters and buffers it also
    counts; for training less the gradients too, which the plan counts as a term of their own). Full fine-tuning:
    MemTracker registers a gradient hook on every parameter of each module it enters and fails on frozen ones
    ("cannot register a hook on a tensor that doesn't require gradient"), so neither a LoRA model's step nor the
    frozen VAE's decode can be tracked by it."""
    import dataclasses

    import diffusers
    from torch.distributed._tools.mem_tracker import MemTracker

    from flowgrpo.plan.step import run_step

    spec, settings = _preset_case(preset)
    settings = dataclasses.replace(settings, use_lora=False)
    torch.manual_seed(0)
    transformer = getattr(diffusers, spec.transformer_class).from_config(spec.transformer_config)
    vae = getattr(diffusers, spec.vae_class).from_config(spec.vae_config)
    trackers = {}

    def also_track(phase):
        if phase == "decode":
            return contextlib.nullcontext()
        trackers[phase] = MemTracker()
        return trackers[phase]

    measured = run_step(spec, settings, fake=False, real_modules=(transformer, vae), also_track=also_track)

    def made_during(phase, *kinds):
        (snapshot,) = trackers[phase].get_tracker_snapshot("peak").values()
        return sum(v for k, v in snapshot.items() if getattr(k, "value", None) in kinds)

    assert measured.rollout_bytes == pytest.approx(made_during("rollout", "Activation", "Temp", "Other"), rel=0.02)
    # MemTracker's peak is the moment of most memory, gradients included; the plan's training peak leaves the
    # gradients out, so it lies between that moment's memory without them and with them
    low = made_during("training", "Activation", "Temp", "Other")
    high = made_during("training", "Activation", "Temp", "Other", "Gradient")
    assert 0.98 * low <= measured.training_bytes <= 1.02 * high


def test_physical_invariants():
    lora = _plan()
    full = _plan("--use_peft", "false")
    assert lora["peak_memory_gb"] < full["peak_memory_gb"]
    states = lambda r: r["breakdown_gb"]["gradients"] + r["breakdown_gb"]["optimizer_states"]  # noqa: E731
    zero2 = _plan("--use_peft", "false", config_file=str(REPO / "accelerate_configs" / "zero2.yaml"), num_processes=2)
    zero3 = _plan("--use_peft", "false", config_file=str(REPO / "accelerate_configs" / "zero3.yaml"), num_processes=2)
    ddp = _plan("--use_peft", "false", config_file=str(REPO / "accelerate_configs" / "multi_gpu.yaml"),
                num_processes=2)
    assert zero3["peak_memory_gb"] <= zero2["peak_memory_gb"] <= ddp["peak_memory_gb"]
    assert zero2["method"] == zero3["method"] == "analytic"
    fsdp2 = _plan("--use_peft", "false", config_file=str(REPO / "accelerate_configs" / "fsdp8.yaml"), num_processes=2)
    fsdp8 = _plan("--use_peft", "false", config_file=str(REPO / "accelerate_configs" / "fsdp8.yaml"), num_processes=8)
    assert states(fsdp8) < states(fsdp2)
    small = _plan("--per_device_train_batch_size", "2")
    large = _plan("--per_device_train_batch_size", "8")
    assert large["breakdown_gb"]["activations"] > small["breakdown_gb"]["activations"]


GPU_RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.yaml")
                     if "--config_file accelerate_configs/" in p.read_text() and "cpu" not in p.name
                     and not p.name.startswith("toy_"))


def _planned_path(recipe: str) -> tuple:
    """What decides the code path a full-size plan takes: the model, the trainer, the accelerate config and the
    algorithm's switches that change what a step stores or runs (DPO's mode, Flow-DPPO, the SDE, BranchGRPO's trees)."""
    import re

    import yaml

    text = (REPO / "recipes" / recipe).read_text()
    settings = yaml.safe_load(text) or {}
    return (settings.get("model_name_or_path"), settings.get("trainer", "flow_grpo"),
            re.search(r"--config_file (\S+)", text).group(1), settings.get("dpo_mode"), settings.get("policy_loss"),
            settings.get("sde_type"), bool(settings.get("branch_steps")))


def _one_recipe_per_path(recipes: list[str], keep: tuple[str, ...]) -> list[str]:
    """The recipes of ``keep`` and, for every other planned path, its first recipe: recipes that differ only in the
    reward, the prompts or a sampling setting plan through the same code."""
    chosen = {_planned_path(r): r for r in reversed(recipes)}
    for recipe in keep:
        chosen[_planned_path(recipe)] = recipe
    return sorted(chosen.values())


#: every planned path once (full-size plans take seconds each): ocr.yaml (its outcome is asserted) and the cheaper
#: recipe where two share a path
PLANNED_RECIPES = _one_recipe_per_path(GPU_RECIPES, keep=("ocr.yaml", "awm_ocr.yaml", "flux_ocr.yaml"))


#: HunyuanVideo 1.5's 33-frame plan takes about twice its 5-frame one (the VAE decode under fake tensors): planned here
#: on 5 frames (every code path the same); docs/benchmarks.md records the 33-frame plan (python -m flowgrpo.plan recipes/hunyuanvideo15_t2v.yaml).
#: The 720p sequence-parallel recipes: 5 frames at 64 x 64 (whole decoding), the same code paths; docs/planning.md
#: records their 720p plans (15 minutes for HunyuanVideo 1.5's tiled decode of 121 frames).
SMALL_VIDEO = ("--num_frames", "5", "--height", "64", "--width", "64")
FEWER_FRAMES = {"hunyuanvideo15_t2v.yaml": ("--num_frames", "5"),
                "wan22_a14b_t2v_720p_sp.yaml": SMALL_VIDEO,
                "hunyuanvideo15_720p_sp.yaml": (*SMALL_VIDEO, "--vae_tiling", "false")}


def test_the_planned_recipes_cover_every_planned_path():
    """`PLANNED_RECIPES`: every planned path of the GPU recipes, each planned below in its own test (so that parallel
    test workers share them)."""
    assert len(PLANNED_RECIPES) >= 20 and set(PLANNED_RECIPES) <= set(GPU_RECIPES)
    assert "ocr.yaml" in PLANNED_RECIPES  # its published outcome is asserted by its plan below
    assert {_planned_path(r) for r in PLANNED_RECIPES} == {_planned_path(r) for r in GPU_RECIPES}


@pytest.mark.parametrize("recipe", PLANNED_RECIPES)
def test_every_shipped_gpu_recipe_plans_with_its_accelerate_config(recipe):
    """Each GPU recipe's planned path (model, trainer, config, algorithm switches; `PLANNED_RECIPES`) at full size on
    its intended config (the header's --config_file), on an H100: planned, with positive terms, and the published
    outcome of ocr.yaml (eight GPUs, and it fits). Every GPU recipe is also parsed and resolved by
    tests/cli/test_recipe_generation_settings.py."""
    overrides = list(FEWER_FRAMES.get(recipe, ()))
    result = plan_recipe(str(REPO / "recipes" / recipe), overrides, gpu="h100-80gb", with_suggestions=False)
    assert result["peak_memory_gb"] > 0 and result["step_flops"] > 0, recipe
    assert all(v >= 0 for v in result["breakdown_gb"].values()), recipe
    if recipe == "ocr.yaml":
        assert result["world_size"] == 8 and result["fits"]


def test_the_24gb_recipe_fits_an_rtx4090():
    """The second published outcome: sd35m_24gb.yaml plans under 24 GB on an RTX 4090."""
    small = plan_recipe(str(REPO / "recipes" / "sd35m_24gb.yaml"), [], gpu="rtx4090-24gb", with_suggestions=False)
    assert small["peak_memory_gb"] < 24 and small["fits"]


def test_plan_vs_measured_check_compares_allocated_peaks(tmp_path, tiny_sd3_path):
    """The gpu-check's comparison on this machine: a recorded memory result and the tiny SD3 folder as the model."""
    from flowgrpo.gpu_check.plan_vs_measured import main as check_main

    measured = tmp_path / "memory"
    measured.mkdir()
    (measured / "result.json").write_text(json.dumps({"passed": True, "metrics": {"max_memory_allocated_mib": 1.0}}))
    out = tmp_path / "out"
    out.mkdir()
    code = check_main(["--measured", str(measured), "--model-dir", str(tiny_sd3_path), "--output", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert code == 1 and not result["passed"]  # 1 MiB measured: far from any plan
    assert result["metrics"]["planned_allocated_gib"] > 0 and result["metrics"]["ratio"] > 1


def test_fsdp_wrap_classes_that_the_model_lacks_are_refused_before_any_step(capsys):
    """A FLUX recipe on the SD3 FSDP config: accelerate would fail after loading 24 GB of weights; the plan says so
    at once, naming the model's block classes."""
    code = main([str(REPO / "recipes" / "flux_ocr.yaml"), "--config_file",
                 str(REPO / "accelerate_configs" / "fsdp8.yaml"), "--no_suggestions"])
    err = capsys.readouterr().err
    assert code == 2 and "JointTransformerBlock" in err and "FluxTransformerBlock" in err


def test_suggestions_are_replanned_changes():
    result = plan_recipe(TINY, ["--per_device_train_batch_size", "8", "--resolution", "512"], gpu="rtx4090-24gb")
    changes = {s["change"]: s["peak_memory_gb"] for s in result["suggestions"]}
    assert "activation_checkpointing: true" in changes and "optim: adamw_bnb_8bit" in changes
    assert all(isinstance(v, float) for v in changes.values()), changes
    halved = next(v for k, v in changes.items() if k.startswith("per_device_train_batch_size: 4"))
    assert halved < result["peak_memory_gb"]
    assert changes["optim: adamw_bnb_8bit"] <= result["peak_memory_gb"]


@pytest.mark.parametrize("full_depth", [True, False])
def test_a_decode_only_change_measures_the_decode_alone_with_the_figures_of_a_fresh_step(full_depth, monkeypatch):
    """vae_decode_batch_size and vae_tiling change only the decode: after a measured step, measure_full_depth runs
    the decode alone (one run_step, decode_only) and keeps the rest, and every number is what measuring the changed
    step afresh gives (toy: 4 blocks, planned at full depth or from copies)."""
    import dataclasses

    from flowgrpo.plan import step

    spec, settings = _preset_case("toy")
    changed = dataclasses.replace(settings, decode_batch=2, vae_tiling=True)

    def fresh_caches():
        for name in ("_CACHE", "_STEP_CACHE", "_DECODE_CACHE"):
            monkeypatch.setattr(step, name, {})

    def as_numbers(result):
        total, smallest, blocks = result
        return dataclasses.asdict(total), dataclasses.asdict(smallest), blocks

    fresh_caches()
    step.measure_full_depth(spec, settings, full_depth=full_depth)
    calls = []
    run_step = step.run_step
    monkeypatch.setattr(step, "run_step", lambda *a, **k: calls.append(k) or run_step(*a, **k))
    reused = step.measure_full_depth(spec, changed, full_depth=full_depth)
    assert calls == [{"decode_only": True}]
    monkeypatch.setattr(step, "run_step", run_step)
    fresh_caches()
    fresh = step.measure_full_depth(spec, changed, full_depth=full_depth)
    assert as_numbers(reused) == as_numbers(fresh)
    assert reused[0].decode_bytes != step.measure_full_depth(spec, settings, full_depth=full_depth)[0].decode_bytes


@pytest.mark.parametrize("preset", ["small-cpu", "toy"])
def test_depth_scaled_copies_reproduce_the_full_depth_step(preset):
    """Large models are planned from copies of 2-3 blocks combined linearly: against the full-depth step (small-cpu:
    6 blocks, 3 with dual attention; toy: 4 blocks), parameters and FLOPs are exact and the checkpointed training
    peak is within 15%."""
    import dataclasses

    from flowgrpo.plan.step import measure_full_depth, run_step

    spec, settings = _preset_case(preset)
    settings = dataclasses.replace(settings, checkpointing=True)
    full = run_step(spec, settings)
    scaled, _, _ = measure_full_depth(spec, settings, full_depth=False)
    assert scaled.params["total"] == full.params["total"] and scaled.params["trainable"] == full.params["trainable"]
    assert scaled.training_flops == pytest.approx(full.training_flops, rel=1e-9)
    assert scaled.rollout_flops == pytest.approx(full.rollout_flops, rel=1e-9)
    assert scaled.training_bytes == pytest.approx(full.training_bytes, rel=0.15)
    assert scaled.rollout_bytes == pytest.approx(full.rollout_bytes, rel=0.10)


def test_new_families_packaged_configs_are_the_full_size_builders_and_every_family_has_conditioning():
    """The packaged transformer configs of the newer families hold the numbers of their full-size builders (checked
    there by parameter count), and every adapter family has a row in the planner's conditioning table."""
    from flowgrpo.benchmarking.full_size_families import (
        FLUX2_DEV_TRANSFORMER,
        FLUX2_KLEIN_4B_TRANSFORMER,
        QWENIMAGE21_TRANSFORMER,
        ZIMAGE_TURBO_TRANSFORMER,
    )
    from flowgrpo.benchmarking.full_size_video import WAN_I2V_14B_TRANSFORMER
    from flowgrpo.models import ADAPTERS
    from flowgrpo.plan.model_specs import load_model_spec, packaged_specs
    from flowgrpo.plan.step import CONDITIONING

    specs = packaged_specs()
    for stem, arch in {"flux.2-dev": FLUX2_DEV_TRANSFORMER, "flux.2-klein-4b": FLUX2_KLEIN_4B_TRANSFORMER,
                       "z-image-turbo": ZIMAGE_TURBO_TRANSFORMER, "qwen-image-2.1": QWENIMAGE21_TRANSFORMER,
                       "wan2.1-i2v-14b-480p": WAN_I2V_14B_TRANSFORMER}.items():
        config = specs[stem]["transformer"]["config"]
        assert {k: config[k] for k in arch} == json.loads(json.dumps(arch)), stem
    assert load_model_spec("Qwen/Qwen-Image-Edit-2509").pipeline_class == "QwenImageEditPlusPipeline"
    families = {cls.family for cls in ADAPTERS}
    assert families <= set(CONDITIONING), sorted(families - set(CONDITIONING))
    assert {raw["family"] for raw in specs.values()} <= families


def test_real_valued_masks_keep_mask_values_under_fake_tensors():
    """What Qwen-Image 2.1 and HunyuanVideo 1.5 need: small data-independent tensors stay real, so branching on
    them, repeat_interleave by them and boolean indexing of a fake tensor with them work; large tensors stay fake."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from flowgrpo.plan.real_masks import SMALL_NUMEL, RealValuedMasks

    with FakeTensorMode(allow_non_fake_inputs=True), RealValuedMasks():
        big = torch.empty(SMALL_NUMEL + 1)
        assert isinstance(big, FakeTensor)
        states = big[: 2 * 10 * 8].view(2, 10, 8)
        mask = torch.zeros(10, dtype=torch.bool)
        mask[3:7] = True
        assert not isinstance(mask, FakeTensor) and int(mask.sum()) == 4
        assert bool(torch.all(states.new_zeros(2, 5) == 0))
        assert tuple(states[:, mask].shape) == (2, 4, 8)
        repeats = torch.where(mask, 4, 1)
        assert int(torch.repeat_interleave(mask, repeats).sum()) == 16
        states[:, mask] = torch.zeros(2, 4, 8)


def test_ray_backend_plans_worker_and_trainer_memory_apart_with_and_without_overlap(tmp_path):
    flags = ["--rollout_backend", "ray", "--rollout_workers", "1", "--max_staleness", "1",
             "--rollout_worker_resources", '{"num_gpus": 1, "num_cpus": 4}', "--per_device_train_batch_size", "8",
             "--resolution", "256"]
    local = _plan("--per_device_train_batch_size", "8", "--resolution", "256")
    result = _plan(*flags)
    backend = result["rollout_backend"]
    assert backend["worker_resources"] == {"num_gpus": 1, "num_cpus": 4} and backend["workers"] == 1
    # the worker holds no gradients, optimizer states or training activations: at most the local rollout phase
    assert set(backend["worker_breakdown_gb"]) == {"weights", "copies", "rollout", "overhead"}
    assert backend["worker_peak_gb"] <= local["phases"]["rollout"] + 1e-3
    assert backend["trainer_peak_gb"] >= local["peak_memory_gb"]
    rollout, training, sync = backend["rollout_s"], backend["training_s"], backend["sync_s"]
    assert backend["step_time_sequential_s"] == pytest.approx(rollout + training + sync, rel=2e-3)
    assert backend["step_time_overlapped_s"] == pytest.approx(max(rollout, training) + sync, rel=2e-3)
    assert backend["step_time_overlapped_s"] < backend["step_time_sequential_s"]
    # two training processes share one worker: its rollout of a generation takes two shares' time
    two = plan_recipe(TINY, flags, with_suggestions=False, num_processes=2,
                      config_file=str(REPO / "accelerate_configs" / "multi_gpu.yaml"))
    assert two["rollout_backend"]["rollout_s"] == pytest.approx(2 * rollout, rel=1e-2)
    out = tmp_path / "plan.json"
    assert main([TINY, *flags, "--json", str(out), "--no_suggestions"]) == 0
    assert tuple(json.loads(out.read_text())) == (*JSON_KEYS, "rollout_backend")


def test_timesteps_per_pass_plans_one_larger_pass_and_the_largest_that_fits():
    """train_timesteps_per_pass on the tiny recipe (3 recorded steps) under FSDP2 on 2 GPUs: stacking every trained
    timestep into one pass trains as many rows (the same FLOPs), with a larger pass (its activations grow with K) and
    a third of the passes, so fewer weight gathers; on a GPU whose memory lies between the peaks at K = 2 and 3, the
    largest K that fits is 2, and the suggestion names it."""
    import dataclasses

    from flowgrpo.cli.parser import parse_recipe
    from flowgrpo.plan.accelerate_config import Parallelism
    from flowgrpo.plan.gpus import get_gpu
    from flowgrpo.plan.model_specs import spec_for_model_args
    from flowgrpo.plan.planner import (
        largest_timesteps_per_pass,
        make_plan,
        plan_inputs,
        timesteps_per_pass_suggestion,
    )

    script, model_args, args = parse_recipe([TINY, "--train_timesteps_per_pass", "1"])
    inputs = plan_inputs(script, model_args, args, Parallelism("fsdp", 2, mixed_precision="no"), get_gpu("h100-80gb"),
                         spec_for_model_args(model_args))
    plans = {k: make_plan(dataclasses.replace(inputs, settings=dataclasses.replace(inputs.settings,
                                                                                   timesteps_per_pass=k)))
             for k in (1, 2, 3)}
    assert [plans[k].inputs.settings.trained_pass_count for k in (1, 2, 3)] == [3, 2, 1]
    assert plans[3].step_flops == pytest.approx(plans[1].step_flops, rel=1e-9)
    activations = [plans[k].breakdown["activations"] for k in (1, 2, 3)]
    assert activations[0] < activations[1] < activations[2]
    assert plans[3].comm_time_s < plans[2].comm_time_s < plans[1].comm_time_s
    between = (plans[2].peak_gb + plans[3].peak_gb) / 2
    small_gpu = dataclasses.replace(get_gpu("h100-80gb"), memory_gb=between)
    at_one = dataclasses.replace(plans[1], inputs=dataclasses.replace(inputs, gpu=small_gpu))
    assert largest_timesteps_per_pass(at_one).inputs.settings.timesteps_per_pass == 2
    named = timesteps_per_pass_suggestion(at_one)
    assert named["change"].startswith("train_timesteps_per_pass: 2 (")
    assert named["peak_memory_gb"] == pytest.approx(plans[2].peak_gb, abs=0.01)
    assert timesteps_per_pass_suggestion(plans[3]) is None  # the recipe's own K is already the largest
    every = _plan("--train_timesteps_per_pass", "all")
    assert every["details"]["timesteps_per_pass"] == {"per_pass": 3, "trained_timesteps": 3,
                                                     "passes_per_micro_batch": 1.0}
