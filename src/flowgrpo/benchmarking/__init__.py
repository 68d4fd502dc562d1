"""Benchmarking: step-time breakdown, analytic transformer FLOPs and the FLOP floor of a training step
(Flow-GRPO or DiffusionNFT).

``scripts/benchmark.py --preset NAME [--steps N] [--json OUT]`` (``make bench``) drives :func:`run_benchmark`;
presets live in :mod:`flowgrpo.benchmarking.presets`, the FLOP model in :mod:`flowgrpo.benchmarking.flops`.
"""

from .flops import ForwardFlops, StepFlops, count_flops, step_flops, transformer_forward_flops
from .harness import BREAKDOWN_KEYS, RESULT_KEYS, format_report, run_benchmark
from .presets import PRESETS, BenchmarkPreset, build_preset_pipeline, get_preset

__all__ = [
    "BREAKDOWN_KEYS",
    "RESULT_KEYS",
    "PRESETS",
    "BenchmarkPreset",
    "ForwardFlops",
    "StepFlops",
    "build_preset_pipeline",
    "count_flops",
    "format_report",
    "get_preset",
    "run_benchmark",
    "step_flops",
    "transformer_forward_flops",
]
