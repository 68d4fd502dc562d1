"""`make gpu-check` on a machine without a GPU: the plan, the runner's time limits and failure capture, the report,
and the checks' own code in the reduced modes that run on a CPU.

What needs a GPU (the full-size models, bf16 CUDA kernels, NCCL launches, bitsandbytes) runs only under
`make gpu-check`; here the same functions run on the tiny pipelines, and the commands the checks launch are parsed by
the tools that will run them (accelerate's launch parser, our recipe parser).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from flowgrpo.gpu_check import cli, probe
from flowgrpo.gpu_check.plan import Check, PlanError, build_plan, check_dir, gpu_presets, repo_root, select_checks
from flowgrpo.gpu_check.report import (
    BENCH_TABLE_HEADER,
    CHECK_TABLE_HEADER,
    benchmark_row,
    check_row,
    update_benchmarks_doc,
    write_report,
)
from flowgrpo.gpu_check.runner import CheckResult, GpuMemorySampler, run_check

REPO = repo_root()
PY = sys.executable


# ---- the plan ----------------------------------------------------------------------------------------------------

def test_plan_order_commands_and_selection(tmp_path):
    plan = build_plan(2, tmp_path)
    names = [c.name for c in plan]
    presets = gpu_presets()
    assert "sd35m-random" in presets and "flux-random" in presets
    assert names == ["bf16_onpolicy", "launch/single_gpu", "launch/multi_gpu", "launch/fsdp8",
                     "launch/fsdp8/full_finetune", "launch/zero2", "launch/zero3", "launch/zero3/full_finetune",
                     "launch/sequence_parallel", "memory/sd35m_24gb", "plan_vs_measured",
                     "reward/ocr_throughput"] + [f"bench/{p}" for p in presets]
    assert "launch/sequence_parallel" not in [c.name for c in build_plan(1, tmp_path)]  # it needs 2 GPUs or more
    by_name = {c.name: c for c in plan}
    assert by_name["launch/single_gpu"].command[by_name["launch/single_gpu"].command.index("--num-processes") + 1] == "1"
    for name in ("launch/multi_gpu", "launch/zero3/full_finetune"):
        command = by_name[name].command
        assert command[command.index("--num-processes") + 1] == "2"
    assert "--full-finetune" in by_name["launch/fsdp8/full_finetune"].command
    bench = by_name["bench/sd35m-random"]
    assert bench.command[3] == "scripts/benchmark.py" and bench.collect == ("benchmark.json",)
    assert bench.command[-1] == str(check_dir(tmp_path, "bench/sd35m-random") / "benchmark.json")
    assert check_dir(tmp_path, "launch/fsdp8/full_finetune").name == "launch__fsdp8__full_finetune"
    # every module and script the plan runs exists, and so does every accelerate config
    import importlib.util

    for check in plan:
        module = check.command[check.command.index("-m") + 1]
        assert importlib.util.find_spec(module) is not None, module
        if module == "flowgrpo.gpu_check.probe":
            assert (REPO / check.command[check.command.index("-m") + 2]).is_file()
        if "--config" in check.command:
            assert (REPO / "accelerate_configs" / f"{check.command[check.command.index('--config') + 1]}.yaml").is_file()
    assert build_plan(1, tmp_path, timeout_scale=2)[0].timeout_s == 2 * plan[0].timeout_s

    select = lambda *only: [c.name for c in select_checks(plan, list(only))]  # noqa: E731
    assert len(select("launch")) == 8 and select("launch/fsdp8") == ["launch/fsdp8", "launch/fsdp8/full_finetune"]
    assert select("bench/sd35m-random", "bf16_onpolicy") == ["bf16_onpolicy", "bench/sd35m-random"]  # plan order
    assert select("memory", "reward/") == ["memory/sd35m_24gb", "reward/ocr_throughput"]
    with pytest.raises(PlanError, match="--only laun: no such check.*groups: bench, bf16_onpolicy, launch"):
        select_checks(plan, ["laun"])
    with pytest.raises(PlanError, match="at least one CUDA GPU"):
        build_plan(0, tmp_path)


def test_cli_dry_run_needs_no_gpu_and_no_cuda_exits_2(tmp_path, capsys):
    assert cli.main(["--dry-run", "--gpus", "8", "--output", str(tmp_path), "--only", "launch/zero3"]) == 0
    out = capsys.readouterr().out
    assert "2 check(s) for 8 GPU(s)" in out and "launch/zero3/full_finetune" in out
    assert "--num-processes 8" in out and "time limits add up to" in out
    assert cli.main(["--dry-run", "--output", str(tmp_path), "--only", "nope"]) == 2
    assert "--only nope: no such check" in capsys.readouterr().err
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-GPU exit status cannot be seen here")
    assert cli.main(["--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU on this machine" in err and "--dry-run" in err
    assert not (tmp_path / "run").exists()  # nothing built or written


def test_cli_run_loop_keeps_going_after_a_failure_and_reports(tmp_path, monkeypatch, capsys):
    """The loop of a real run, with the CUDA probe answered and two stand-in checks (the real ones need a GPU)."""
    plan = [Check("first/fails", "exits 1", (PY, "-c", "import sys; print('boom'); sys.exit(1)"), 30),
            Check("second/passes", "exits 0", (PY, "-c", "print('fine')"), 30)]
    monkeypatch.setattr(cli, "cuda_gpu_count", lambda: (1, ""))
    monkeypatch.setattr(cli, "build_plan", lambda *args, **kwargs: plan)
    doc = tmp_path / "benchmarks.md"
    doc.write_text((REPO / "docs" / "benchmarks.md").read_text())
    assert cli.main(["--output", str(tmp_path / "out"), "--update-docs", str(doc)]) == 1
    out = capsys.readouterr().out
    assert "first/fails: FAILED" in out and "second/passes: PASSED" in out and "1 of 2 checks passed" in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [c["status"] for c in report["checks"]] == ["failed", "passed"] and report["finished"]
    assert "boom" in report["checks"][0]["output_tail"] and not report["passed"]
    assert (tmp_path / "out" / "checks" / "second__passes" / "output.log").read_text().endswith("fine\n")
    assert "| `second/passes` | passed |" in doc.read_text()  # appended to the GPU checks table


# ---- the runner --------------------------------------------------------------------------------------------------

SLEEPER = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open(sys.argv[1], "w").write(str(grandchild.pid))
print("started a worker in its own session", flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_runner_kills_the_whole_tree_at_the_time_limit(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    check = Check("slow", "sleeps past its limit", (PY, "-c", SLEEPER, str(pid_file)), timeout_s=1.5)
    tic = time.monotonic()
    result = run_check(check, tmp_path / "slow", kill_grace_s=2)
    assert time.monotonic() - tic < 10
    assert result.status == "timed_out" and not result.passed
    assert "time limit of 2 s reached" in result.failures[0] and result.killed_processes >= 1
    assert "started a worker in its own session" in result.output_tail
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)  # out of the process group's reach, killed by pid


def test_runner_captures_failures_results_memory_and_clears_stale_files(tmp_path):
    folder = tmp_path / "fail"
    folder.mkdir()
    (folder / "result.json").write_text(json.dumps({"passed": True, "metrics": {"stale": 1}}))  # an earlier run's
    fail = Check("fail", "fails", (PY, "-c", "import sys\nfor i in range(60): print('line', i)\nsys.exit(3)"), 30)
    result = run_check(fail, folder, tail_lines=5)
    assert (result.status, result.returncode) == ("failed", 3) and result.failures == ["exit status 3"]
    assert result.output_tail.splitlines() == [f"line {i}" for i in range(55, 60)] and result.metrics == {}
    assert (folder / "output.log").read_text().startswith("$ ")

    write = ("import sys\nfrom flowgrpo.gpu_check.probe import write_result, _write_json\nimport os\n"
             "write_result(sys.argv[1] == 'ok', {'figure': 1.5}, [] if sys.argv[1] == 'ok' else ['it broke'], "
             "summary='all good')\n"
             "_write_json(__import__('pathlib').Path(os.environ['FLOWGRPO_GPU_CHECK_MEMORY_DIR']) / 'x.json', "
             "{'tag': 'x', 'rank': 1, 'pid': 7, 'devices': {'0': {'max_memory_allocated_mib': 10.0, "
             "'max_memory_reserved_mib': 12.0}}})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    ok = run_check(Check("ok", "passes", (PY, "-c", write, "ok"), 30), tmp_path / "ok", env=env)
    assert ok.passed and ok.metrics == {"figure": 1.5} and ok.summary == "all good"
    assert ok.peak_memory["torch_max_reserved_mib"] == 12.0 and ok.peak_memory["per_process"][0]["rank"] == 1
    said_no = run_check(Check("no", "exit 0 but failed", (PY, "-c", write, "no"), 30), tmp_path / "no", env=env)
    assert said_no.status == "failed" and said_no.failures == ["it broke"]
    missing = run_check(Check("b", "no json", (PY, "-c", "pass"), 30, collect=("benchmark.json",)), tmp_path / "b")
    assert missing.status == "failed" and "did not write benchmark.json" in missing.failures[0]

    script = "print('0, 1200, 81559')\nprint('1, 300, 81559')"
    sampler = GpuMemorySampler((PY, "-c", script), interval_s=0.05)
    assert sampler.sample() == {"0": 1200.0, "1": 300.0}
    assert sampler.as_dict()["peak_mib"] == {"0": 1200.0, "1": 300.0} and sampler.total_mib["0"] == 81559.0
    assert not GpuMemorySampler(("/nonexistent/nvidia-smi",)).start().available


def test_probe_runs_a_script_as_main_and_keeps_its_exit_status(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').write(' '.join(sys.argv[1:]))\nsys.exit(5)\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert probe.main([str(script), str(tmp_path / "seen.txt"), "b"]) == 5
    assert (tmp_path / "seen.txt").read_text() == f"{tmp_path / 'seen.txt'} b"
    assert probe.main([str(tmp_path / "missing.py")]) == 2
    assert probe.record_peak_memory("t", tmp_path / "mem") is None or torch.cuda.is_initialized()


FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *-L*) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"; echo "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1)";;
  *driver_version*) echo "0, NVIDIA H100 80GB HBM3, 81559, 580.65"; echo "1, NVIDIA H100 80GB HBM3, 81559, 580.65";;
  *) echo "0, 1200, 81559"; echo "1, 5, 81559";;
esac
"""


def test_gpu_discovery_through_nvidia_smi(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH (the real one needs a driver): its output is parsed as the real one's is."""
    from flowgrpo.gpu_check.report import machine_info, machine_label

    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(FAKE_NVIDIA_SMI)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    machine = machine_info()
    assert machine_label(machine) == "2x NVIDIA H100 80GB HBM3" and machine["driver"] == "580.65"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g["index"] for g in machine_info()["gpus"]] == [1]
    assert GpuMemorySampler().sample() == {"0": 1200.0, "1": 5.0}
    if not torch.cuda.is_available():
        count, why = cli.cuda_gpu_count()
        assert count == 0 and "nvidia-smi lists 2 GPU(s) but torch" in why


# ---- the report --------------------------------------------------------------------------------------------------

BENCH = {"preset": "sd35m-random", "steps": 2, "warmup_steps": 1, "step_time_s": 18.234, "images_per_s": 3.51,
         "peak_memory_mb": 61234.4, "peak_memory_kind": "cuda_max_allocated", "floor_time_s": 16.91,
         "overhead_ratio": 1.0782, "overhead_ratio_per_step": [1.05, 1.11], "flops": {"total": 2.2e16},
         "achieved_flops_per_s": 1.2e15, "floor_flops_per_s": 1.3e15}


def _result(name, status, **kwargs):
    return CheckResult(name=name, description="d", command=["x"], status=status, returncode=0 if status == "passed"
                       else 1, wall_s=12.5, timeout_s=900, started_at="t", log="log", output_tail="last line",
                       **kwargs)


def test_report_and_docs_rows(tmp_path):
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    assert BENCH_TABLE_HEADER in doc and CHECK_TABLE_HEADER in doc  # the rows follow the docs' own tables
    row = benchmark_row(BENCH, date="2026-11-23", machine="1x NVIDIA H100 80GB HBM3", commit="abc1234")
    assert row == ("| 2026-11-23 | 1x NVIDIA H100 80GB HBM3 | abc1234 | `sd35m-random` | 2 (+1 warm-up) | 18.23 | 3.51 "
                   "| 61234 (CUDA allocated) | 16.91 | 1.078 (1.05-1.11) | 22000 | 1200000 / 1300000 |")
    assert row.count("|") == BENCH_TABLE_HEADER.count("|")

    results = [_result("bench/sd35m-random", "passed", metrics={"benchmark": BENCH},
                       peak_memory={"torch_max_allocated_mib": 60000.0, "torch_max_reserved_mib": 62000.0}),
               _result("launch/zero3", "timed_out", failures=["time limit of 900 s reached"])]
    machine = {"gpus": [{"name": "NVIDIA H100 80GB HBM3"}], "torch": "2.13", "driver": "580"}
    md, js = write_report(results, tmp_path, machine=machine, commit="abc1234", command=["gpu_check.py"],
                          pending=["memory/sd35m_24gb"], finished=False)
    data = json.loads(js.read_text())
    assert not data["passed"] and data["counts"] == {"passed": 1, "failed": 0, "timed_out": 1}
    assert data["pending"] == ["memory/sd35m_24gb"] and data["checks"][1]["status"] == "timed_out"
    text = md.read_text()
    assert "**1 of 2 checks passed (still running)**" in text and "| `memory/sd35m_24gb` | not run yet |" in text
    assert "| `launch/zero3` | timed out | 12.5 | 900 |" in text and "step 18.23 s, 3.51 images/s" in text
    assert data["docs_rows"]["results"]["sd35m-random"].startswith("| ")
    assert "1x NVIDIA H100 80GB HBM3" in data["docs_rows"]["results"]["sd35m-random"]

    copy = tmp_path / "benchmarks.md"
    copy.write_text(doc)
    checks = {r.name: check_row(r, date="2026-11-23", machine="1x H100", commit="abc1234") for r in results}
    new_preset = benchmark_row({**BENCH, "preset": "qwen-random"}, date="d", machine="m", commit="c")
    update_benchmarks_doc(copy, {"sd35m-random": row, "qwen-random": new_preset}, checks)
    updated = copy.read_text()
    assert row in updated and new_preset in updated and checks["launch/zero3"] in updated
    assert "`sd35m-random` | not yet measured" not in updated and "`flux-random` | not yet measured" in updated
    assert "`bench/sd35m-random` | not yet measured" not in updated
    assert updated.index(new_preset) < updated.index(CHECK_TABLE_HEADER)  # appended to its own table


# ---- the checks' code on a CPU -----------------------------------------------------------------------------------

def test_bf16_onpolicy_reduced_mode_on_cpu(tmp_path, monkeypatch):
    from flowgrpo.gpu_check import bf16_onpolicy

    monkeypatch.setenv(probe.CHECK_DIR_ENV, str(tmp_path))
    # sd3-tiny runs in bf16 on the CPU; sd35m-random needs CUDA and must fail with a message, not stop the others
    assert bf16_onpolicy.main(["--output", str(tmp_path / "work"), "--device", "cpu",
                               "--models", "sd35m-random", "sd3-tiny"]) == 1
    result = json.loads((tmp_path / "result.json").read_text())
    tiny = result["metrics"]["models"]["sd3-tiny"]
    assert tiny["base_weight_dtype"] == "torch.bfloat16" and tiny["on_policy_ratio_max_dev"] <= 1e-3
    assert result["metrics"]["tolerance_held"] is not None and result["metrics"]["tolerance"] == 1e-3
    assert "CUDA" in result["metrics"]["models"]["sd35m-random"]["error"]
    assert not result["passed"] and result["failures"][0].startswith("sd35m-random: RuntimeError")
    assert bf16_onpolicy.tightest_tolerance(3e-6) == 1e-5 and bf16_onpolicy.tightest_tolerance(0.0) == 0.0


@pytest.mark.parametrize("full_finetune", [False, True], ids=["lora", "full_finetune"])
def test_launch_recipe_trains_and_its_export_reloads_on_cpu(tiny_sd3_path, tmp_path, monkeypatch, full_finetune):
    """The launch check's recipe through src/train.py's main (one CPU process instead of accelerate launch on GPUs),
    then the check's own verification of the export, on the tiny pipeline."""
    from accelerate.commands.launch import launch_command_parser

    from flowgrpo.cli import main as train_main
    from flowgrpo.gpu_check import launch

    run = tmp_path / "run"
    recipe = launch.launch_recipe(tiny_sd3_path, launch.write_prompt_files(tmp_path / "prompts"), run,
                                  full_finetune=full_finetune, resolution=64, max_sequence_length=16, dtype="float32",
                                  bf16=False, use_cpu=True, activation_checkpointing=False, max_steps=1)
    path = launch.write_recipe(tmp_path / "recipe.yaml", recipe)
    monkeypatch.setenv("FLOWGRPO_RANK_LOG_DIR", str(tmp_path / "ranks"))
    train_main([str(path)])
    found, problems = launch.read_training_log(run, expected_steps=1)
    assert not problems and found["global_step"] == 1 and found["on_policy_ratio_max_dev"] == 0.0
    assert found["eval_reward"] is not None
    ranks, problems = launch.check_rank_logs(tmp_path / "ranks", 1)
    assert not problems and ranks["weights_equal_across_ranks"] and ranks["steps_per_rank"] == [1]
    verify = launch.verify_full_finetune if full_finetune else launch.verify_lora_export
    metrics, problems = verify(tiny_sd3_path, run, device="cpu", dtype=torch.float32, size=64)
    assert not problems, problems
    if full_finetune:
        assert metrics["changed_tensors"] > 0 and metrics["images_finite"]
    else:
        assert metrics["lora_layers_loaded"] == metrics["lora_layers_in_file"] > 0 and metrics["image_max_abs_diff"] > 0

    command = launch.accelerate_command("zero3", 4, path, port=29999)
    args = launch_command_parser().parse_args(command[3:])
    assert args.config_file == "accelerate_configs/zero3.yaml" and args.num_processes == 4 and args.module
    assert args.training_script == "flowgrpo.gpu_check.probe" and args.training_script_args == ["src/train.py",
                                                                                                str(path)]


def test_sequence_parallel_check_recipe_trains_and_its_comparisons_catch_differences(tiny_pipeline_path, tmp_path,
                                                                                    monkeypatch):
    """The sequence-parallel check's recipe through src/train.py's main on one CPU process (its one-GPU run), then
    the check's comparisons: an export against itself passes, a changed tensor fails; one rank is its own group."""
    from safetensors.torch import load_file, save_file

    from flowgrpo.cli import main as train_main
    from flowgrpo.gpu_check import sequence_parallel as check

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("\n".join(check.PROMPTS) + "\n")
    run = tmp_path / "one"
    recipe = check.sequence_parallel_recipe(tiny_pipeline_path("wan"), prompts, run, 1)
    assert recipe["sequence_parallel_size"] == 1 and recipe["num_frames"] == 9
    recipe.update(max_steps=1, use_cpu=True)
    monkeypatch.setenv("FLOWGRPO_RANK_LOG_DIR", str(tmp_path / "ranks"))
    from flowgrpo.gpu_check.launch import write_recipe

    train_main([str(write_recipe(tmp_path / "recipe.yaml", recipe))])
    found, problems = check.compare_exports(run, run)
    assert not problems and found["lora_max_abs_diff"] == 0.0 and found["lora_B_max_abs"] > 0
    group, problems = check.compare_group_logs(tmp_path / "ranks", [0])
    assert not problems and group["steps"] == 1
    moved = tmp_path / "moved"
    moved.mkdir()
    tensors = load_file(run / "pytorch_lora_weights.safetensors")
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key] = tensors[key] + 10 * check.TOLERANCE
    save_file(tensors, moved / "pytorch_lora_weights.safetensors")
    assert "differs from the one-GPU LoRA" in check.compare_exports(run, moved)[1][0]


def test_memory_check_command_is_the_recipe_with_valid_overrides(tmp_path, monkeypatch):
    from flowgrpo.cli import parse_recipe
    from flowgrpo.gpu_check.memory_24gb import BUDGET_MIB, training_command

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    command = training_command(tmp_path / "model", tmp_path / "data", tmp_path / "out")
    assert command[command.index("--config_file") + 1] == "accelerate_configs/single_gpu.yaml"
    train_args = command[command.index("src/train.py") + 1:]
    assert train_args[0] == "recipes/sd35m_24gb.yaml"
    script_args, model_args, args = parse_recipe(train_args + ["--use_cpu", "true"])
    assert model_args.model_name_or_path == str(tmp_path / "model") and args.max_steps == 2
    assert args.quantization == "4bit" and args.offload_text_encoders and args.report_to == []
    assert BUDGET_MIB == 23 * 1024


def test_ocr_throughput_reduced_mode_on_cpu(tmp_path, monkeypatch):
    from flowgrpo.gpu_check import ocr_throughput

    pytest.importorskip("rapidocr", reason="the ocr extra is not installed")
    monkeypatch.setenv(probe.CHECK_DIR_ENV, str(tmp_path))
    assert ocr_throughput.main(["--output", str(tmp_path), "--device", "cpu", "--rollout-preset", "tiny",
                                "--images", "3", "--size", "256", "--threads", "1"]) == 0
    metrics = json.loads((tmp_path / "result.json").read_text())["metrics"]
    assert metrics["ocr"][0]["num_threads"] == 1 and metrics["ocr"][0]["mean_score"] >= 0.5
    assert metrics["rollout"]["preset"] == "tiny" and metrics["rollout"]["images_per_s"] > 0
    assert metrics["keeps_up"] == (metrics["ocr_images_per_s_per_process"] >= metrics["rollout_images_per_s_per_process"])


def test_launch_pipeline_builds_the_full_size_transformer_with_one_layer_encoders():
    from flowgrpo.gpu_check.pipelines import build_sd35m_pipeline

    pipe = build_sd35m_pipeline("sd35m-launch", device="meta")  # structure only: nothing allocated
    params = {name: sum(p.numel() for p in module.parameters()) for name, module in pipe.components.items()
              if isinstance(module, torch.nn.Module)}
    assert params["transformer"] > 2.2e9 and pipe.transformer.config.num_layers == 24
    assert pipe.text_encoder_3.config.d_model == 4096 and pipe.text_encoder_3.config.num_layers == 1
    assert pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim == \
        pipe.transformer.config.pooled_projection_dim
    assert pipe.transformer.dtype == torch.bfloat16 and params["text_encoder_3"] < 4e8
