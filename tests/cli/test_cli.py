"""The launch script's parsing, data loading and run reports: recipes, overrides, bad input, prompt files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from flowgrpo.cli import RecipeError, build_peft_config, load_prompt_dataset, load_recipe, parse_recipe
from flowgrpo.cli.arguments import DEFAULT_LORA_TARGET_MODULES, ModelArguments, ScriptArguments

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name repository-relative paths


def write_recipe(tmp_path: Path, text: str, name: str = "recipe.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- recipes, overrides and precedence ---------------------------------------------------------------------------

def test_tiny_recipe_parses_into_the_three_groups():
    script_args, model_args, training_args = parse_recipe(TINY)
    assert script_args.dataset_name == "data/ocr_synthetic"
    assert script_args.reward_funcs == ["ocr", "jpeg_compressibility"]
    assert model_args.build_tiny_pipeline_if_missing == "sd3" and model_args.lora_r == 4
    assert training_args.reward_weights == [1.0, 0.1]
    assert training_args.num_generations == 2 and training_args.resolution == 64
    assert training_args.learning_rate == pytest.approx(1e-3)  # YAML's "1.0e-3" read with the field's type


def test_overrides_then_command_line_win_over_the_recipe():
    _, model_args, args = parse_recipe([TINY, "--max_steps", "3", "--lora_r", "2"],
                                       overrides={"max_steps": 5, "learning_rate": 2e-4})
    assert args.max_steps == 3  # the command line beats overrides
    assert args.learning_rate == pytest.approx(2e-4)  # overrides beat the recipe
    assert model_args.lora_r == 2
    _, _, args = parse_recipe(["--config", TINY, "--noise_level", "0.5"])
    assert args.noise_level == pytest.approx(0.5)


def test_recipe_env_mapping_is_exported(tmp_path, monkeypatch):
    monkeypatch.delenv("FLOWGRPO_TEST_ENV", raising=False)
    text = Path(TINY).read_text() + "\nenv:\n  FLOWGRPO_TEST_ENV: hello\n"
    parse_recipe(write_recipe(tmp_path, text))
    import os

    assert os.environ["FLOWGRPO_TEST_ENV"] == "hello"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_parses_and_states_its_hardware(recipe):
    text = recipe.read_text()
    assert "# Hardware:" in text, f"{recipe.name} must say what hardware it expects"
    # GPU recipes ask for bf16, which TrainingArguments refuses on a machine without a GPU unless use_cpu is set
    script_args, model_args, args = parse_recipe([str(recipe), "--use_cpu", "true"])
    assert script_args.reward_funcs and model_args.model_name_or_path
    assert args.generation_batch_size % args.num_generations == 0
    build_peft_config(model_args)


def test_published_ocr_recipe_settings():
    _, model_args, args = parse_recipe(["recipes/ocr.yaml", "--use_cpu", "true"])
    assert model_args.model_name_or_path == "stabilityai/stable-diffusion-3.5-medium"
    assert (args.resolution, args.num_inference_steps, args.eval_num_inference_steps) == (512, 10, 40)
    assert (args.guidance_scale, args.noise_level, args.beta, args.epsilon) == (4.5, 0.7, 0.04, 1e-4)
    assert (model_args.lora_r, model_args.lora_alpha) == (32, 64)
    assert args.sde_window_size == 2 and args.use_ema and args.activation_checkpointing


# ---- bad input: clear errors before any work ---------------------------------------------------------------------

def test_unknown_recipe_key_names_it_and_the_closest_valid_keys(tmp_path):
    recipe = write_recipe(tmp_path, Path(TINY).read_text() + "\nlearning_rat: 0.1\nnum_generation: 4\n")
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe)
    message = str(err.value)
    assert "'learning_rat'" in message and "'learning_rate'" in message
    assert "'num_generation'" in message and "'num_generations'" in message


def test_unknown_command_line_flag_and_override(tmp_path):
    with pytest.raises(RecipeError, match=r"--max_step.*--max_steps"):
        parse_recipe([TINY, "--max_step", "3"])
    with pytest.raises(RecipeError, match="'nosie_level'.*'noise_level'"):
        parse_recipe(TINY, overrides={"nosie_level": 0.3})


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(RecipeError, match="learning_rate='fast'"):
        parse_recipe(write_recipe(tmp_path, Path(TINY).read_text() + "\nlearning_rate: fast\n"))
    with pytest.raises(RecipeError, match="sde_type"):
        parse_recipe([TINY, "--sde_type", "ddim"])
    with pytest.raises(RecipeError, match="unknown reward 'ocrr'.*'ocr'"):
        parse_recipe([TINY, "--reward_funcs", "ocrr", "--reward_weights", "1.0"])
    with pytest.raises(RecipeError, match="reward_weights has 1 value"):
        parse_recipe([TINY, "--reward_weights", "1.0"])
    # rewards replaced on the command line without weights: the recipe's weights (for its own rewards) are dropped
    script_args, _, args = parse_recipe([TINY, "--reward_funcs", "jpeg_compressibility"])
    assert script_args.reward_funcs == ["jpeg_compressibility"] and args.reward_weights is None
    with pytest.raises(RecipeError, match="reward_weights has 2 value"):  # weights given with them are checked
        parse_recipe([TINY, "--reward_funcs", "ocr", "--reward_weights", "1.0", "2.0"])
    with pytest.raises(RecipeError, match="lora_init='kaiming'"):
        parse_recipe([TINY, "--lora_init", "kaiming"])
    with pytest.raises(RecipeError, match="build_tiny_pipeline_if_missing='sdxl'"):
        parse_recipe([TINY, "--build_tiny_pipeline_if_missing", "sdxl"])
    with pytest.raises(RecipeError, match="num_generations"):  # FlowGRPOConfig's own check, wrapped
        parse_recipe([TINY, "--num_generations", "3"])


def test_unreadable_recipes(tmp_path):
    with pytest.raises(RecipeError, match="Recipe file not found: 'recipes/nope.yaml'"):
        parse_recipe("recipes/nope.yaml")
    with pytest.raises(RecipeError, match="is a directory"):
        load_recipe(tmp_path)
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(write_recipe(tmp_path, "a: [1, 2\n"))
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_recipe(write_recipe(tmp_path, "- a\n- b\n"))


def _run_main(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "src/train.py", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})


def _main_in_process(argv: list[str], capsys) -> tuple[int, str]:
    """``flowgrpo.cli.main`` (what src/train.py runs) in this process: the exit status and stderr."""
    from flowgrpo.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


def test_train_script_fails_fast_on_a_missing_dataset_before_any_model_loads(tmp_path, capsys):
    out = tmp_path / "out"
    status, err = _main_in_process([TINY, "--dataset_name", str(tmp_path / "missing.txt"),
                                    "--model_name_or_path", str(tmp_path / "no-model"),
                                    "--build_tiny_pipeline_if_missing", "sd3", "--output_dir", str(out)], capsys)
    assert status == 2, err[-2000:]
    assert "flowgrpo: error:" in err and "missing.txt" in err and "Traceback" not in err
    assert not (tmp_path / "no-model").exists() and not out.exists()  # nothing was built or written


def test_the_final_weights_are_evaluated_once(tiny_sd3_path, tmp_path, capsys):
    """train() evaluates its last step under a step schedule; the script does not evaluate the same weights again
    (it printed and logged the final evaluation twice). Without a schedule it evaluates once, after training."""
    from flowgrpo.cli import main

    common = [TINY, "--model_name_or_path", str(tiny_sd3_path),
              "--max_steps", "1", "--max_eval_samples", "2", "--eval_on_start", "false", "--save_strategy", "no",
              "--reward_funcs", "jpeg_compressibility", "--reward_weights", "1.0"]
    for schedule in (["--eval_strategy", "steps", "--eval_steps", "1"], ["--eval_strategy", "no"]):
        trainer = main([*common, *schedule, "--output_dir", str(tmp_path / schedule[1])])
        assert [h["step"] for h in trainer.state.log_history if "eval_reward" in h] == [1]
        assert capsys.readouterr().out.count("evaluation at step 1") == 1


def test_train_script_help_and_unknown_flag(capsys):
    proc = _run_main(["--help"])  # the script itself, as a user runs it
    assert proc.returncode == 0 and "--num_generations" in proc.stdout and "--reward_funcs" in proc.stdout
    status, err = _main_in_process([TINY, "--learnin_rate", "1"], capsys)
    assert status == 2 and "--learnin_rate" in err and "--learning_rate" in err


def test_missing_model_folder_is_named(tmp_path):
    from flowgrpo.cli.train import prepare_model_path

    with pytest.raises(RecipeError, match="Model folder not found"):
        prepare_model_path(ModelArguments(model_name_or_path=str(tmp_path / "nothing")))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="holds no diffusers pipeline"):
        prepare_model_path(ModelArguments(model_name_or_path=str(occupied), build_tiny_pipeline_if_missing="sd3"))
    assert (occupied / "notes.txt").read_text() == "mine"  # never overwritten
    assert prepare_model_path(ModelArguments(model_name_or_path="org/some-model")) == "org/some-model"  # a Hub id


def test_tiny_pipeline_is_built_in_place_when_missing(tmp_path):
    from diffusers import DiffusionPipeline

    from flowgrpo.cli.train import prepare_model_path

    target = tmp_path / "models" / "tiny"
    path = prepare_model_path(ModelArguments(model_name_or_path=str(target), build_tiny_pipeline_if_missing="sd3"))
    assert Path(path) == target and (target / "model_index.json").is_file()
    assert [p.name for p in target.parent.iterdir()] == ["tiny"]  # no staging folder left behind
    assert type(DiffusionPipeline.from_pretrained(path)).__name__ == "StableDiffusion3Pipeline"


def test_model_folders_are_plugins_found_by_name(tmp_path, capsys):
    """build_tiny_pipeline_if_missing's builders are the "flowgrpo.model_folders" entry points (setup.py declares
    the package's table): a misspelt name gets the closest ones; the toy world's builder copies the world in place and
    prepares runs on it (its caption truncation notices quieted)."""
    import logging
    from importlib.metadata import entry_points

    from flowgrpo.cli.model_folders import BUILTIN_MODEL_FOLDERS, model_folder_builder
    from flowgrpo.cli.train import _prepare_toy_world_run, prepare_model_path

    installed = {ep.name: ep.value for ep in entry_points(group="flowgrpo.model_folders") if ep.dist.name == "flowgrpo"}
    assert installed == BUILTIN_MODEL_FOLDERS, "setup.py's model folders differ from the package's (or: make install)"
    with pytest.raises(RecipeError, match="did you mean 'wan_i2v'"):
        model_folder_builder("wan_i2")
    with pytest.raises(ValueError, match="did you mean 'flux2_klein'"):  # the recipe's check, before any work
        ModelArguments(model_name_or_path=str(tmp_path / "m"), build_tiny_pipeline_if_missing="flux2_klien")
    target = tmp_path / "world"
    path = prepare_model_path(ModelArguments(model_name_or_path=str(target), build_tiny_pipeline_if_missing="toy"))
    assert f"[flowgrpo] preparing the toy world (seed 0) in {target}" in capsys.readouterr().out
    assert (Path(path) / "model_index.json").is_file() and (Path(path) / "toy_world.json").is_file()
    sd3_log = logging.getLogger("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3")
    toy_filters = lambda: [f for f in sd3_log.filters if type(f).__name__ == "_ToyT5TruncationFilter"]  # noqa: E731
    for f in toy_filters():  # installed by an earlier test of this process: start without it
        sd3_log.removeFilter(f)
    _prepare_toy_world_run(ScriptArguments(dataset_name=str(target / "prompts_train.txt")), path)
    assert len(toy_filters()) == 1


def test_prompts_inside_a_model_folder_to_build_are_read_after_building(tmp_path):
    from flowgrpo.cli.train import _prompts_come_with_model

    model = ModelArguments(model_name_or_path=str(tmp_path / "world"), build_tiny_pipeline_if_missing="toy")
    inside = ScriptArguments(dataset_name=str(tmp_path / "world" / "prompts_train.txt"))
    outside = ScriptArguments(dataset_name=str(tmp_path / "prompts.txt"))
    assert _prompts_come_with_model(inside, model)
    assert not _prompts_come_with_model(outside, model)
    assert not _prompts_come_with_model(inside, ModelArguments(model_name_or_path=str(tmp_path / "world")))


# ---- prompt datasets -----------------------------------------------------------------------------------------------

def test_prompt_files_in_every_format(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = ['a sign that says "A"', 'a sign that says "B"']
    (tmp_path / "p.txt").write_text(prompts[0] + "\n\n" + prompts[1] + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"text": p, "ocr_text": p[-2]}) + "\n" for p in prompts))
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    (tmp_path / "p.csv").write_text("text,ocr_text\n" + "".join(f'"{p.replace(chr(34), 2 * chr(34))}",x\n'
                                                                 for p in prompts))
    pq.write_table(pa.table({"text": prompts, "tag": [1, 2]}), tmp_path / "p.parquet")
    for suffix, column in (("txt", "prompt"), ("jsonl", "text"), ("json", "prompt"), ("csv", "text"),
                           ("parquet", "text")):
        train, evaluation = load_prompt_dataset(ScriptArguments(dataset_name=str(tmp_path / f"p.{suffix}"),
                                                                prompt_column=column))
        assert train["prompt"] == prompts, suffix
        assert evaluation is None  # a single file has no test split
    train, _ = load_prompt_dataset(ScriptArguments(dataset_name=str(tmp_path / "p.jsonl"), prompt_column="text"))
    assert train.column_names == ["prompt", "ocr_text"]  # other columns reach the rewards


def test_prompt_folder_splits_limits_and_errors(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text("".join(f"prompt {i}\n" for i in range(10)))
    (data / "test_metadata.jsonl").write_text("".join(json.dumps({"prompt": f"eval {i}", "tag": "x"}) + "\n"
                                                      for i in range(5)))
    train, evaluation = load_prompt_dataset(ScriptArguments(dataset_name=str(data), max_train_samples=3,
                                                            max_eval_samples=2))
    assert train["prompt"] == ["prompt 0", "prompt 1", "prompt 2"]
    assert evaluation["prompt"] == ["eval 0", "eval 1"] and evaluation["tag"] == ["x", "x"]
    _, evaluation = load_prompt_dataset(ScriptArguments(dataset_name=str(data), dataset_test_split="none"))
    assert evaluation is None
    with pytest.raises(RecipeError, match="no 'validation' prompt file"):
        load_prompt_dataset(ScriptArguments(dataset_name=str(data), dataset_train_split="validation"))
    with pytest.raises(RecipeError, match="no column 'caption'"):
        load_prompt_dataset(ScriptArguments(dataset_name=str(data), prompt_column="caption"))
    with pytest.raises(RecipeError, match="unsupported extension '.tsv'"):
        (tmp_path / "p.tsv").write_text("x\n")
        load_prompt_dataset(ScriptArguments(dataset_name=str(tmp_path / "p.tsv")))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(RecipeError, match="line 2 is not JSON"):
        load_prompt_dataset(ScriptArguments(dataset_name=str(tmp_path / "bad.jsonl")))
    with pytest.raises(RecipeError, match="scripts/make_ocr_prompts.py"):
        load_prompt_dataset(ScriptArguments(dataset_name="data/ocr_synthetic_missing/"))


def test_shipped_synthetic_ocr_prompts_are_reproducible(tmp_path):
    from flowgrpo.cli import write_ocr_prompt_files

    write_ocr_prompt_files(tmp_path, 64, 8, 0, "txt")
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.txt").read_text() == (REPO / "data" / "ocr_synthetic" / f"{split}.txt").read_text()
    train = set((tmp_path / "train.txt").read_text().splitlines())
    assert not train & set((tmp_path / "test.txt").read_text().splitlines())


def test_lora_config_from_model_arguments():
    config = build_peft_config(ModelArguments(model_name_or_path="x", lora_r=8, lora_alpha=16, lora_init="gaussian"))
    assert (config.r, config.lora_alpha, config.init_lora_weights) == (8, 16, "gaussian")
    assert config.target_modules is None  # the trainer fills in the family's default targets
    named = build_peft_config(ModelArguments(model_name_or_path="x", lora_target_modules=["to_q", "to_v"]))
    assert set(named.target_modules) == {"to_q", "to_v"}
    assert build_peft_config(ModelArguments(model_name_or_path="x", use_peft=False)) is None
    from flowgrpo.models import SD3Adapter, WanAdapter

    assert set(SD3Adapter.default_lora_target_modules) == set(DEFAULT_LORA_TARGET_MODULES)
    assert all(t.startswith(("attn1.", "attn2.")) for t in WanAdapter.default_lora_target_modules)


# ---- run reports (the demo's pictures) -----------------------------------------------------------------------------

def test_summarize_run_plots_the_curve_and_puts_sheets_side_by_side(tmp_path):
    from flowgrpo.cli.report import summarize_run

    history = [{"eval_reward": 0.1, "eval_rewards/toy_shape/mean": 0.3, "eval_rewards/ocr/mean": 0.5, "step": 0}]
    history += [{"reward": 0.1 + 0.01 * s, "step": s} for s in range(1, 21)]
    history += [{"eval_reward": 0.4, "eval_rewards/toy_shape/mean": 0.6, "step": 20}]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    Image.new("RGB", (40, 30), "red").save(tmp_path / "eval_step_0.png")
    Image.new("RGB", (40, 30), "blue").save(tmp_path / "eval_step_20.png")
    Image.new("RGB", (40, 30), "green").save(tmp_path / "eval_step_5.png")
    summary = summarize_run(tmp_path)
    assert summary["eval_first"] == (0, 0.1) and summary["eval_last"] == (20, 0.4)
    assert summary["eval_components"] == {"toy_shape": (0.3, 0.6)}  # a reward evaluated once has no before/after
    assert summary["train_reward_first"] == pytest.approx(0.115) and summary["train_reward_last"] == pytest.approx(0.295)
    curve = Image.open(summary["reward_curve"])
    assert curve.size[0] > 300
    sheet = Image.open(summary["before_after"]).convert("RGB")
    assert sheet.getpixel((10, 30)) == (255, 0, 0) and sheet.getpixel((sheet.width - 10, 30)) == (0, 0, 255)


def test_demo_launch_line():
    sys.path.insert(0, str(REPO / "scripts"))
    import demo

    cmd = demo.launch_command("recipes/tiny_cpu.yaml", "out", 2, 3, ["--", "--seed", "1"])
    assert cmd[1:5] == ["-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_ddp.yaml"]
    assert cmd[-8:] == ["src/train.py", "recipes/tiny_cpu.yaml", "--output_dir", "out", "--max_steps", "3",
                        "--seed", "1"]
    assert "--cpu" in demo.launch_command("r.yaml", "out", 1, None, [])
    assert demo.main(["--recipe", "recipes/missing.yaml"]) == 2
    # the default recipe with the demo's settings parses as the run the README describes
    extra = [item for key, value in demo.DEMO_DEFAULTS.items() for item in (f"--{key}", str(value))]
    _, _, args = parse_recipe([demo.DEFAULT_RECIPE, *extra])
    assert args.max_steps == demo.DEMO_DEFAULTS["max_steps"] and args.eval_images_per_prompt == 8
    assert args.evaluation_guidance_scales == [3.0]  # the world's own guidance, once


def test_launch_script_drops_only_the_notices_of_unused_features():
    import logging

    import flowgrpo  # noqa: F401  (installs the filters on import)
    from flowgrpo.cli.notices import QUIET_NOTICES, NoticeFilter, quiet_library_notices

    quiet_library_notices()
    for name in QUIET_NOTICES:
        logger = logging.getLogger(name)
        assert sum(isinstance(f, NoticeFilter) for f in logger.filters) == 1

    def passes(name, message):
        logger = logging.getLogger(name)
        return logger.filter(logger.makeRecord(name, logging.WARNING, __file__, 1, message, None, None))

    assert not passes("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision (not installed); "
                      "falling back to `CLIPImageProcessorPil` for backward compatibility.")
    assert not passes("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: "
                      "No module named 'kernels'.")
    assert passes("transformers.utils.import_utils", "`Qwen2VLProcessor` requires torchvision.")
    assert passes("bitsandbytes.backends.cpu.ops", "another warning")
    assert not passes("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable "
                      "to detect it.")


def test_replacing_the_rewards_drops_the_recipes_weights_for_them():
    """A recipe's reward_weights belong to its reward_funcs: a command line that swaps in a different number of rewards
    without weights trains them unweighted; weights given with them, or rewards of the same number, are kept."""
    recipe = str(REPO / "recipes" / "toy_nft_fast.yaml")
    for argv in (["--reward_funcs", "toy_color"], ["--reward_funcs=toy_color"]):
        script, _, args = parse_recipe([recipe, *argv])
        assert script.reward_funcs == ["toy_color"] and args.reward_weights is None
    script, _, args = parse_recipe([recipe], overrides={"reward_funcs": ["toy_color"]})
    assert args.reward_weights is None
    _, _, args = parse_recipe([recipe, "--reward_funcs", "toy_color", "toy_shape", "toy_count"])
    assert args.reward_weights == [1.0, 0.5, 0.0]
    _, _, args = parse_recipe([recipe, "--reward_funcs", "toy_color", "--reward_weights", "2"])
    assert args.reward_weights == [2.0]
    with pytest.raises(RecipeError, match="reward_weights has 2 value"):
        parse_recipe([recipe, "--reward_funcs", "toy_color", "--reward_weights", "1", "2"])
