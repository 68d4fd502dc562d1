"""One evaluation run: generate the benchmark's missing images, score every image, write the results and summary.

Order of work, cheapest first: the prompt file is read and the output folder's record of a previous run is checked
(a resumed run must use the same model, LoRA and sampler) before any model loads. Then each process generates its
share of the prompts (prompt ``i`` belongs to process ``i % num_processes`` under ``accelerate launch``), skipping
the images already on disk, scores its share, and writes ``results.rank<k>.jsonl``; once every process is done, the
main process merges them into ``results.jsonl`` (ordered by prompt and sample) and writes the summary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import layout
from .benchmarks import Benchmark, SamplingProtocol, image_seed, read_benchmark_prompts


@dataclass
class EvaluationSettings:
    """Everything one run needs (the CLI builds it from flags, a recipe and the benchmark's defaults)."""

    benchmark: Benchmark
    output: Path
    protocol: SamplingProtocol
    model: str | None = None
    revision: str | None = None
    lora: str | None = None
    transformer: str | None = None
    metadata: str | None = None
    images: Path | None = None
    batch_size: int = 8
    max_prompts: int | None = None
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    skip_grid: bool = False
    skip_scoring: bool = False

    def record(self, prompts: int) -> dict[str, Any]:
        """What ``evaluation.json`` keeps of this run (compared when a run resumes in the same folder)."""
        return {"benchmark": self.benchmark.name, "model": self.model, "revision": self.revision, "lora": self.lora,
                "transformer": self.transformer, "metadata": self.metadata, "prompts": prompts,
                "protocol": self.protocol.as_dict()}


#: Fields of ``evaluation.json`` that must agree for a run to resume in a folder.
RESUME_KEYS = ("benchmark", "model", "revision", "lora", "transformer", "protocol")


def check_resumable(output: Path, record: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` listing the differences when ``output`` holds images of a run with other settings."""
    path = output / layout.EVALUATION_FILE
    if not path.is_file():
        return
    previous = json.loads(path.read_text(encoding="utf-8"))
    differences = []
    for key in RESUME_KEYS:
        old, new = previous.get(key), record.get(key)
        if key == "protocol" and isinstance(old, dict) and isinstance(new, dict):
            differences += [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in new if old.get(k) != new.get(k)]
        elif old != new:
            differences.append(f"{key}: {old!r} -> {new!r}")
    if differences:
        raise ValueError(f"{output} holds images made with other settings ({path}); resuming would mix them: "
                         + "; ".join(differences) + ". Use a new --output folder, or the settings of that run.")


class _Distributed:
    """This process's place among the processes of ``accelerate launch`` (one process without it)."""

    def __init__(self) -> None:
        import torch
        from accelerate import PartialState

        self.state = PartialState(cpu=not torch.cuda.is_available())
        self.rank = self.state.process_index
        self.world = self.state.num_processes
        self.device = self.state.device
        self.is_main = self.state.is_main_process
        self.is_local_main = self.state.is_local_main_process

    def wait(self) -> None:
        self.state.wait_for_everyone()


def run_evaluation(settings: EvaluationSettings) -> dict[str, Any] | None:
    """Generate (unless ``settings.images``), score and summarise; returns the summary on the main process
    (``None`` on the others, and when ``skip_scoring``)."""
    benchmark = settings.benchmark
    output = settings.output
    if settings.images is None:
        rows = read_benchmark_prompts(benchmark, settings.metadata)
        if settings.max_prompts is not None:
            rows = rows[:settings.max_prompts]
        record = settings.record(len(rows))
        check_resumable(output, record)
        from .generation import check_model

        check_model(settings.model, settings.revision)
    dist = _Distributed()
    if settings.images is None:
        dist.wait()
        if dist.is_main:
            output.mkdir(parents=True, exist_ok=True)
            layout.write_text(output / layout.EVALUATION_FILE, json.dumps(record, indent=2) + "\n")
        mine = list(range(len(rows)))[dist.rank::dist.world]
        _generate(settings, rows, mine, dist)
        folders = [layout.read_prompt_folder(layout.prompt_dir(output, i)) for i in mine]
    else:
        folders = layout.read_image_folder(settings.images)[dist.rank::dist.world]
    if settings.skip_scoring:
        dist.wait()
        return None
    records = _score(settings, folders, dist)
    partial = output / f"results.rank{dist.rank}.jsonl"
    layout.write_jsonl(partial, records)
    dist.wait()
    if not dist.is_main:
        return None
    merged = []
    for rank in range(dist.world):
        path = output / f"results.rank{rank}.jsonl"
        merged += layout.read_jsonl(path)
        path.unlink()
    return _summarize(settings, merged)


def _generate(settings: EvaluationSettings, rows: list[dict], mine: list[int], dist: _Distributed) -> None:
    """Write this process's prompt folders and their missing samples (and grids)."""
    from tqdm.auto import tqdm

    protocol = settings.protocol
    count = protocol.images_per_prompt
    jobs = []
    for index in mine:
        layout.write_prompt_metadata(settings.output, index, rows[index])
        done = set(layout.existing_samples(settings.output, index, count))
        jobs += [(index, n) for n in range(count) if n not in done]
    if jobs:
        import torch

        from .generation import ImageGenerator, load_lora, load_pipeline, load_transformer, torch_dtype

        _quiet_loading_bars()
        pipeline = load_pipeline(settings.model, torch_dtype(protocol.dtype, dist.device), settings.revision)
        if settings.transformer:
            load_transformer(pipeline, settings.transformer)
        if settings.lora:
            load_lora(pipeline, settings.lora)
        generator = ImageGenerator(pipeline, protocol, dist.device)
        if (Path(str(settings.model)) / "toy_world.json").is_file():  # it reads a caption's first tokens by design
            from ..toy.build import quiet_toy_truncation_warnings

            quiet_toy_truncation_warnings(protocol.max_sequence_length)
        bar = tqdm(total=len(jobs), desc=f"{settings.benchmark.name}: generating", unit="img",
                   disable=not dist.is_local_main, dynamic_ncols=True)
        for start in range(0, len(jobs), settings.batch_size):
            chunk = jobs[start:start + settings.batch_size]
            images = generator.generate([rows[i]["prompt"] for i, _ in chunk],
                                        [image_seed(protocol.seed, i, n) for i, n in chunk])
            for (index, n), image in zip(chunk, images):
                layout.save_image(image, layout.sample_path(settings.output, index, n))
            bar.update(len(chunk))
        bar.close()
        del generator, pipeline
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not settings.skip_grid:
        from PIL import Image

        for index in mine:
            grid = layout.prompt_dir(settings.output, index) / layout.GRID_FILE
            if grid.is_file():
                continue
            paths = [layout.sample_path(settings.output, index, n) for n in range(count)]
            if all(p.is_file() for p in paths):
                layout.save_grid([Image.open(p).convert("RGB") for p in paths], grid)


def _quiet_loading_bars() -> None:
    """The benchmark's bar is the run's only bar: no per-component loading bars of diffusers and transformers."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def _score(settings: EvaluationSettings, folders: list[layout.PromptFolder], dist: _Distributed) -> list[dict]:
    from tqdm.auto import tqdm

    benchmark = settings.benchmark
    total = sum(len(f.samples) for f in folders)
    bar = tqdm(total=total, desc=f"{benchmark.name}: scoring", unit="img", disable=not dist.is_local_main,
               dynamic_ncols=True)
    try:
        if benchmark.name == "geneval2":
            from .geneval2_scoring import score_folders_with_geneval2

            return score_folders_with_geneval2(folders, settings.reward_kwargs.get("geneval2") or {}, dist.device,
                                               progress=bar.update)
        if benchmark.scored_by_rewards:
            from .reward_scoring import build_reward_set, score_folders_with_rewards

            reward_set = build_reward_set(benchmark.rewards, settings.reward_kwargs)
            return score_folders_with_rewards(folders, reward_set, progress=bar.update)
        from .geneval_scoring import score_folders_with_geneval

        return score_folders_with_geneval(folders, settings.reward_kwargs.get("geneval") or {}, dist.device,
                                          progress=bar.update)
    finally:
        bar.close()


def _summarize(settings: EvaluationSettings, records: list[dict]) -> dict[str, Any]:
    """Write ``results.jsonl``, ``summary.json`` and ``summary.md`` into the output folder; return the summary."""
    benchmark = settings.benchmark
    output = settings.output
    records.sort(key=_record_order)
    if benchmark.name == "geneval2":
        from .geneval2_scoring import geneval2_summary_markdown, summarize_geneval2_records, write_official_files

        summary = summarize_geneval2_records(records)
        markdown = geneval2_summary_markdown(summary)
        write_official_files(output, records)
    elif benchmark.scored_by_rewards:
        from .reward_scoring import reward_summary_markdown, summarize_reward_records

        summary = summarize_reward_records(records, benchmark.rewards)
        markdown = reward_summary_markdown(benchmark.name, summary)
    else:
        from .geneval_scoring import geneval_summary_markdown, summarize_geneval_records

        summary = summarize_geneval_records(records)
        markdown = geneval_summary_markdown(summary)
    summary = {"benchmark": benchmark.name, **summary}
    if settings.images is None:
        summary["protocol"] = settings.record(summary.get("prompts", 0))
    layout.write_jsonl(output / layout.RESULTS_FILE, records)
    layout.write_text(output / layout.SUMMARY_JSON_FILE, json.dumps(summary, indent=2) + "\n")
    layout.write_text(output / layout.SUMMARY_MD_FILE, markdown)
    return {**summary, "markdown": markdown}


def _record_order(record: Mapping[str, Any]) -> tuple[int, int]:
    """(prompt index, sample number) of a record, read from its image path."""
    path = Path(record["filename"])
    try:
        return int(path.parent.parent.name), int(path.stem)
    except ValueError:
        return (1 << 62, 0)


__all__ = ["RESUME_KEYS", "EvaluationSettings", "check_resumable", "run_evaluation"]

