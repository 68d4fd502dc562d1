"""The algorithm leaderboard's machinery (variants, toy recipes, figures and the page) and the MixGRPO recipes.

The leaderboard itself trains 36 toy-world runs (about 40 minutes on 2 cores in two processes); here the variants are
validated, the toy recipes are checked against them, the figures are computed from hand-made run results whose
answers are known, and a quick leaderboard on the light world runs end to end in two processes.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from flowgrpo import DiffusionNFTConfig, FlowGRPOConfig
from flowgrpo.cli import parse_recipe
from flowgrpo.toy.leaderboard import (
    COLOUR_KEPT,
    GOAL_ROWS,
    NFT_VARIANT,
    OPD_EXPERTS,
    OPD_VARIANT,
    REFERENCE_VARIANT,
    accuracy_at_budget,
    leaderboard_variants,
    render_leaderboard,
    summarize,
)
from flowgrpo.toy.learning import TOY_TRAINERS, RLSettings, toy_trainer_classes, world_digest

REPO = Path(__file__).resolve().parents[2]

#: toy recipe -> the leaderboard variant it runs (recipes/toy.yaml is the reference, "fast-random").
TOY_RECIPES = {
    "toy.yaml": "fast-random", "toy_flow_grpo.yaml": "flow-grpo", "toy_mixgrpo.yaml": "mixgrpo",
    "toy_mixgrpo_flash.yaml": "mixgrpo-flash", "toy_grpo_guard.yaml": "grpo-guard",
    "toy_kl_analytic.yaml": "kl-analytic", "toy_kl_k1.yaml": "kl-k1", "toy_kl_k3.yaml": "kl-k3",
    "toy_kl_velocity.yaml": "kl-velocity", "toy_normalize_then_sum.yaml": "normalize-then-sum",
    "toy_same_noise.yaml": "same-noise", "toy_nft.yaml": "diffusion-nft", "toy_dancegrpo.yaml": "dancegrpo",
    "toy_awm.yaml": "awm", "toy_nft_fast.yaml": "diffusion-nft-fast", "toy_flowdppo.yaml": "flow-dppo",
    "toy_branchgrpo.yaml": "branchgrpo", "toy_dgpo.yaml": "dgpo", "toy_crd.yaml": "crd",
    "toy_awm_colour_kept.yaml": "awm-colour-kept", "toy_dgpo_colour_kept.yaml": "dgpo-colour-kept",
    "toy_tempflow.yaml": "tempflow-grpo", "toy_draft.yaml": "draft-lv", "toy_refl.yaml": "refl",
}


def test_every_variant_validates_and_differs_from_the_reference_in_one_place(tmp_path):
    variants = leaderboard_variants(120)
    names = [s.name for s, _ in variants]
    assert len(set(names)) == len(names) == 24 + len(GOAL_ROWS) and REFERENCE_VARIANT in names
    assert names[names.index(NFT_VARIANT) + 1] == "diffusion-nft-fast" and names[-len(GOAL_ROWS):] == list(GOAL_ROWS)
    assert names[names.index("diffusion-nft-fast") + 1:][:2] == ["draft-lv", "refl"]
    assert {"dancegrpo", "awm", "diffusion-dpo", "dgpo", "crd", OPD_VARIANT} <= set(names)
    reference = next(s for s, _ in variants if s.name == REFERENCE_VARIANT)
    assert dataclasses.replace(reference, name="x") == dataclasses.replace(RLSettings(max_steps=120), name="x")
    algorithm_fields = {"sde_window_size", "sde_window_range", "sde_window_strategy", "sde_window_shift_interval",
                        "ode_solver", "ode_compression_ratio", "ratio_normalization", "beta", "kl_estimator",
                        "reward_aggregation", "same_noise_per_group"}
    by_name = {s.name: s for s, _ in variants}
    for settings, what in variants:
        if settings.name in GOAL_ROWS:  # the goal's rows: their row plus the colour constraint, or CFG 3 rollouts
            row, change, _ = GOAL_ROWS[settings.name]
            base = by_name[row]
            extra = settings.config_kwargs()
            differs = {k for k in {**extra, **base.config_kwargs()} if extra.get(k) != base.config_kwargs().get(k)}
            assert differs == set(change) | ({"eval_raw_weights"} if row == "awm" and change is COLOUR_KEPT else set())
            args = toy_trainer_classes(settings.trainer)[0](output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                           **extra)
            if change is COLOUR_KEPT:
                assert args.reward_constraints == {"toy_color": {"min_delta": -0.01, "source": "evaluation"}}
                assert args.eval_on_start and args.eval_steps == 25 and args.guidance_scale == 1.0
            else:
                assert (args.guidance_scale, args.training_guidance_scale) == (3.0, 1.0) and what
            continue
        if settings.trainer == "awm":  # the official settings: CFG-free SA-Solver rollouts, 14 steps, groups of 24
            args = toy_trainer_classes(settings.trainer)[0](output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                           **settings.config_kwargs())
            assert what and args.generation_batch_size == 48 and args.num_generations == 24
            assert (args.guidance_scale, args.training_guidance_scale, args.num_inference_steps) == (1.0, 1.0, 14)
            assert (args.rollout_solver, args.sa_solver_tau, args.sampler) == ("sa_solver", 0.4, "euler")
            assert args.use_ema and args.ema_warmup and args.ema_decay == 0.99 and args.eval_raw_weights
            continue
        if settings.trainer == "diffusion_dpo":  # the flow-matching references' draws; rollouts at the world's CFG
            args = toy_trainer_classes(settings.trainer)[0](output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                           **settings.config_kwargs())
            assert what and args.generation_batch_size == 32 and args.num_generations == 4
            assert (args.guidance_scale, args.training_guidance_scale) == (reference.guidance_scale, 1.0)
            assert (args.dpo_mode, args.dpo_timestep_distribution) == ("online", "logit_normal")
            assert args.dpo_num_noise_draws > 1 and args.beta_dpo < 5000
            continue
        if settings.name == "dancegrpo":  # DanceGRPO's own sampler, clip range and schedule
            args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings.config_kwargs())
            assert (args.sde_type, args.noise_level, args.timestep_fraction, args.epsilon) == ("dance", 0.3, 0.6, 1e-4)
            assert args.same_noise_per_group and args.sde_window_size == 0
            continue
        if settings.name == "tempflow-grpo":  # an ODE trajectory a group, 6 children at each of steps 0-6
            args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings.config_kwargs())
            assert what and (args.tempflow_children, args.num_generations, args.generation_batch_size) == (6, 42, 84)
            assert args.guidance_scale == reference.guidance_scale and args.sde_window_size == 0
            continue
        if settings.trainer == "reward_backprop":  # the world's differentiable reward, 32 prompts a step
            args = toy_trainer_classes(settings.trainer)[0](output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                           **settings.config_kwargs())
            assert what and settings.reward == "toy_smooth_shape_color" and args.generation_batch_size == 32
            assert args.reward_backprop_mode == {"draft-lv": "draft_lv", "refl": "refl"}[settings.name]
            continue
        if settings.name in ("flow-dppo", "branchgrpo"):  # Flow-GRPO's own switches, the recipe's world and batch
            args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings.config_kwargs())
            assert what and args.generation_batch_size == 32 and args.guidance_scale == reference.guidance_scale
            assert (args.policy_loss, args.num_iterations) == ("dppo", 2) if settings.name == "flow-dppo" else \
                (args.branch_steps, args.num_generations, args.sde_window_size) == ([0, 2, 4], 8, 0)
            continue
        if settings.trainer in ("dgpo", "crd"):  # CFG-free DPM-Solver++ rollouts of toy_nft_fast, the EMA evaluated
            args = toy_trainer_classes(settings.trainer)[0](output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                           **settings.config_kwargs())
            assert what and args.generation_batch_size == 32 and args.num_generations == 8
            assert (args.guidance_scale, args.num_inference_steps, args.sampler) == (1.0, 6, "dpmpp_2m")
            assert args.use_ema and args.ema_decay == 0.9 and args.eval_guidance_scales == [1.0, 3.0]
            if settings.trainer == "dgpo":  # 2 of the first 4 steps, no trust region (it clipped nothing here)
                assert not args.dgpo_clip_dsm and (args.dgpo_num_timesteps, args.dgpo_trunc_steps) == (2, 3)
            continue
        if settings.name == OPD_VARIANT:  # a fresh student on its SDE rollouts, the two experts in turn
            args = toy_trainer_classes(settings.trainer)[0](output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                                           **settings.config_kwargs())
            assert what and args.generation_batch_size == 32 and args.guidance_scale == reference.guidance_scale
            assert [t["lora"] for t in args.teachers] == [f"{OPD_EXPERTS}/shape", f"{OPD_EXPERTS}/color"]
            assert (args.sde_window_size, args.opd_kl, args.teacher_lora) == (0, "exact", None)
            continue
        if settings.name == NFT_VARIANT:  # the other trainer: its own fields, the recipe's world and batch
            assert settings.trainer == "diffusion_nft" and what
            args = DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings.config_kwargs())
            assert args.generation_batch_size == 32 and args.guidance_scale == 1.0  # published: CFG-free
            assert (args.num_inference_steps, args.num_trained_timesteps, args.num_generations) == (10, 9, 8)
            assert args.eval_guidance_scales == [1.0, 3.0] and args.ema_decay == 0.9
            continue
        if settings.name == "diffusion-nft-fast":  # the published settings but 6 steps, 2 of them trained
            nft = next(s for s, _ in variants if s.name == NFT_VARIANT)
            args = DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings.config_kwargs())
            assert (args.num_inference_steps, args.num_trained_timesteps) == (6, 2) and what
            fast = {k: v for k, v in settings.config_kwargs().items() if k not in ("num_inference_steps",
                                                                                    "timestep_fraction")}
            assert fast == {k: v for k, v in nft.config_kwargs().items() if k not in ("num_inference_steps",
                                                                                        "timestep_fraction")}
            continue
        assert what and settings.trainer == "flow_grpo"
        changed = {f.name for f in dataclasses.fields(RLSettings)
                   if f.name != "name" and getattr(settings, f.name) != getattr(reference, f.name)}
        assert changed <= algorithm_fields and (changed or settings is reference), (settings.name, changed)
        args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings.config_kwargs())
        assert args.generation_batch_size == 32
    kl = [s for s, _ in variants if s.name.startswith("kl-")]
    assert sorted(s.kl_estimator for s in kl) == ["analytic", "k1", "k3", "velocity"] and all(s.beta > 0 for s in kl)
    flash = next(s for s, _ in variants if s.name == "mixgrpo-flash")
    assert (flash.sde_window_strategy, flash.ode_solver, flash.ode_compression_ratio) == ("progressive", "dpmpp_2m", 0.4)
    assert flash.sde_window_shift_interval == 20 and flash.sde_window_range == reference.sde_window_range
    # A later trainer is one more TOY_TRAINERS entry; unknown names fail clearly.
    assert toy_trainer_classes("flow_grpo")[0] is FlowGRPOConfig and "flow_grpo" in TOY_TRAINERS
    assert toy_trainer_classes("diffusion_nft")[0] is DiffusionNFTConfig
    with pytest.raises(ValueError, match=r"\['noise_level'\] configure Flow-GRPO"):  # no silent no-op settings
        RLSettings(trainer="diffusion_nft", noise_level=0.5).config_kwargs()
    with pytest.raises(ValueError, match="trainer='nft'"):
        toy_trainer_classes("nft")
    assert RLSettings(extra_config={"beta": 0.5}).config_kwargs()["beta"] == 0.5


@pytest.mark.parametrize("recipe", sorted(TOY_RECIPES))
def test_toy_variant_recipes_run_the_leaderboard_variants(recipe):
    """Each toy recipe is its leaderboard variant at the recipe's 1000 steps (same algorithm fields)."""
    _, model, args = parse_recipe([str(REPO / "recipes" / recipe)])
    settings = {s.name: s for s, _ in leaderboard_variants(args.max_steps)}[TOY_RECIPES[recipe]]
    expected = settings.config_kwargs()
    for key in ("per_device_train_batch_size", "reward_weights"):  # the recipe adds a weight-0 shape monitor
        expected.pop(key)
    for key, value in expected.items():
        actual = getattr(args, key)
        actual = getattr(actual, "value", actual)
        if key == "sde_window_range" and value is None:
            continue  # the config fills in its default
        assert actual == value, (recipe, key, actual, value)
    assert model.lora_r == settings.lora_r and model.use_peft == settings.use_lora
    assert type(args) is toy_trainer_classes(settings.trainer)[0]
    text = (REPO / "recipes" / recipe).read_text()
    assert f"python src/train.py recipes/{recipe}" in text and "# Hardware:" in text


def test_toy_dpo_recipe_online_runs_the_dpo_variant():
    """recipes/toy_dpo.yaml is offline by default; with --dpo_mode online it is the leaderboard's diffusion-dpo row."""
    _, model, args = parse_recipe([str(REPO / "recipes" / "toy_dpo.yaml"), "--dpo_mode", "online"])
    settings = {s.name: s for s, _ in leaderboard_variants(args.max_steps)}["diffusion-dpo"]
    expected = settings.config_kwargs()
    expected.pop("reward_weights")  # the recipe adds a weight-0 shape monitor
    for key, value in expected.items():
        actual = getattr(args, key)
        assert getattr(actual, "value", actual) == value, (key, actual, value)
    assert model.lora_r == settings.lora_r and args.generation_batch_size == 32


def test_mixgrpo_recipes_carry_the_published_settings():
    _, model, flux = parse_recipe(["recipes/mixgrpo_flux.yaml", "--use_cpu", "true"])
    script, _, flash = parse_recipe(["recipes/mixgrpo_flash_sd35m.yaml", "--use_cpu", "true"])
    assert model.model_name_or_path == "black-forest-labs/FLUX.1-dev"
    for args in (flux, flash):
        assert (args.num_inference_steps, args.sde_window_size, args.noise_level) == (25, 4, 0.7)
        assert args.sde_window_strategy == "progressive" and args.sde_window_roll_back and args.same_noise_per_group
        assert args.reward_aggregation == "normalize_then_sum" and args.beta == 0.0 and args.num_generations == 12
    assert flux.sde_window_shift_interval == 25 and flux.ode_solver == "euler"
    assert (flash.ode_solver, flash.ode_compression_ratio, flash.sde_window_shift_interval) == ("dpmpp_2m", 0.4, 20)
    assert script.reward_funcs == ["pickscore", "remote", "remote"]


def fake_run(name: str, seed: int, shape_by_step: dict[int, float], seconds_per_step: float) -> dict:
    steps = max(shape_by_step)
    curve = [{"step": k, "train_seconds": k * seconds_per_step, "shape": v, "color": 0.9}
             for k, v in sorted(shape_by_step.items())]
    return {"settings": {**dataclasses.asdict(RLSettings(name=name, seed=seed, max_steps=steps))},
            "before": {"shape": shape_by_step[0]}, "curve": curve, "train_seconds": steps * seconds_per_step}


def test_summary_figures_budgets_and_seed_spread():
    results = []
    for seed, offset in enumerate((0.00, 0.01, 0.02)):
        results.append(fake_run(REFERENCE_VARIANT, seed, {0: 0.4, 10: 0.45 + offset, 20: 0.50 + offset}, 1.0))
        # Twice as slow per step but better at equal steps, beyond the seed spread.
        results.append(fake_run("slow-good", seed, {0: 0.4, 10: 0.55 + offset, 20: 0.60 + offset}, 2.0))
        # Overlaps the reference at every point.
        results.append(fake_run("same", seed, {0: 0.4, 10: 0.46 - offset, 20: 0.51 - offset}, 1.0))
    summary = summarize(results, {"slow-good": "a slower, better variant"})
    by_name = {v.name: v for v in summary["variants"]}
    assert summary["steps"] == 20 and summary["budgets"] == pytest.approx([5.0, 10.0, 20.0])
    ref, slow, same = by_name[REFERENCE_VARIANT], by_name["slow-good"], by_name["same"]
    assert same.at_steps.separated_from(ref.at_steps) == 0 and slow.at_steps.separated_from(ref.at_steps) == 1
    assert ref.at_steps.mean == pytest.approx(0.51) and (ref.at_steps.low, ref.at_steps.high) == (0.50, 0.52)
    assert slow.seconds_per_step.mean == pytest.approx(2.0) and ref.seconds_per_step.mean == pytest.approx(1.0)
    # Equal wall-clock: at 20 s the slow variant has reached step 10 (its last evaluation within the budget).
    assert slow.at_budgets[-1].values == pytest.approx([0.55, 0.56, 0.57])
    assert slow.steps_at_budgets[-1].mean == 10 and ref.steps_at_budgets[-1].mean == 20
    assert slow.at_budgets[0].values == pytest.approx([0.4] * 3)  # 5 s: no evaluation after step 0 yet
    assert ("slow-good", REFERENCE_VARIANT, "steps") in summary["separated"]
    assert ("slow-good", REFERENCE_VARIANT, "budget") in summary["separated"]
    assert not any("same" in pair[:2] and REFERENCE_VARIANT in pair[:2] for pair in summary["separated"])
    assert accuracy_at_budget(results[0]["curve"], 9.99) == (0.4, 0)

    page = render_leaderboard(summary, {"command": "python scripts/learning_benchmark.py --leaderboard",
                                        "machine": "test", "date": "today", "commit": "abc", "eval": "e",
                                        "total_minutes": 60.0})
    assert "## At equal steps (20 optimizer steps)" in page and "## At equal wall-clock budgets" in page
    assert "| slow-good | a slower, better variant | 3 | 40.0% (40.0%-40.0%) | **61.0% (60.0%-62.0%)** | +10.0 pts, above, beyond the " \
           "seed spread | 90.0% (90.0%-90.0%) | 2.00 |" in page
    assert "| same |  | 3 | 40.0% (40.0%-40.0%) | **50.0% (49.0%-51.0%)** | -1.0 pts, within the seed spread |" in page
    assert "- at 20 steps: slow-good > fast-random; slow-good > same" in page
    assert "quick smoke" not in page and "how it was run" not in page
    noted = render_leaderboard(summary, {"note": "two processes at once, one thread each"})
    assert "- how it was run: two processes at once, one thread each" in noted

    # A fixed budget (the learning goal's) joins the fractions when every run has reached it, and only then.
    goal = summarize(results, budget_seconds=(12.0, 25.0))
    assert goal["budgets"] == pytest.approx([5.0, 10.0, 12.0, 20.0]) and goal["fixed_budget"] == 12.0
    assert {p["how"] for p in goal["paired"]} == {"steps", "budget", "fixed"}
    goal_page = render_leaderboard(goal, {})
    assert "- at 12 s of training, beyond the noise:" in goal_page and "and 12 s fixed)." in goal_page

    one_seed = summarize([r for r in results if r["settings"]["seed"] == 0])
    assert one_seed["separated"] == []
    assert "one seed" in render_leaderboard(one_seed, {"quick": True})


def test_bootstrap_intervals_paired_verdicts_and_plot(tmp_path):
    """Five seeds: a variant better by 5 points on every seed is beyond the noise (paired, although the seed spread
    of each side overlaps the other's); one whose seed-by-seed differences change sign is not."""
    from flowgrpo.toy.leaderboard import bootstrap_interval, paired_difference, plot_leaderboard

    low, high = bootstrap_interval([0.4, 0.5, 0.6])
    assert 0.4 <= low < 0.5 < high <= 0.6 and bootstrap_interval([0.3]) == (0.3, 0.3)
    assert bootstrap_interval([0.4, 0.5, 0.6]) == (low, high)  # a fixed resampling seed: reproducible pages
    base = {0: 0.40, 1: 0.48, 2: 0.44, 3: 0.52, 4: 0.46}
    better = {k: v + 0.05 for k, v in base.items()}
    mixed = {k: v + (0.03 if k % 2 else -0.03) for k, v in base.items()}
    diff = paired_difference(better, base)
    assert diff["mean"] == pytest.approx(0.05) and diff["beyond"] and diff["seeds"] == 5
    assert not paired_difference(mixed, base)["beyond"] and paired_difference({0: 1.0}, {0: 0.0}) is None
    results = []
    for seed, value in base.items():
        results.append(fake_run(REFERENCE_VARIANT, seed, {0: 0.4, 10: value, 20: value}, 1.0))
        results.append(fake_run("better", seed, {0: 0.4, 10: better[seed], 20: better[seed]}, 1.0))
        results.append(fake_run("mixed", seed, {0: 0.4, 10: mixed[seed], 20: mixed[seed]}, 1.5))
    summary = summarize(results)
    paired = {(p["better"], p["worse"], p["how"]): p for p in summary["paired"]}
    assert paired[("better", REFERENCE_VARIANT, "steps")]["beyond"]
    assert not any(p["beyond"] for k, p in paired.items() if "mixed" in k[:2] and REFERENCE_VARIANT in k[:2])
    assert summary["intervals"]["better"]["steps"][0] < 0.52 < summary["intervals"]["better"]["steps"][1]
    page = render_leaderboard(summary, {"plot": "leaderboard.png"})
    assert "## Means with 95% bootstrap intervals, and paired differences" in page
    assert "better > fast-random by 5.0 pts [5.0, 5.0]" in page
    assert "![held-out shape accuracy against training seconds" in page
    path = plot_leaderboard(results, tmp_path / "leaderboard.png", goal=(150.0, 0.599))
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_leaderboard_command_line_fails_fast_on_unknown_variants(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    import learning_benchmark as bench

    with pytest.raises(SystemExit):
        bench.main(["--leaderboard", "--only", "mixgrpo,no-such-variant", "--world", str(tmp_path / "missing")])
    assert "no-such-variant" in capsys.readouterr().err
    assert not (tmp_path / "missing").exists()
    runs, descriptions = bench.leaderboard_runs(50, [0, 1, 2], None, None)
    count = 24 + len(GOAL_ROWS)
    assert len(runs) == 3 * count and len(descriptions) == count and {r.seed for r in runs} == {0, 1, 2}
    assert all(r.max_steps == 50 for r in runs)


def test_the_cached_rollout_comparison_changes_only_the_cache(tmp_path):
    """--cache-comparison's two rows: the leaderboard's diffusion-nft-fast, and the same with rollout_cache, a
    configuration the trainer's checks accept (its run is smoke-tested by hand: docs/benchmarks.md)."""
    from flowgrpo.toy.leaderboard import CACHED_ROLLOUT_CACHE, cached_rollout_variants
    from flowgrpo.trainer.registry import TRAINERS
    from flowgrpo.trainer.speed_settings import check_speed_settings

    (plain, _), (cached, what) = cached_rollout_variants(300)
    assert plain == next(s for s, _ in leaderboard_variants(300) if s.name == "diffusion-nft-fast")
    extra = dict(cached.extra_config)
    assert extra.pop("rollout_cache") == CACHED_ROLLOUT_CACHE and extra.pop("rollout_cache_config") == {}
    assert dataclasses.replace(cached, name=plain.name, extra_config=extra) == plain and CACHED_ROLLOUT_CACHE in what
    args = DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **cached.config_kwargs())
    check_speed_settings(args, TRAINERS["diffusion_nft"].facts(args), "sd3", uses_cfg=False)  # the toy world: SD3
    sys.path.insert(0, str(REPO / "scripts"))
    import learning_benchmark as bench

    runs, _ = bench.leaderboard_runs(300, [0, 1, 2], [plain.name, cached.name], None)
    assert [(r.name, r.seed) for r in runs] == [(n, s) for n in (plain.name, cached.name) for s in (0, 1, 2)]


def test_leaderboard_splits_variants_over_processes():
    sys.path.insert(0, str(REPO / "scripts"))
    import learning_benchmark as bench

    names = [s.name for s, _ in leaderboard_variants(10)]
    shards = bench.shard_variants(names, 2)
    assert sorted(shards[0] + shards[1]) == sorted(names) and not set(shards[0]) & set(shards[1])
    slowest = sorted(names, key=lambda n: -bench.VARIANT_COST.get(n, 1.0))[:2]
    assert (slowest[0] in shards[0]) != (slowest[1] in shards[0])  # the two slowest apart
    loads = [sum(bench.VARIANT_COST.get(n, 1.0) for n in shard) for shard in shards]
    assert abs(loads[0] - loads[1]) <= max(bench.VARIANT_COST.values())
    assert bench.shard_variants(["a"], 3) == [["a"]]
    argv = ["--leaderboard", "--only", "a,b", "--processes=2", "--note", "x y", "--seeds", "0"]
    assert bench._without_options(argv, ("--only", "--processes", "--note")) == ["--leaderboard", "--seeds", "0"]


@pytest.mark.xdist_group("toy_light_world")  # the worker that built the light world for tests/toy/test_toy_world.py
def test_quick_leaderboard_runs_in_two_processes(tmp_path, toy_light_world):
    """Two concurrent processes train their share of the variants; the parent reuses their runs and writes the page
    with a line saying how it was run. The light world (seconds to build) follows prompts badly, which is fine
    here: only the machinery is under test."""
    sys.path.insert(0, str(REPO / "scripts"))
    import learning_benchmark as bench

    world = toy_light_world
    output = tmp_path / "out"
    status = bench.main(["--leaderboard", "--quick", "--processes", "2", "--only", "fast-random,mixgrpo-flash",
                         "--seeds", "0", "--max-eval-prompts", "2", "--threads", "1", "--world", str(world), "--output", str(output),
                         "--archive", str(tmp_path / "archive")])
    assert status == 0
    for i, variant in enumerate(("fast-random", "mixgrpo-flash")):
        assert f"[leaderboard] 1/1 {variant} seed 0" in (output / f"process{i}.log").read_text()
        assert (output / variant / "seed0" / "result.json").is_file()
    page = (output / "leaderboard.md").read_text()
    assert "- how it was run: as 2 processes at the same time (fast-random; mixgrpo-flash), 1 torch thread each" \
        in page
    assert "| fast-random |" in page and "| mixgrpo-flash |" in page

    # The archive keeps each run with where it was made; another output folder (a fresh checkout) reuses it and
    # trains nothing.
    kept = json.loads((tmp_path / "archive" / "fast-random" / "seed0.json").read_text())
    assert kept["world"] == world_digest(world) and {"date", "commit", "machine"} <= set(kept["made"])
    assert kept["code"]["consistent"] and len(kept["code"]["digest"]) == 64  # reused below: the same code
    again = tmp_path / "again"
    assert bench.main(["--leaderboard", "--quick", "--only", "fast-random,mixgrpo-flash", "--seeds", "0",
                       "--max-eval-prompts", "2", "--threads", "1", "--world", str(world), "--output", str(again),
                       "--archive", str(tmp_path / "archive")]) == 0
    assert not (again / "fast-random" / "seed0").exists()
    assert "| fast-random |" in (again / "leaderboard.md").read_text()
    # --finished-only trains nothing and says which planned runs are missing
    partial = tmp_path / "partial"
    assert bench.main(["--leaderboard", "--quick", "--finished-only", "--only", "fast-random,mixgrpo-flash",
                       "--seeds", "0,1", "--max-eval-prompts", "2", "--world", str(world), "--output", str(partial),
                       "--archive", str(tmp_path / "archive")]) == 0
    page = (partial / "leaderboard.md").read_text()
    assert "- **incomplete**: 2 of 4 planned runs are not made yet (fast-random (seed 1), mixgrpo-flash (seed 1))" in page
    assert "- runs made: 2 on " in page and not (partial / "fast-random" / "seed1").exists()
    # ... but never a run made on another world, or with other settings.
    settings = bench.leaderboard_runs(3, [0], ["fast-random"], None)[0][0]
    path = tmp_path / "archive" / "fast-random" / "seed0.json"
    assert bench.reusable_run(path, settings, kept["eval"], kept["world"]) is not None
    assert bench.reusable_run(path, settings, kept["eval"], "another-world") is None
    assert bench.reusable_run(path, dataclasses.replace(settings, learning_rate=1.0), kept["eval"], kept["world"]) is None
