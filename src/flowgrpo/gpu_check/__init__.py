"""``make gpu-check``: one command that turns a GPU machine into verified facts.

Each check runs in its own subprocess with its own time limit (:mod:`.runner`); the run keeps going after a
failure and writes ``report.md`` and ``report.json`` (:mod:`.report`) after every check. The checks
(:mod:`.plan`): ``bf16_onpolicy`` (:mod:`.bf16_onpolicy`), ``launch/<config>`` (:mod:`.launch`),
``memory/sd35m_24gb`` (:mod:`.memory_24gb`), ``reward/ocr_throughput`` (:mod:`.ocr_throughput`) and
``bench/<preset>`` (``scripts/benchmark.py`` under :mod:`.probe`). The random-weight SD3.5-Medium-architecture
pipelines they share are built on the GPU by :mod:`.pipelines`.

The quick check for a lent GPU machine (``scripts/gpu_quick.sh``, :mod:`.quick`): six checks in 6 minutes, set-up
included (the wheels of :mod:`.wheels`, bf16 on-policy, the SD3.5-M steps of ``recipes/ocr.yaml`` and
``recipes/nft_ocr.yaml`` timed by :mod:`.recipe_step`, their plan by :mod:`.step_plan`, an ``fsdp8`` launch), with
``gpu_report.md`` and ``gpu_report.json`` (:mod:`.quick_report`).

Importing this package is cheap (no torch); the modules above import what they need.
"""

from .plan import Check, PlanError, build_plan, select_checks

__all__ = ["Check", "PlanError", "build_plan", "select_checks"]
