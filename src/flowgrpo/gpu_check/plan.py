"""The plan of ``make gpu-check``: which checks run, in which order, with which command and time limit.

=======================================  ==========================================================================
check                                    what it runs and records
=======================================  ==========================================================================
``bf16_onpolicy``                        one optimizer step in bf16 on the tiny SD3 and FLUX pipelines and on the
                                         SD3.5-Medium architecture at full size: first-pass likelihood ratio and KL
                                         (both exactly 1 and 0 in exact arithmetic), their largest deviation and the
                                         tightest tolerance that held
``launch/<config>``                      ``accelerate launch --config_file accelerate_configs/<config>.yaml
                                         --num_processes <visible GPUs>`` of ``src/train.py``: 2 optimizer steps of
                                         LoRA training on an SD3.5-Medium-architecture random pipeline, then the
                                         exported LoRA loaded into the stock pipeline (``single_gpu``, ``multi_gpu``,
                                         ``fsdp8``, ``zero2``, ``zero3``)
``launch/<config>/full_finetune``        the same with the whole transformer trained, saved and reloaded (``fsdp8``,
                                         ``zero3``)
``launch/sequence_parallel``             with 2 GPUs or more: ``sequence_parallel_size 2`` on NCCL, 2 GPUs against
                                         one (the same LoRA after 2 steps), all GPUs from 4 up
                                         (:mod:`flowgrpo.gpu_check.sequence_parallel`)
``memory/sd35m_24gb``                    ``recipes/sd35m_24gb.yaml`` for 2 optimizer steps on the full-size
                                         SD3.5-Medium architecture at 512 px: peak GPU memory against 24 GB
``plan_vs_measured``                    ``flowgrpo.plan``'s peak for the same run of ``recipes/sd35m_24gb.yaml`` against the
                                         ``torch.cuda.max_memory_allocated`` that ``memory/sd35m_24gb`` measured
``reward/ocr_throughput``                OCR images per second on this host next to the rollout's images per second
``bench/<preset>``                       ``scripts/benchmark.py --preset <preset>`` for every CUDA preset, with the
                                         rows of docs/benchmarks.md
=======================================  ==========================================================================

Every check is one subprocess (see :mod:`flowgrpo.gpu_check.runner`); names are selected with ``--only``: an exact
name, or a prefix ending at a ``/`` boundary (``launch`` selects every launch check, ``launch/fsdp8`` the LoRA and the
full fine-tuning runs under ``fsdp8``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Check", "LAUNCH_CONFIGS", "FULL_FINETUNE_CONFIGS", "PlanError", "build_plan", "check_dir",
           "gpu_presets", "model_dir", "repo_root", "select_checks"]

#: accelerate configs run by ``launch/<config>`` (the SD3 ones of accelerate_configs/; multi_node needs two machines).
LAUNCH_CONFIGS = ("single_gpu", "multi_gpu", "fsdp8", "zero2", "zero3")
#: configs that also run full fine-tuning of the transformer (the sharded ones, where it is meant to fit).
FULL_FINETUNE_CONFIGS = ("fsdp8", "zero3")

#: default time limits in seconds (estimates for one H100 with headroom; scale them with ``--timeout-scale``).
DEFAULT_TIMEOUTS = {
    "bf16_onpolicy": 900,
    "launch": 900,
    "memory/sd35m_24gb": 1500,
    "plan_vs_measured": 600,
    "reward/ocr_throughput": 900,
    "bench/sd35m-random": 1800,
    "bench": 2700,
}


class PlanError(ValueError):
    """A selection that names no check (the message lists the valid names)."""


@dataclass(frozen=True)
class Check:
    """One check: a command run from the repository root in its own process group, with a time limit."""

    name: str
    description: str
    command: tuple[str, ...]
    timeout_s: float
    collect: tuple[str, ...] = field(default=())  # JSON files of the check's folder that go into its metrics

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]


def repo_root() -> Path:
    """The repository this package runs from (``src/flowgrpo/gpu_check/plan.py`` -> the folder holding ``src``)."""
    return Path(__file__).resolve().parents[3]


def check_dir(output_dir: str | Path, name: str) -> Path:
    """The folder of one check's files: ``<output>/checks/<name with / as __>``."""
    return Path(output_dir) / "checks" / re.sub(r"[^A-Za-z0-9_.-]", "__", name)


def model_dir(output_dir: str | Path, kind: str) -> Path:
    """Where the random-weight pipelines the checks share are built (reused by later runs)."""
    return Path(output_dir) / "models" / kind


def gpu_presets() -> list[str]:
    """The benchmark presets that need CUDA, in their table order (new ones are picked up as they land)."""
    from ..benchmarking.presets import PRESETS

    return [name for name, preset in PRESETS.items() if preset.device == "cuda"]


def _timeout(name: str, scale: float) -> float:
    for key in (name, name.split("/", 1)[0]):
        if key in DEFAULT_TIMEOUTS:
            return DEFAULT_TIMEOUTS[key] * scale
    raise KeyError(name)


def build_plan(num_gpus: int, output_dir: str | Path, *, python: str | None = None, presets: Sequence[str] | None = None,
               bench_steps: int = 2, bench_warmup_steps: int = 1, timeout_scale: float = 1.0) -> list[Check]:
    """Every check for a machine with ``num_gpus`` visible GPUs, in the order they run."""
    if num_gpus < 1:
        raise PlanError(f"num_gpus={num_gpus}: the checks need at least one CUDA GPU.")
    if timeout_scale <= 0:
        raise PlanError(f"timeout_scale={timeout_scale} must be > 0.")
    py = python or sys.executable
    out = Path(output_dir)
    presets = list(gpu_presets() if presets is None else presets)
    checks: list[Check] = []

    def add(name: str, description: str, command: list[str], collect: tuple[str, ...] = ()) -> None:
        checks.append(Check(name, description, tuple(str(c) for c in command), _timeout(name, timeout_scale), collect))

    add("bf16_onpolicy",
        "bf16 first-pass ratio and KL at step 1: tiny SD3, tiny FLUX, SD3.5-Medium architecture at full size",
        [py, "-m", "flowgrpo.gpu_check.bf16_onpolicy", "--output", check_dir(out, "bf16_onpolicy")])
    launch_model = model_dir(out, "sd35m-launch")
    for config in LAUNCH_CONFIGS:
        processes = 1 if config == "single_gpu" else num_gpus
        variants = [False, True] if config in FULL_FINETUNE_CONFIGS else [False]
        for full in variants:
            name = f"launch/{config}" + ("/full_finetune" if full else "")
            what = "full fine-tuning" if full else "LoRA"
            command = [py, "-m", "flowgrpo.gpu_check.launch", "--config", config, "--num-processes", processes,
                       "--model-dir", launch_model, "--output", check_dir(out, name)]
            if full:
                command.append("--full-finetune")
            add(name, f"accelerate launch {config}.yaml x{processes}: 2 steps of {what} on the SD3.5-M architecture, "
                      "then reloaded into the stock pipeline", command)
    if num_gpus >= 2:
        add("launch/sequence_parallel",
            "sequence parallelism on NCCL: 2 GPUs with sequence_parallel_size 2 against one GPU (the same LoRA), and "
            "every GPU with S=2 from 4 GPUs up, on the tiny Wan pipeline (9 video tokens, split unevenly)",
            [py, "-m", "flowgrpo.gpu_check.sequence_parallel", "--num-processes", num_gpus,
             "--model-dir", model_dir(out, "tiny-wan"), "--output", check_dir(out, "launch/sequence_parallel")])
    add("memory/sd35m_24gb",
        "recipes/sd35m_24gb.yaml, 2 steps at 512 px on the full-size SD3.5-M architecture: peak memory under 24 GB",
        [py, "-m", "flowgrpo.gpu_check.memory_24gb", "--model-dir", model_dir(out, "sd35m-full"),
         "--output", check_dir(out, "memory/sd35m_24gb")])
    add("plan_vs_measured",
        "flowgrpo.plan's peak for recipes/sd35m_24gb.yaml against the max_memory_allocated memory/sd35m_24gb measured",
        [py, "-m", "flowgrpo.gpu_check.plan_vs_measured", "--measured", check_dir(out, "memory/sd35m_24gb"),
         "--model-dir", model_dir(out, "sd35m-full"), "--output", check_dir(out, "plan_vs_measured")])
    add("reward/ocr_throughput", "OCR images/s on this host next to the SD3.5-M rollout's images/s",
        [py, "-m", "flowgrpo.gpu_check.ocr_throughput", "--num-gpus", num_gpus,
         "--output", check_dir(out, "reward/ocr_throughput")])
    for preset in presets:
        name = f"bench/{preset}"
        add(name, f"scripts/benchmark.py --preset {preset}: {bench_steps} measured steps after {bench_warmup_steps} "
                  "warm-up, FLOP floor and overhead ratio",
            [py, "-m", "flowgrpo.gpu_check.probe", "scripts/benchmark.py", "--preset", preset, "--steps", bench_steps,
             "--warmup-steps", bench_warmup_steps, "--json", check_dir(out, name) / "benchmark.json"],
            collect=("benchmark.json",))
    return checks


def select_checks(plan: Sequence[Check], only: Sequence[str] | None) -> list[Check]:
    """The checks named by ``only`` (exact names or ``/``-bounded prefixes), in plan order; all when empty."""
    if not only:
        return list(plan)
    unknown = []
    chosen: set[str] = set()
    for raw in only:
        sel = raw.strip().rstrip("/")
        hits = [c.name for c in plan if c.name == sel or c.name.startswith(sel + "/")]
        if not hits:
            unknown.append(raw)
        chosen.update(hits)
    if unknown:
        groups = sorted({c.group for c in plan})
        raise PlanError(f"--only {' '.join(unknown)}: no such check. Checks: {', '.join(c.name for c in plan)}; "
                        f"groups: {', '.join(groups)}.")
    return [c for c in plan if c.name in chosen]
