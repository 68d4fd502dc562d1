#!/usr/bin/env python
"""Every check that needs a GPU, one subprocess each, with a report (``make gpu-check``).

    python scripts/gpu_check.py --output outputs/gpu_check
    python scripts/gpu_check.py --only bf16_onpolicy launch/zero2 bench/sd35m-random
    python scripts/gpu_check.py --dry-run          # the plan; needs no GPU

Checks: bf16_onpolicy, launch/<config> (single_gpu, multi_gpu, fsdp8, zero2, zero3; full fine-tuning under fsdp8 and
zero3), memory/sd35m_24gb, reward/ocr_throughput, bench/<preset> for every CUDA benchmark preset. Writes
<output>/report.md and <output>/report.json. Exit status 0 when everything passed, 1 otherwise, 2 on a machine
without CUDA. See docs/benchmarks.md and flowgrpo/gpu_check/.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

if __name__ == "__main__":
    from flowgrpo.gpu_check.cli import main

    sys.exit(main())
