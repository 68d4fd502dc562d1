"""The quick GPU check: what one call on a lent GPU machine measures, within 6 minutes, set-up included.

    scripts/gpu_quick.sh OUT_DIR [--key value ...]     # on the GPU machine: one call, the report in OUT_DIR
    scripts/gpu_quick.sh --dry-run OUT_DIR             # anywhere: everything but the CUDA work

A lent GPU machine (one H100 80 GB or one H200 141 GB, no network) comes for 15 minutes of device time in all:
its start, every call and every idle second count. This check is sized so that one call, started with the
machine, leaves time for a second one. ``make gpu-check`` is the thorough version, for a machine of one's own.

The budget (:data:`BUDGET_S`, checked by :func:`budget`): ``scripts/gpu_quick.sh`` itself (installing the carried
wheels into a temporary folder, starting this module: :data:`SHELL_SETUP_S`), then the checks below in order, each
in its own subprocess and process group with its own time limit (:mod:`.runner`; a check over its limit is
terminated, :data:`KILL_GRACE_S` later killed, and reported, and the next one starts), then the report
(:data:`REPORT_S`). The limits are also cut to the time left of the budget, measured from the script's start, so
that the call ends in time even when the set-up took longer; a check with less than :data:`MIN_CHECK_S` left is
skipped and reported as such.

======================  =====  ===============================================================================
check                   limit  what it runs and records
======================  =====  ===============================================================================
``setup/wheels``           15  the carried wheels (:mod:`.wheels`) and flowgrpo's own requirements against what is
                               importable there, with versions; torch, diffusers, datasets, ... imported
``bf16_onpolicy``          30  one bf16 optimizer step each on the tiny SD3 pipeline with CFG 4.5 and without CFG,
                               and on the tiny FLUX pipeline (guidance embedded): first-pass ratio 1 and KL 0
``sd35m_step``            100  ``recipes/ocr.yaml``'s Flow-GRPO-Fast LoRA step at one GPU's share (512 px, 10 steps,
                               window 2 in one pass, CFG 4.5, 4 micro-batches of 8 images, checkpointing, KL 0.04,
                               EMA) on the full-size SD3.5-Medium with random weights: one warm-up and two timed
                               steps, the per-phase times and peak memory, the step-1 ratio and KL at full size; then
                               one more generation's training phase at ``train_timesteps_per_pass`` 1 and all, each
                               timed with its peak memory and first-pass ratio (:mod:`.recipe_step`; the recipe
                               overrides given on the command line apply here)
``plan_vs_measured``       20  ``flowgrpo plan`` of that same step on this GPU kind: planned against measured peak
                               memory and step time, as ratios (:mod:`.step_plan`)
``nft_step``               95  ``recipes/nft_ocr.yaml``'s DiffusionNFT step at one GPU's share (6 micro-batches of 8,
                               10 DPM-Solver++ 2M steps, 9 noise levels trained), timed the same way
``launch/fsdp8``           60  ``accelerate launch --config_file accelerate_configs/fsdp8.yaml --num_processes 1
                               src/train.py recipes/ocr.yaml`` for two steps on the random-weight SD3.5-M
                               (transformer and VAE at full size) and its exported LoRA (:mod:`.launch`)
``sd35m_compile``         150  not in the default run: ``sd35m_step``'s step with ``torch_compile``, one step with
                               the blocks' compilation (``timing/compile_s``) and one steady step; with
                               ``--only sd35m_step sd35m_compile`` (264 s of limits) a second call of a loan
                               times compile off against on
======================  =====  ===============================================================================

The OCR reward of the two recipes needs rapidocr, whose wheel (27 MB, it bundles its ONNX models) does not fit
beside diffusers and datasets in what the machine can be sent; the steps are timed with ``jpeg_compressibility``,
a reward that needs PIL only. On a GPU the reward runs on the CPU in the background, overlapping the sampling, so
the GPU work timed is the recipe's; what the OCR costs on that host is ``make gpu-check``'s
``reward/ocr_throughput``.

Files: ``OUT_DIR/gpu_report.md``, ``OUT_DIR/gpu_report.json`` (:mod:`.quick_report`) and
``OUT_DIR/gpu_quick_logs.txt`` (every check's output), rewritten after every check; everything else (the checks'
folders, the 5.6 GB launch model) goes to ``--work`` (default ``$TMPDIR/flowgrpo-quick``). Exit status: 0 when
every check passed, 1 otherwise, 2 for bad input (an override, a selection, a budget that does not fit).

``--dry-run``: the set-up check runs for real (on the wheels just installed), the overrides and the selection are
validated, the budget is checked, and the report is written; the GPU checks are not run, or, with ``--recorded
gpu_report.json`` (an earlier run's), their results are taken from it, so the report is written from recorded
inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .cli import cuda_gpu_count
from .plan import Check, PlanError, repo_root, select_checks

__all__ = ["BUDGET_S", "DEFAULT_CHECKS", "KILL_GRACE_S", "MIN_CHECK_S", "QUICK_CHECKS", "QUICK_IMPORT_ROOTS",
           "REPORT_S", "SHELL_SETUP_S", "QuickCheck", "budget", "build_quick_plan", "main", "selected_checks",
           "validate_overrides"]

#: the whole call on one H100, set-up included: 6 minutes, so that a second call fits in a 15-minute loan
BUDGET_S = 360
#: scripts/gpu_quick.sh before this module runs: the wheels' install into a temporary folder, the interpreter's start
SHELL_SETUP_S = 20
#: between SIGTERM and SIGKILL for a check at its limit
KILL_GRACE_S = 2
#: writing the report at the end
REPORT_S = 5
#: a check with less time than this left of the budget is skipped
MIN_CHECK_S = 10

STEP_RECIPE = "recipes/ocr.yaml"
NFT_RECIPE = "recipes/nft_ocr.yaml"
LAUNCH_CONFIG = "fsdp8"


@dataclass(frozen=True)
class QuickCheck:
    """A check of the quick run: its name, what it shows and its time limit in seconds; ``in_default_run``: run
    without ``--only`` (a check outside the default run is a second call's, named with ``--only``)."""

    name: str
    limit_s: float
    description: str
    in_default_run: bool = True


QUICK_CHECKS: tuple[QuickCheck, ...] = (
    QuickCheck("setup/wheels", 15, "the carried wheels' and flowgrpo's requirements against what is importable, "
                                   "with versions; torch, diffusers, datasets, transformers, peft, accelerate "
                                   "imported"),
    QuickCheck("bf16_onpolicy", 30, "bf16 first-pass ratio and KL at step 1: tiny SD3 with CFG 4.5 and without CFG, "
                                    "tiny FLUX"),
    QuickCheck("sd35m_step", 100, f"{STEP_RECIPE} (Flow-GRPO-Fast LoRA) at one GPU's share on the full-size "
                                  "SD3.5-Medium with random weights: 2 steps after 1 warm-up, per phase; then its "
                                  "training phase at train_timesteps_per_pass 1 and all"),
    QuickCheck("plan_vs_measured", 20, f"flowgrpo plan of the same {STEP_RECIPE} step on this GPU kind: planned vs "
                                       "measured peak memory and step time"),
    QuickCheck("nft_step", 95, f"{NFT_RECIPE} (DiffusionNFT) at one GPU's share on the same model, timed the "
                               "same way"),
    QuickCheck(f"launch/{LAUNCH_CONFIG}", 60, f"accelerate launch accelerate_configs/{LAUNCH_CONFIG}.yaml "
                                              f"--num_processes 1 src/train.py {STEP_RECIPE}: 2 steps on the "
                                              "random-weight SD3.5-M, its LoRA exported"),
    QuickCheck("sd35m_compile", 150, f"{STEP_RECIPE}'s step as sd35m_step, with torch_compile: the first step with "
                                     "the compilation of the blocks, then one steady step (against sd35m_step: "
                                     "compile off against on; a second call, --only sd35m_step sd35m_compile)",
               in_default_run=False),
)
#: the checks a call without ``--only`` runs
DEFAULT_CHECKS: tuple[QuickCheck, ...] = tuple(c for c in QUICK_CHECKS if c.in_default_run)

#: what the checks' processes import (module, or module:attribute for what loads lazily); the carried wheels are
#: derived from it (:mod:`.wheels`). Keep it in step with the checks above.
QUICK_IMPORT_ROOTS: tuple[str, ...] = (
    "flowgrpo.gpu_check.bf16_onpolicy", "flowgrpo.gpu_check.recipe_step", "flowgrpo.gpu_check.step_plan",
    "flowgrpo.gpu_check.launch", "flowgrpo.gpu_check.pipelines", "flowgrpo.gpu_check.runner",
    "flowgrpo.gpu_check.quick_report", "flowgrpo.gpu_check.wheels",
    "flowgrpo.trainer:FlowGRPOTrainer", "flowgrpo.trainer:DiffusionNFTTrainer", "flowgrpo.trainer.registry",
    "flowgrpo.benchmarking.harness", "flowgrpo.benchmarking.presets", "flowgrpo.cli.train", "flowgrpo.cli.data",
    "flowgrpo.cli.lora", "flowgrpo.plan.cli", "flowgrpo.plan.planner", "flowgrpo.testing", "flowgrpo.rewards",
    "accelerate.commands.launch", "datasets", "diffusers:StableDiffusion3Pipeline", "diffusers:FluxPipeline",
    "peft", "safetensors.torch", "psutil", "yaml",
)


def budget(checks: Sequence[QuickCheck] = DEFAULT_CHECKS) -> dict[str, Any]:
    """The time budget of a run of ``checks`` (default: the default run's): ``total_s`` = set-up + each limit and its
    kill grace + the report; ``fits`` when it is within :data:`BUDGET_S`."""
    limits = {c.name: c.limit_s for c in checks}
    total = SHELL_SETUP_S + sum(limit + KILL_GRACE_S for limit in limits.values()) + REPORT_S
    return {"budget_s": BUDGET_S, "shell_setup_s": SHELL_SETUP_S, "kill_grace_s": KILL_GRACE_S, "report_s": REPORT_S,
            "min_check_s": MIN_CHECK_S, "limits_s": limits, "total_s": total, "fits": total <= BUDGET_S}


def selected_checks(only: Sequence[str]) -> list[QuickCheck]:
    """The quick checks ``only`` names (exact names or group prefixes, as ``--only`` takes them), in plan order;
    raises `PlanError` for a name that selects none."""
    chosen = {c.name for c in select_checks([Check(c.name, c.description, (), c.limit_s) for c in QUICK_CHECKS],
                                            only)}
    return [c for c in QUICK_CHECKS if c.name in chosen]


def _selection(plan: Sequence[Check], only: Sequence[str] | None) -> list[Check]:
    """The checks of ``plan`` a call runs: those ``only`` names, else the default run's."""
    if only:
        return select_checks(plan, only)
    second_call = {c.name for c in QUICK_CHECKS if not c.in_default_run}
    return [c for c in plan if c.name not in second_call]


def _check_folder(work: Path, name: str) -> Path:
    from .plan import check_dir

    return check_dir(work, name)


def build_quick_plan(work: str | os.PathLike, *, site: str | None, overrides: Sequence[str] = (), gpu: str = "auto",
                     python: str | None = None, dry_run: bool = False) -> list[Check]:
    """The runner's checks (commands run from the repository root) for a run working in ``work``."""
    py = python or sys.executable
    work = Path(work)
    overrides = [str(o) for o in overrides]
    commands: dict[str, list[str]] = {
        "setup/wheels": [py, "-m", "flowgrpo.gpu_check.wheels", "verify", "--site", str(site or ""),
                         "--setup-py", "setup.py"]
                        + ([] if dry_run else ["--import", "torch", "diffusers", "datasets", "transformers", "peft",
                                                "accelerate"]),
        "bf16_onpolicy": [py, "-m", "flowgrpo.gpu_check.bf16_onpolicy", "--output", str(work / "bf16_onpolicy"),
                          "--models", "sd3-tiny", "flux-tiny", "--cfg", "both"],
        "sd35m_step": [py, "-m", "flowgrpo.gpu_check.recipe_step", "--recipe", STEP_RECIPE,
                       "--output", str(_check_folder(work, "sd35m_step")), "--work", str(work / "runs" / "sd35m_step"),
                       "--compare-timesteps-per-pass", *overrides],
        "plan_vs_measured": [py, "-m", "flowgrpo.gpu_check.step_plan", "--recipe", STEP_RECIPE,
                             "--measured", str(_check_folder(work, "sd35m_step")), "--gpu", gpu,
                             "--output", str(_check_folder(work, "plan_vs_measured")), *overrides],
        "sd35m_compile": [py, "-m", "flowgrpo.gpu_check.recipe_step", "--recipe", STEP_RECIPE,
                          "--output", str(_check_folder(work, "sd35m_compile")),
                          "--work", str(work / "runs" / "sd35m_compile"), "--steps", "1", "--warmup-steps", "1",
                          *overrides, "--torch_compile", "true"],
        "nft_step": [py, "-m", "flowgrpo.gpu_check.recipe_step", "--recipe", NFT_RECIPE,
                     "--output", str(_check_folder(work, "nft_step")), "--work", str(work / "runs" / "nft_step")],
        f"launch/{LAUNCH_CONFIG}": [py, "-m", "flowgrpo.gpu_check.launch", "--config", LAUNCH_CONFIG,
                                    "--num-processes", "1", "--model-dir", str(work / "models" / "sd35m-launch"),
                                    "--output", str(_check_folder(work, f"launch/{LAUNCH_CONFIG}")),
                                    "--recipe", STEP_RECIPE, "--verify", "file"],
    }
    return [Check(c.name, c.description, tuple(commands[c.name]), float(c.limit_s)) for c in QUICK_CHECKS]


def validate_overrides(overrides: Sequence[str]) -> None:
    """The recipe overrides of ``sd35m_step``, parsed with the recipe before anything runs (a mistake is named
    at once, with the closest valid keys): raises ``ValueError``."""
    from .recipe_step import parse_step_recipe

    if not overrides:
        return
    try:
        parse_step_recipe(str(repo_root() / STEP_RECIPE), [*overrides], max_steps=3,
                          output_dir=str(Path(tempfile.gettempdir()) / "flowgrpo-quick-parse"))
    except SystemExit as err:  # argparse's own exit on a malformed flag
        raise ValueError(f"the recipe overrides {list(overrides)} do not parse (exit {err.code})") from err


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_quick.sh", allow_abbrev=False,
        description="The quick GPU check: one call on a lent GPU machine, at most 6 minutes, a report in OUT_DIR. "
                    "Other --key value flags override recipes/ocr.yaml for the sd35m_step check and its plan.")
    parser.add_argument("output", help="folder of gpu_report.md, gpu_report.json and gpu_quick_logs.txt")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA work: set-up, validation, budget, report")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=None,
                        help="run only these checks (exact names or group prefixes: " +
                             ", ".join(c.name for c in QUICK_CHECKS) + ")")
    parser.add_argument("--recorded", default=None, metavar="GPU_REPORT_JSON",
                        help="with --dry-run: take the GPU checks' results from an earlier run's gpu_report.json")
    parser.add_argument("--work", default=None,
                        help="folder of the checks' files and the launch model (default $TMPDIR/flowgrpo-quick)")
    parser.add_argument("--site", default=os.environ.get("FLOWGRPO_QUICK_SITE"),
                        help="the folder the carried wheels were installed into (set by scripts/gpu_quick.sh)")
    parser.add_argument("--started-at", type=float, default=None,
                        help="epoch seconds when scripts/gpu_quick.sh started (the budget counts from there)")
    parser.add_argument("--gpu", default="auto", help="flowgrpo.plan GPU table entry for the plan (default: detected)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    started = args.started_at if args.started_at is not None else time.time()
    out = Path(args.output).resolve()
    work = Path(args.work or Path(tempfile.gettempdir()) / "flowgrpo-quick").resolve()
    try:
        plan_budget = budget(selected_checks(args.only) if args.only else DEFAULT_CHECKS)
    except PlanError as err:
        print(f"gpu-quick: error: {err}", file=sys.stderr)
        return 2
    if not plan_budget["fits"]:
        print(f"gpu-quick: error: the checks' limits add up to {plan_budget['total_s']:.0f} s with set-up and report, "
              f"over the {BUDGET_S} s budget; lower a limit in flowgrpo.gpu_check.quick.QUICK_CHECKS",
              file=sys.stderr)
        return 2
    if args.recorded and not args.dry_run:
        print("gpu-quick: error: --recorded re-writes a report from an earlier run's results; it goes with --dry-run",
              file=sys.stderr)
        return 2
    try:
        from .recipe_step import check_overrides

        check_overrides(overrides)
        _selection(build_quick_plan(work, site=args.site, overrides=overrides), args.only)
        validate_overrides(overrides)
        recorded = _read_recorded(args.recorded) if args.recorded else {}
    except (ValueError, PlanError, OSError) as err:
        print(f"gpu-quick: error: {err}", file=sys.stderr)
        return 2

    if not args.dry_run:
        count, why = cuda_gpu_count()
        if count < 1:
            print(f"gpu-quick: error: no CUDA GPU on this machine: {why}. The quick check runs on a GPU machine; "
                  "`scripts/gpu_quick.sh --dry-run OUT_DIR` runs everything else here.", file=sys.stderr)
            return 2
    from .quick_report import machine_section, write_quick_report
    from .report import git_commit
    from .runner import GpuMemorySampler, run_check

    machine = machine_section()
    gpu = args.gpu if args.gpu != "auto" else machine.get("gpu_kind") or "auto"
    checks = _selection(build_quick_plan(work, site=args.site, overrides=overrides, gpu=gpu,
                                         dry_run=args.dry_run), args.only)
    commit = git_commit(repo_root())
    command = os.environ.get("FLOWGRPO_QUICK_COMMAND") or " ".join(
        ["python -m flowgrpo.gpu_check.quick", *(sys.argv[1:] if argv is None else argv)])
    setup_s = time.time() - started
    print(f"[gpu-quick] {len(checks)} check(s), budget {BUDGET_S} s ({plan_budget['total_s']:.0f} s of limits, set-up "
          f"and report); set-up took {setup_s:.0f} s; GPU {machine.get('label')} (plan: {gpu}); work folder {work}",
          flush=True)
    env = dict(os.environ)
    src = str(repo_root() / "src")
    env["PYTHONPATH"] = os.pathsep.join([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [src])
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("WANDB_MODE", "disabled")):
        env.setdefault(key, value)

    results: list = []
    deadline = started + BUDGET_S - REPORT_S

    def report(pending: Sequence[str], finished: bool) -> None:
        try:
            write_quick_report(results, out, machine=machine, commit=commit, command=command, budget=plan_budget,
                               overrides=overrides, started_at=started, setup_s=setup_s, pending=pending,
                               finished=finished, dry_run=args.dry_run, work=work)
        except Exception:  # noqa: BLE001 - the figures must come back even when the report cannot be rendered
            _raw_report(out, results, machine, traceback.format_exc())

    try:
        for i, check in enumerate(checks):
            report([c.name for c in checks[i:]], finished=False)
            folder = _check_folder(work, check.name)
            if args.dry_run and check.name != "setup/wheels":
                results.append(recorded.get(check.name) or _not_run(check, "dry run: not run (needs the GPU)"))
                continue
            left = deadline - time.time() - KILL_GRACE_S
            if left < MIN_CHECK_S:
                results.append(_not_run(check, f"skipped: {max(left, 0):.0f} s of the {BUDGET_S} s budget left",
                                        status="skipped"))
                continue
            limit = min(check.timeout_s, left)
            print(f"[gpu-quick] {check.name}: running (limit {limit:.0f} s)", flush=True)
            result = run_check(replace(check, timeout_s=limit), folder, cwd=repo_root(), env=env,
                               kill_grace_s=KILL_GRACE_S, gpu_sampler=GpuMemorySampler())
            setup_error = os.environ.get("FLOWGRPO_QUICK_SETUP_ERROR", "")
            if check.name == "setup/wheels" and setup_error:
                result.status = "failed"
                result.failures.insert(0, setup_error)
            if limit < check.timeout_s:
                result.notes.append(f"limit cut from {check.timeout_s:.0f} s to {limit:.0f} s: the time left of the "
                                    f"{BUDGET_S} s budget")
            results.append(result)
            reason = f" - {result.failures[0]}" if result.failures else ""
            print(f"[gpu-quick] {check.name}: {result.status.upper()} in {result.wall_s:.0f} s"
                  f"{' - ' + result.summary if result.summary else ''}{reason}", flush=True)
    except KeyboardInterrupt:
        report([c.name for c in checks[len(results):]], finished=False)
        print("[gpu-quick] interrupted; the report holds the checks that finished", file=sys.stderr)
        return 130
    report([], finished=True)
    passed = sum(r.status == "passed" for r in results)
    print(f"[gpu-quick] {passed} of {len(results)} checks passed in {time.time() - started:.0f} s; report: "
          f"{out / 'gpu_report.md'}", flush=True)
    if args.dry_run:
        ran = [r for r in results if r.name == "setup/wheels" or r.name in recorded]
        return 0 if all(r.status == "passed" for r in ran) else 1
    return 0 if passed == len(results) else 1


def _raw_report(out: Path, results: Sequence[Any], machine: Any, error: str) -> None:
    """The results as they are, when the report itself failed: never lose what the checks measured."""
    out.mkdir(parents=True, exist_ok=True)
    raw = {"report_error": error, "machine": machine, "checks": [r.to_dict() for r in results]}
    (out / "gpu_report.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    (out / "gpu_report.md").write_text("# Quick GPU check: the report could not be written\n\n```\n" + error
                                       + "\n```\n\nEvery check's figures are in gpu_report.json.\n")


def _not_run(check: Check, why: str, status: str = "not_run") -> Any:
    from .runner import CheckResult

    return CheckResult(name=check.name, description=check.description, command=list(check.command), status=status,
                       returncode=None, wall_s=0.0, timeout_s=check.timeout_s, started_at="", log="", output_tail="",
                       notes=[why])


def _read_recorded(path: str | os.PathLike) -> dict[str, Any]:
    """``{check name: CheckResult}`` from an earlier run's ``gpu_report.json``."""
    from dataclasses import fields

    from .runner import CheckResult

    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("checks"), list):
        raise ValueError(f"{path} is not a gpu_report.json (no 'checks' list)")
    names = {f.name for f in fields(CheckResult)}
    out = {}
    for entry in data["checks"]:
        result = CheckResult(**{k: v for k, v in entry.items() if k in names})
        result.notes = [*result.notes, f"recorded: from {Path(path).name} ({data.get('date', '?')}, "
                                       f"{(data.get('machine') or {}).get('label', '?')})"]
        out[result.name] = result
    return out


if __name__ == "__main__":
    sys.exit(main())

