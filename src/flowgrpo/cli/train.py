"""The training run behind ``src/train.py``: recipe -> datasets -> pipeline -> trainer -> LoRA (+ Hub).

The recipe's ``trainer`` key picks the trainer, one of the trainer registry's (``flowgrpo.trainer.registry.TRAINERS``;
``flow_grpo``, `FlowGRPOTrainer`, by default); every trainer is built with the same arguments.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml src/train.py recipes/tiny_cpu.yaml --max_steps 2

Order of work, cheapest first, so that a mistake costs seconds: parse and check the recipe, read the prompt
datasets, check the model path (or build the tiny pipeline a recipe asks for), then load the pipeline and train.
At the end: evaluation when there is an evaluation set and ``train()`` did not just evaluate the final weights (it
does at its last step under a step or epoch schedule: the same images are not scored twice), ``trainer_state.json``, the diffusers LoRA
(``pytorch_lora_weights.safetensors``) and the model card in ``output_dir``, and a Hub upload when ``push_to_hub``.

Debugging distributed runs: when the environment variable ``FLOWGRPO_RANK_LOG_DIR`` names a folder, every process
appends one JSON line per training log to ``<dir>/rank<N>.jsonl`` with the logged metrics (rewards, advantages'
statistics: gathered over all processes, so equal on every rank), and its own samples: prompts, rewards, a digest
of each image and its local advantages (different per rank: each process samples its own noise), and a digest of
the trainable weights after the step (equal on every rank when gradients are synchronised).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .arguments import ModelArguments, ScriptArguments
from .model_folders import TOY_WORLD_MARKER, model_folder_builder
from .parser import RecipeError, check_training_hardware, parse_recipe
from .rank_log import RANK_LOG_ENV, RankLogCallback


def _looks_like_local_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith("/") or name.count("/") > 1 or os.path.exists(name)


def prepare_model_path(model_args: ModelArguments, training_args: Any = None) -> str:
    """The pipeline to load: checks a local folder exists, or builds the tiny pipeline there when asked.

    With ``build_tiny_pipeline_if_missing`` set and no pipeline at ``model_name_or_path``, the local main process
    builds the folder with the builder of that name (`flowgrpo.cli.model_folders`: the tiny pipeline of a family,
    ``flowgrpo.testing.save_tiny_pipeline``, or a copy of the toy world from its cache,
    ``flowgrpo.toy.build.cached_toy_world``, built there on first use and shared with the tests and benchmarks),
    while the other processes wait. The folder is written beside its target and renamed into place
    (``flowgrpo.build_cache``), so an interrupted build is never mistaken for a pipeline.
    """
    name = str(model_args.model_name_or_path)
    path = Path(name).expanduser()
    family = model_args.build_tiny_pipeline_if_missing
    if family is None:
        if _looks_like_local_path(name) and not path.exists():
            raise RecipeError(f"Model folder not found: {name!r} (relative paths are read from {Path.cwd()}). Give "
                              "a Hub id or a folder written by save_pretrained.")
        return name
    if (path / "model_index.json").is_file():
        return str(path)
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        raise RecipeError(f"{name!r} exists but holds no diffusers pipeline (no model_index.json); remove it or "
                          "point model_name_or_path elsewhere so the tiny pipeline can be built there.")

    from ..build_cache import build_folder_once

    builder = model_folder_builder(family)
    seed = model_args.tiny_pipeline_seed

    def build(target: Path) -> None:
        print(f"[flowgrpo] {builder.describe(family, seed)} in {path}", flush=True)
        builder.build(family, target, seed)

    with _main_process_first(training_args, "building the tiny pipeline"):
        build_folder_once(path, build, what="model folder")
    return str(path)


def _main_process_first(training_args: Any, desc: str):
    """The local main process first, the others after it (no launch: just run)."""
    from contextlib import nullcontext

    return training_args.main_process_first(local=True, desc=desc) if training_args is not None else nullcontext()


def _prepare_toy_world_run(script_args: ScriptArguments, model: str, training_args: Any = None) -> None:
    """A toy world (a folder holding ``toy_world.json``, whatever built it) is prepared by the ``toy`` builder before
    a run reads its datasets: its preference pairs (``<world>/dpo_pairs/train.jsonl`` of ``recipes/toy_dpo.yaml``)
    written on first use, its caption truncation notices quieted (it reads a caption's first tokens by design)."""
    folder = Path(str(model))
    if not (folder / TOY_WORLD_MARKER).is_file():
        return
    model_folder_builder("toy").prepare_run(folder, [script_args.dataset_name],
                                            lambda desc: _main_process_first(training_args, desc))


def _check_eval_settings(training_args: Any, eval_dataset: Any) -> None:
    if eval_dataset is not None:
        return
    strategy = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy))
    if training_args.eval_on_start or strategy != "no":
        raise RecipeError(f"eval_strategy={strategy!r} / eval_on_start={training_args.eval_on_start} need an "
                          "evaluation set, but the dataset has none; set dataset_test_split or eval_dataset_name, or "
                          "set eval_strategy: 'no' and eval_on_start: false.")


def _prompts_come_with_model(script_args: ScriptArguments, model_args: ModelArguments) -> bool:
    """True when a pipeline is to be built locally and the prompt files lie inside its folder."""
    if not model_args.build_tiny_pipeline_if_missing or not model_args.model_name_or_path:
        return False
    model_dir = Path(str(model_args.model_name_or_path)).expanduser().resolve()
    for name in (script_args.dataset_name, script_args.eval_dataset_name):
        if name and Path(name).expanduser().resolve().is_relative_to(model_dir):
            return True
    return False


def _hub_dataset_name(script_args: ScriptArguments) -> str | None:
    from .data import looks_local

    name = script_args.dataset_name
    return None if not name or looks_local(name) else name


def run(script_args: ScriptArguments, model_args: ModelArguments, training_args: Any) -> Any:
    """Train, evaluate, save (and push) from parsed arguments with the trainer ``script_args.trainer`` names;
    returns the trainer."""
    from .data import load_prompt_dataset
    from .lora import build_peft_config

    check_training_hardware(training_args)  # parsing defers the bf16 GPU check; training applies it
    # 'package.module:function' rewards next to the recipe are importable like installed ones.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())

    peft_config = build_peft_config(model_args)
    if _prompts_come_with_model(script_args, model_args):
        # the toy world writes its prompt files next to the pipeline: build it before reading them
        model = prepare_model_path(model_args, training_args)
        _prepare_toy_world_run(script_args, model, training_args)
        train_dataset, eval_dataset = load_prompt_dataset(script_args)
    else:
        train_dataset, eval_dataset = load_prompt_dataset(script_args)
        model = prepare_model_path(model_args, training_args)
        _prepare_toy_world_run(script_args, model, training_args)
    _check_eval_settings(training_args, eval_dataset)

    from ..trainer.registry import trainer_class

    pipeline_kwargs = {"revision": model_args.model_revision} if model_args.model_revision else None
    trainer = trainer_class(script_args.trainer)(
        model=model, reward_funcs=list(script_args.reward_funcs), args=training_args, train_dataset=train_dataset,
        eval_dataset=eval_dataset, peft_config=peft_config, pipeline_kwargs=pipeline_kwargs,
    )
    rank_log_dir = os.environ.get(RANK_LOG_ENV)  # set to a folder: every process appends its records there
    if rank_log_dir:
        trainer.add_callback(RankLogCallback(trainer, rank_log_dir))

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if eval_dataset is not None and not trainer.final_weights_evaluated():
        trainer.evaluate()  # once: train() already evaluated its last step's weights under a step or epoch schedule
    trainer.save_state()
    dataset_name = _hub_dataset_name(script_args)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
    else:
        trainer.save_model(training_args.output_dir)
        trainer.create_model_card(dataset_name=dataset_name)
    if trainer.is_world_process_zero():
        if getattr(trainer, "stopped_by_hacking_alarm", False):
            state = trainer.state
            print(f"[flowgrpo] stopped by the hacking alarm (on_hacking: stop) at step {state.global_step}: the "
                  "training reward rose while a gold evaluation reward fell; best evaluation: step "
                  f"{state.best_global_step} ({training_args.metric_for_best_model}={state.best_metric}), "
                  f"checkpoint {state.best_model_checkpoint}.", flush=True)
        print(f"[flowgrpo] done: {trainer.state.global_step} steps; outputs in {training_args.output_dir}", flush=True)
    return trainer


def main(argv: Sequence[str] | None = None) -> Any:
    """``src/train.py``: parse ``argv`` (default ``sys.argv[1:]``) and run. Recipe mistakes exit with status 2 and a
    one-paragraph message instead of a traceback."""
    try:
        script_args, model_args, training_args = parse_recipe(list(argv) if argv is not None else None)
        return run(script_args, model_args, training_args)
    except RecipeError as err:
        print(f"flowgrpo: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from err


__all__ = ["RANK_LOG_ENV", "main", "prepare_model_path", "run"]
