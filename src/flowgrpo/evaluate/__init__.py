"""``flowgrpo evaluate``: the published benchmarks (GenEval, OCR, PickScore, the toy world) generated under their
protocol and scored locally, in GenEval's own format.

    flowgrpo evaluate --benchmark geneval --model stabilityai/stable-diffusion-3.5-medium \
        --lora you/sd35m-geneval --output results/geneval

writes ``results/geneval/<index:05d>/metadata.jsonl`` and ``.../samples/<n:04d>.png`` (GenEval's layout,
`layout`), then ``results.jsonl`` (for GenEval the fields of its ``evaluation/evaluate_images.py``) and a summary
(``summary.md``, ``summary.json``). ``--images DIR`` scores a folder in that layout made by another tool. The
modules: `benchmarks` (prompts, protocols, seeds), `generation` (sampling with the family adapters, LoRA loading),
`layout` (the folders), `reward_scoring` and `geneval_scoring` (records and summaries), `runner` (resume, processes),
`cli` (flags).

Importing this package loads no model library; :func:`main` is the command.
"""

from .benchmarks import BENCHMARKS, Benchmark, SamplingProtocol, image_seed
from .cli import main

__all__ = ["BENCHMARKS", "Benchmark", "SamplingProtocol", "image_seed", "main"]
