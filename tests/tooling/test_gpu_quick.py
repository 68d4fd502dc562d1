"""The quick GPU check (`scripts/gpu_quick.sh`, `flowgrpo.gpu_check.quick`) on a machine without a GPU.

What needs CUDA (the full-size SD3.5-M steps, the fsdp8 launch on a GPU) runs only on a lent GPU machine. Here: the
budget stated in the script and the one the runner enforces; a check over its limit killed and reported while the
others go on; the dry run of the script itself (the wheel install into a temporary folder, from a wheel built here or
the real `.whl/` when `make gpu-wheels` made one, the selection, the report); the checks' own code on the tiny
pipeline on the CPU (the recipe step timed by the harness, its plan, bf16 on-policy with and without CFG, the launch
recipe with its overrides), whose real results are then the recorded inputs a report is written from; and the
derivation of the carried wheels from this environment's metadata and the image's package list.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from flowgrpo.gpu_check import quick
from flowgrpo.gpu_check.plan import Check, check_dir, repo_root
from flowgrpo.gpu_check.runner import CheckResult

REPO = repo_root()
PY = sys.executable
SCRIPT = REPO / "scripts" / "gpu_quick.sh"
#: recipes/ocr.yaml and recipes/nft_ocr.yaml shrunk to the tiny SD3 pipeline on a CPU (the same code path)
TINY = ["--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--resolution", "64",
        "--max_sequence_length", "16", "--num_inference_steps", "4", "--per_device_train_batch_size", "2",
        "--num_generations", "2", "--gradient_accumulation_steps", "2", "--lora_r", "4", "--lora_alpha", "8"]
TINY_GRPO = [*TINY, "--sde_window_range", "0", "2"]  # the recipe's window range [0, 5] needs more than 4 steps


# ---- the budget ----------------------------------------------------------------------------------------------------

def test_budget_fits_in_six_minutes_and_the_script_states_it():
    plan = quick.budget()
    assert plan["budget_s"] == quick.BUDGET_S == 360 and plan["fits"]
    total = quick.SHELL_SETUP_S + sum(c.limit_s + quick.KILL_GRACE_S for c in quick.DEFAULT_CHECKS) + quick.REPORT_S
    assert plan["total_s"] == total <= 360
    assert [c.name for c in quick.QUICK_CHECKS] == ["setup/wheels", "bf16_onpolicy", "sd35m_step",
                                                     "plan_vs_measured", "nft_step", "launch/fsdp8", "sd35m_compile"]
    assert [c.name for c in quick.QUICK_CHECKS if not c.in_default_run] == ["sd35m_compile"]
    # compile off against on is a second call of its own, within the same budget
    assert quick.budget(quick.selected_checks(["sd35m_step", "sd35m_compile"]))["fits"]
    # the script's header states the same budget and limits as the module that enforces them
    comments = [line.lstrip("#").strip() for line in SCRIPT.read_text().splitlines() if line.startswith("#")]
    header = " ".join(comments)
    assert "Budget: 360 s" in header and f"allowed {quick.SHELL_SETUP_S} s" in header
    stated = dict(re.findall(r"(setup/wheels|bf16_onpolicy|sd35m_step|plan_vs_measured|nft_step|launch/fsdp8|"
                             r"sd35m_compile)\s+(\d+) s", header))
    assert {k: float(v) for k, v in stated.items()} == {c.name: c.limit_s for c in quick.QUICK_CHECKS}
    assert f"{quick.KILL_GRACE_S} s of kill grace" in header and f"the report {quick.REPORT_S} s" in header
    # one check more of the same size would not fit: the test guards the limits
    over = quick.budget((*quick.DEFAULT_CHECKS, quick.QuickCheck("extra", 60, "x")))
    assert not over["fits"] and over["total_s"] > 360


def test_the_plan_runs_each_check_from_the_repository_with_its_limit(tmp_path):
    import importlib.util

    checks = quick.build_quick_plan(tmp_path, site="/tmp/site", overrides=["--guidance_scale", "1.0"],
                                    gpu="h100-80gb")
    by_name = {c.name: c for c in checks}
    assert [c.timeout_s for c in checks] == [c.limit_s for c in quick.QUICK_CHECKS]
    for check in checks:
        module = check.command[check.command.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, module
    step, plan = by_name["sd35m_step"].command, by_name["plan_vs_measured"].command
    assert step[-2:] == ("--guidance_scale", "1.0") and plan[-2:] == ("--guidance_scale", "1.0")
    assert "--guidance_scale" not in by_name["nft_step"].command  # the overrides are sd35m_step's and its plan's
    assert plan[plan.index("--measured") + 1] == str(check_dir(tmp_path, "sd35m_step"))
    assert plan[plan.index("--gpu") + 1] == "h100-80gb"
    launch = by_name["launch/fsdp8"].command
    assert launch[launch.index("--config") + 1] == "fsdp8" and launch[launch.index("--num-processes") + 1] == "1"
    assert launch[launch.index("--recipe") + 1] == "recipes/ocr.yaml" and (REPO / "recipes/ocr.yaml").is_file()
    compiled = by_name["sd35m_compile"].command
    assert compiled[-4:] == ("--guidance_scale", "1.0", "--torch_compile", "true")  # the step's overrides, compiled
    assert "--import" in by_name["setup/wheels"].command
    assert "--import" not in quick.build_quick_plan(tmp_path, site="s", dry_run=True)[0].command


def test_the_compiled_step_is_reported_against_the_uncompiled_one():
    from flowgrpo.gpu_check.quick_report import _compile_section

    def step(times, first=None):
        return {"name": "x", "status": "passed", "metrics": {
            "step_records": [{"step": i + 1, "step_time_s": t} for i, t in enumerate(times)],
            "benchmark": {"step_time_s": times[-1], "step_times_s": times[1:]}, "first_step": first or {}}}

    lines = _compile_section(step([70.0, 8.0], {"timing/compile_s": 61.5, "compile/graphs": 4}), step([12.0, 10.0]))
    text = "\n".join(lines)
    assert "Compiling the blocks took 61.5 s" in text
    assert "| first step, s | 12 | 70 | 5.83 |" in text and "| steady step, s (median of the timed steps) | 10 | 8 | 0.8 |" in text


# ---- the run loop: limits, kills, the time left -------------------------------------------------------------------

SLEEPER = "import time; print('sleeping', flush=True); time.sleep(120)"


def _stand_in_plan(*args, **kwargs):
    """Three stand-in checks for the loop (the real ones need a GPU): one passes, one outlives its limit, one
    passes after it."""
    return [Check("setup/wheels", "passes", (PY, "-c", "print('first')"), 30),
            Check("sd35m_step", "sleeps past its limit", (PY, "-c", SLEEPER), 1.5),
            Check("nft_step", "passes", (PY, "-c", "print('third')"), 30)]


def test_a_check_over_its_limit_is_killed_and_reported_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quick, "cuda_gpu_count", lambda: (1, ""))
    monkeypatch.setattr(quick, "build_quick_plan", _stand_in_plan)
    tic = time.monotonic()
    code = quick.main([str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--gpu", "h100-80gb"])
    assert code == 1 and time.monotonic() - tic < 30
    data = json.loads((tmp_path / "out" / "gpu_report.json").read_text())
    assert [c["status"] for c in data["checks"]] == ["passed", "timed_out", "passed"] and data["finished"]
    assert "time limit of 2 s reached" in data["checks"][1]["failures"][0] and "sleeping" in data["checks"][1][
        "output_tail"]
    assert data["budget"]["budget_s"] == 360 and data["elapsed_s"] < 30 and not data["passed"]
    md = (tmp_path / "out" / "gpu_report.md").read_text()
    assert "| `sd35m_step` | timed out |" in md and "**2 of 3 checks passed (finished)**" in md
    logs = (tmp_path / "out" / "gpu_quick_logs.txt").read_text()
    assert "===== nft_step =====" in logs and "third" in logs
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_quick_logs.txt", "gpu_report.json",
                                                                     "gpu_report.md"]

    # started long ago: less than MIN_CHECK_S left of the budget, so every check is skipped, and said so
    late = time.time() - (quick.BUDGET_S - quick.REPORT_S - quick.KILL_GRACE_S - 3)
    assert quick.main([str(tmp_path / "late"), "--work", str(tmp_path / "work2"), "--started-at", str(late)]) == 1
    data = json.loads((tmp_path / "late" / "gpu_report.json").read_text())
    assert {c["status"] for c in data["checks"]} == {"skipped"}
    assert "of the 360 s budget left" in data["checks"][0]["notes"][0]
    capsys.readouterr()


def test_bad_input_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(quick, "cuda_gpu_count", lambda: (1, ""))
    out = tmp_path / "out"
    assert quick.main([str(out), "--max_steps", "5"]) == 2
    assert "--max_steps cannot be overridden here" in capsys.readouterr().err
    assert quick.main([str(out), "--dry-run", "--only", "sd35m"]) == 2
    assert "--only sd35m: no such check" in capsys.readouterr().err
    assert quick.main([str(out), "--recorded", "x.json"]) == 2
    assert "goes with --dry-run" in capsys.readouterr().err
    assert quick.main([str(out), "--dry-run", "--guidance_scal", "1.0"]) == 2
    err = capsys.readouterr().err
    assert "guidance_scal" in err and "guidance_scale" in err  # the recipe parser's closest valid key
    assert not out.exists()
    monkeypatch.setattr(quick, "cuda_gpu_count", lambda: (0, "nvidia-smi lists no GPU"))
    assert quick.main([str(out)]) == 2
    assert "no CUDA GPU on this machine" in capsys.readouterr().err and not out.exists()


# ---- the checks' code on a CPU; their results are the recorded inputs of a report ---------------------------------

def _result_of(name: str, folder: Path, limit: float) -> CheckResult:
    """A check's result as the runner reads it after the process (here the check ran in this process)."""
    data = json.loads((folder / "result.json").read_text())
    return CheckResult(name=name, description=name, command=["(in-process on the CPU)"],
                       status="passed" if data["passed"] else "failed", returncode=0 if data["passed"] else 1,
                       wall_s=float(data["metrics"].get("wall_s", 1.0)), timeout_s=limit, started_at="",
                       log="", output_tail="", metrics=data["metrics"], failures=data["failures"],
                       summary=data["summary"])


@pytest.fixture(scope="module")
def cpu_recorded(tmp_path_factory):
    """The bf16, recipe-step and plan checks run on the tiny SD3 pipeline on the CPU, written into a report: the
    ``gpu_report.json`` a dry run is then written from."""
    from flowgrpo.gpu_check import bf16_onpolicy, probe, recipe_step, step_plan
    from flowgrpo.gpu_check.quick_report import machine_section, write_quick_report
    from flowgrpo.testing import cached_tiny_pipeline_path

    root = tmp_path_factory.mktemp("quick-cpu")
    tiny = str(cached_tiny_pipeline_path("sd3", seed=0))
    limits = {c.name: c.limit_s for c in quick.QUICK_CHECKS}
    results = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(probe.CHECK_DIR_ENV, str(root / "bf16"))
        assert bf16_onpolicy.main(["--output", str(root / "bf16-work"), "--device", "cpu", "--models", "sd3-tiny",
                                   "--cfg", "both"]) == 0
    results.append(_result_of("bf16_onpolicy", root / "bf16", limits["bf16_onpolicy"]))
    overrides = [*TINY_GRPO, "--model_name_or_path", tiny]
    assert recipe_step.main(["--recipe", "recipes/ocr.yaml", "--output", str(root / "step"), "--model", "tiny",
                             "--compare-timesteps-per-pass", *overrides]) == 0
    results.append(_result_of("sd35m_step", root / "step", limits["sd35m_step"]))
    assert step_plan.main(["--recipe", "recipes/ocr.yaml", "--measured", str(root / "step"), "--gpu", "h100-80gb",
                           "--output", str(root / "plan"), *overrides]) == 0
    results.append(_result_of("plan_vs_measured", root / "plan", limits["plan_vs_measured"]))
    write_quick_report(results, root / "report", machine=machine_section("h100-80gb"), commit="abc1234",
                       command="(the checks run in-process on the CPU)", budget=quick.budget(),
                       overrides=overrides, started_at=time.time() - 1, setup_s=0.5)
    return root


@pytest.mark.xdist_group("gpu_quick_cpu_runs")  # one worker runs the CPU checks for both tests that read them
def test_cpu_runs_of_the_checks_write_the_figures_the_report_shows(cpu_recorded):
    from flowgrpo.gpu_check.quick_report import QUICK_TABLE_HEADER, render_markdown

    data = json.loads((cpu_recorded / "report" / "gpu_report.json").read_text())
    checks = {c["name"]: c for c in data["checks"]}
    bf16 = checks["bf16_onpolicy"]["metrics"]["models"]
    assert bf16["sd3-tiny"]["cfg"] is True and bf16["sd3-tiny/no-cfg"]["cfg"] is False
    assert bf16["sd3-tiny/no-cfg"]["guidance_scale"] == 1.0
    assert all(m["on_policy_ratio_max_dev"] <= 1e-3 and abs(m["kl"]) <= 1e-3 for m in bf16.values())

    step = checks["sd35m_step"]["metrics"]
    bench = step["benchmark"]
    assert step["settings"]["images_per_step"] == 4 and step["settings"]["sde_window_size"] == 2
    assert step["settings"]["reward_funcs"] == ["jpeg_compressibility"] and not step["partial"]
    assert [r["step"] for r in step["step_records"]] == [1, 2, 3]  # one warm-up, two timed, each written as it ended
    assert bench["step_times_s"] == [r["step_time_s"] for r in step["step_records"][1:]]
    parts = bench["breakdown"]
    assert parts["rollout"] > 0 and parts["training_forward"] > 0 and parts["training_backward"] > 0
    assert sum(parts.values()) == pytest.approx(bench["step_time_s"], rel=0.3)  # the median of parts ~ of steps
    assert step["first_step"]["on_policy_ratio_max_dev"] == 0.0 and step["first_step"]["kl"] == 0.0
    passes = step["timesteps_per_pass"]  # one more generation's training phase at K = 1 and all
    assert passes["trained_timesteps"] == 2 and passes["micro_batches"] == 2
    assert [passes["arms"][k]["passes_per_micro_batch"] for k in ("1", "all")] == [2, 1]
    assert all(passes["arms"][k]["on_policy_ratio_max_dev"] == 0.0 for k in ("1", "all"))  # on-policy, CPU float32
    assert passes["speedup"] == pytest.approx(passes["training_s"]["1"] / passes["training_s"]["all"])

    cmp = checks["plan_vs_measured"]["metrics"]["comparison"]
    assert cmp["gpu"] == "h100-80gb" and cmp["time"]["measured_step_s"] == bench["step_time_s"]
    assert cmp["time"]["achieved_tflops"] == pytest.approx(cmp["step_flops"] / bench["step_time_s"] / 1e12)
    assert cmp["memory"]["measured_allocated_gib"] is None  # a CPU run has no CUDA allocator to read

    md = (cpu_recorded / "report" / "gpu_report.md").read_text()
    assert md == render_markdown(data)  # the markdown is a function of the JSON alone
    assert "| sd3-tiny/no-cfg | 1 | False | 0 |" in md and "Median of the 2 timed steps" in md
    assert "| step time, s (planned at MFU 0.29) |" in md and QUICK_TABLE_HEADER in md
    assert "| train_timesteps_per_pass | passes a micro-batch |" in md and "| all | 1 |" in md
    assert QUICK_TABLE_HEADER in (REPO / "docs" / "benchmarks.md").read_text()  # the rows fit the docs' table
    row = data["docs_rows"]["sd35m_step"]
    assert row.startswith(f"| {data['date']} | 1x NVIDIA") or row.startswith(f"| {data['date']} | no GPU")
    assert row.count("|") == QUICK_TABLE_HEADER.count("|") and "(4 images)" in row


def test_the_nft_recipe_step_on_cpu_and_a_stopped_step_keeps_its_finished_steps(tmp_path, monkeypatch):
    from flowgrpo.gpu_check import recipe_step

    assert recipe_step.main(["--recipe", "recipes/nft_ocr.yaml", "--output", str(tmp_path / "nft"), "--model", "tiny",
                             "--steps", "1", *TINY]) == 0
    nft = json.loads((tmp_path / "nft" / "result.json").read_text())["metrics"]
    assert nft["settings"]["trainer"] == "diffusion_nft" and nft["settings"]["sampler"] == "dpmpp_2m"
    assert nft["first_step"] == {} and len(nft["step_records"]) == 2 and nft["benchmark"]["step_time_s"] > 0

    # a step that fails after the warm-up: result.json keeps the finished step, marked partial, and says why
    from flowgrpo.benchmarking import harness

    original = harness._BenchmarkClock.on_step_end

    def fail_on_second(self, args, state, control, **kwargs):
        if state.global_step == 2:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return original(self, args, state, control, **kwargs)

    monkeypatch.setattr(harness._BenchmarkClock, "on_step_end", fail_on_second)
    assert recipe_step.main(["--recipe", "recipes/ocr.yaml", "--output", str(tmp_path / "stopped"), "--model",
                             "tiny", *TINY_GRPO]) == 1
    stopped = json.loads((tmp_path / "stopped" / "result.json").read_text())
    assert not stopped["passed"] and stopped["metrics"]["partial"]
    assert [r["step"] for r in stopped["metrics"]["step_records"]] == [1]
    assert "CUDA out of memory (stand-in)" in stopped["failures"][0]
    assert recipe_step.main(["--recipe", "recipes/ocr.yaml", "--output", str(tmp_path / "bad"),
                             "--output_dir", "x"]) == 1
    assert "--output_dir cannot be overridden" in json.loads((tmp_path / "bad" / "result.json").read_text())[
        "failures"][0]


def test_the_launch_of_the_readme_recipe_with_its_overrides_on_cpu(tiny_sd3_path, tmp_path, monkeypatch):
    """`src/train.py recipes/ocr.yaml` with the launch check's overrides, through train.py's main on the CPU (one
    process instead of accelerate launch on a GPU), then the check's file-only look at the exported LoRA; the
    command itself is parsed by accelerate's own launch parser."""
    from accelerate.commands.launch import launch_command_parser

    from flowgrpo.cli import main as train_main
    from flowgrpo.gpu_check import launch

    run = tmp_path / "run"
    overrides = launch.recipe_launch_overrides(tiny_sd3_path, REPO / "data" / "ocr_synthetic", run)
    train_main(["recipes/ocr.yaml", *overrides, *TINY_GRPO,
                "--per_device_eval_batch_size", "2", "--eval_num_inference_steps", "2", "--max_eval_samples", "2"])
    found, problems = launch.read_training_log(run, expected_steps=2)
    assert not problems and found["global_step"] == 2 and found["on_policy_ratio_max_dev"] == 0.0
    lora, problems = launch.inspect_lora_file(run)
    assert not problems and lora["lora_layers_in_file"] > 0 and lora["nonzero_lora_B"] > 0

    command = launch.accelerate_command("fsdp8", 1, "recipes/ocr.yaml", port=29999, extra_args=overrides)
    args = launch_command_parser().parse_args(command[3:])
    assert args.config_file == "accelerate_configs/fsdp8.yaml" and args.num_processes == 1
    assert args.training_script_args == ["src/train.py", "recipes/ocr.yaml", *overrides]


# ---- the dry run of the script itself -----------------------------------------------------------------------------

def _tiny_wheel(folder: Path, name: str = "flowgrpo_quick_probe", version: str = "0.0.1",
                requires: tuple[str, ...] = ("packaging>=20",)) -> Path:
    """A pure-Python wheel built here by hand (no download): one module, its dist-info and RECORD."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f'__version__ = "{version}"\n',
             f"{dist}/METADATA": "Metadata-Version: 2.1\nName: " + name.replace("_", "-") + f"\nVersion: {version}\n"
                                 + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{path},sha256={digest(text)},{len(text.encode())}\n" for path, text in files.items())
    files[f"{dist}/RECORD"] = record + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


@pytest.mark.xdist_group("gpu_quick_cpu_runs")
def test_dry_run_of_the_script_installs_the_wheels_and_writes_the_report_from_recorded_inputs(cpu_recorded,
                                                                                              tmp_path):
    real = sorted((REPO / ".whl").glob("*.whl"))
    wheels = REPO / ".whl" if real else _tiny_wheel(tmp_path / "whl").parent
    expected = {p.name.split("-")[0].replace("_", "-").lower() for p in wheels.glob("*.whl")}
    env = {**os.environ, "PYTHON": PY, "TMPDIR": str(tmp_path), "FLOWGRPO_WHEEL_DIR": str(wheels),
           "FLOWGRPO_QUICK_WORK": str(tmp_path / "work")}
    env.pop("PYTHONPATH", None)  # the script puts the wheels' folder and src/ on it
    out = tmp_path / "out"
    recorded = cpu_recorded / "report" / "gpu_report.json"
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out), "--recorded", str(recorded)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(expected)} wheels installed into {tmp_path}/flowgrpo-site." in done.stdout
    site = next(tmp_path.glob("flowgrpo-site.*"))
    assert {p.name.split("-")[0].replace("_", "-").lower() for p in site.glob("*.dist-info")} == expected

    data = json.loads((out / "gpu_report.json").read_text())
    checks = {c["name"]: c for c in data["checks"]}
    assert data["dry_run"] and data["finished"] and data["budget"]["fits"]
    wheels_check = checks["setup/wheels"]
    assert wheels_check["status"] == "passed" and set(wheels_check["metrics"]["wheels"]["carried"]) == expected
    assert wheels_check["metrics"]["wheels"]["problems"] == []
    assert "diffusers>=0.42.1" in wheels_check["metrics"]["wheels"]["requirements"]["flowgrpo"]  # setup.py checked
    for name in ("bf16_onpolicy", "sd35m_step", "plan_vs_measured"):  # from the recorded report
        assert checks[name]["status"] == "passed" and "recorded: from gpu_report.json" in checks[name]["notes"][-1]
    assert checks["nft_step"]["status"] == "not_run" and checks["launch/fsdp8"]["status"] == "not_run"
    md = (out / "gpu_report.md").read_text()
    assert md.startswith("# Quick GPU check (dry run)") and "Median of the 2 timed steps" in md
    assert "dry run: not run (needs the GPU)" in md and data["docs_rows"]["sd35m_step"]
    assert data["command"] == f"scripts/gpu_quick.sh --dry-run {out} --recorded {recorded}"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_quick_logs.txt", "gpu_report.json", "gpu_report.md"]
    assert "wheels installed into" in (out / "gpu_quick_logs.txt").read_text()

    empty = tmp_path / "no-wheels"
    empty.mkdir()
    # no wheels: said at once, and the report is still written, with the set-up check failed for it
    missing = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(tmp_path / "out2")],
                             env={**env, "FLOWGRPO_WHEEL_DIR": str(empty)}, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "run 'make gpu-wheels'" in missing.stderr
    setup = json.loads((tmp_path / "out2" / "gpu_report.json").read_text())["checks"][0]
    assert setup["name"] == "setup/wheels" and setup["status"] == "failed"
    assert "run 'make gpu-wheels'" in setup["failures"][0] and "nothing is installed" in " ".join(setup["failures"])


# ---- the carried wheels -------------------------------------------------------------------------------------------

def test_the_wheel_set_is_derived_from_imports_requirements_and_the_image(tmp_path):
    from flowgrpo.gpu_check import wheels

    image = wheels.read_image_packages(REPO / wheels.IMAGE_PACKAGES_FILE)
    assert {"torch", "transformers", "accelerate", "peft", "huggingface-hub", "pyarrow"} <= image.names
    assert not {"diffusers", "datasets", "trl", "rapidocr"} & image.names
    assert image.versions["transformers"] == "5.17.0" and "2026-11-17" in image.header
    direct = wheels.flowgrpo_requirements(REPO / "setup.py")
    assert {"diffusers", "datasets", "torch", "trl"} <= {wheels.normalize(r.name) for r in direct}

    # what a run of the checks imports here, named as this environment names it (optional imports included)
    traced = {name: {} for name in ("diffusers", "datasets", "dill", "multiprocess", "torch", "transformers",
                                    "bitsandbytes", "ftfy", "wcwidth", "flowgrpo", "PyYAML")}
    found = wheels.derive_wheel_set(traced, image, direct)
    assert set(found.wheels) == {"datasets", "diffusers", "dill", "ftfy", "importlib-metadata", "lazy-importer",
                                 "multiprocess", "wcwidth"}
    assert found.wheels["diffusers"] == "0.42.1" and found.wheels["datasets"] == "5.2.0"  # setup.py's tested pins
    assert "bitsandbytes" in found.traced_missing_optional  # an extra of flowgrpo, imported only because present
    assert found.reasons["importlib-metadata"].startswith("required by diffusers")
    assert "trl" not in found.wheels  # required by flowgrpo but never imported by the quick check
    assert found.image_requirements["huggingface-hub"]  # met by the image, by name

    command = wheels.download_command(found.specs(), tmp_path)
    assert command[3:5] == ["download", "--no-deps"] and "--only-binary=:all:" in command
    assert command[command.index("--python-version") + 1] == "3.12" and "manylinux_2_28_x86_64" in command
    assert command[-len(found.specs()):] == found.specs()


@pytest.mark.slow
def test_trace_of_the_quick_checks_imports_finds_what_the_image_lacks():
    """The roots are imported in a fresh interpreter; what they load that flowgrpo requires and the image lacks
    is the carried set (this is what `make gpu-wheels` does before it downloads)."""
    from flowgrpo.gpu_check import wheels

    traced = wheels.trace_imports(quick.QUICK_IMPORT_ROOTS)
    assert {"torch", "diffusers", "datasets", "transformers", "peft", "accelerate"} <= set(traced)
    image = wheels.read_image_packages(REPO / wheels.IMAGE_PACKAGES_FILE)
    found = wheels.derive_wheel_set(traced, image, wheels.flowgrpo_requirements(REPO / "setup.py"))
    assert {"diffusers", "datasets", "dill", "multiprocess"} <= set(found.wheels)
    assert not {"torch", "transformers", "trl", "bitsandbytes", "deepspeed", "rapidocr"} & set(found.wheels)


def test_download_keeps_one_wheel_per_package_and_the_budget(tmp_path):
    from flowgrpo.gpu_check import wheels

    dest = tmp_path / "whl"
    kept = _tiny_wheel(dest, "alpha", "1.0")
    _tiny_wheel(dest, "alpha", "0.9")  # another version: removed
    _tiny_wheel(dest, "stale", "1.0")  # not in the set: removed
    asked = []
    wheel_set = wheels.WheelSet({"alpha": "1.0", "beta": "2.0"}, {"alpha": "a", "beta": "b"})
    manifest = wheels.download_wheels(wheel_set, dest, run=lambda cmd, check: (
        asked.append(cmd), _tiny_wheel(dest, "beta", "2.0")))
    assert asked[0][-1:] == ["beta==2.0"]  # only what is missing is fetched
    assert sorted(p.name for p in dest.glob("*.whl")) == [kept.name, "beta-2.0-py3-none-any.whl"]
    assert manifest["total_bytes"] == sum(p.stat().st_size for p in dest.glob("*.whl"))
    assert json.loads((dest / "manifest.json").read_text())["wheels"]["beta"]["pure_python"]
    with pytest.raises(RuntimeError, match="over the 0 MiB"):
        wheels.download_wheels(wheel_set, dest, budget_bytes=100)


def test_verify_names_unmet_requirements(tmp_path):
    from flowgrpo.gpu_check import wheels

    site = tmp_path / "site"
    info = site / "probe_pkg-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: probe-pkg\nVersion: 1.0\n"
                                   "Requires-Dist: packaging>=20\nRequires-Dist: packaging<1\n"
                                   "Requires-Dist: no-such-distribution-here\n"
                                   'Requires-Dist: another-missing; extra == "docs"\n')
    project = [wheels._requirement(r) for r in ("packaging>=20", "packaging<1", "not-here-either>=1")]
    result = wheels.verify_site(site, project_requirements=project)
    assert result["carried"] == {"probe-pkg": "1.0"} and result["absent"] == ["not-here-either>=1"]
    assert len(result["problems"]) == 3 and "flowgrpo needs packaging<1" in result["problems"][2]
    assert "needs packaging<1: packaging" in result["problems"][0]
    assert "no-such-distribution-here: not installed" in result["problems"][1]


def test_gpu_names_map_to_the_plans_gpu_table():
    from flowgrpo.gpu_check.step_plan import gpu_table_entry
    from flowgrpo.plan.gpus import GPUS

    assert gpu_table_entry("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert gpu_table_entry("NVIDIA H200") == "h200-141gb"
    assert gpu_table_entry("NVIDIA A100-SXM4-40GB", 40960) == "a100-40gb"
    assert all(gpu_table_entry(n) in GPUS for n in ("NVIDIA H100 PCIe", "NVIDIA H800", "NVIDIA L40S"))
    with pytest.raises(ValueError, match="no entry in flowgrpo.plan's GPU table"):
        gpu_table_entry("Tesla T4")
