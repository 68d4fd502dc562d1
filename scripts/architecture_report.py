"""Figures of the package's shape: the largest class and function, the trainer chain, import circles, private
imports across modules, and the files one training step runs through.

    PYTHONPATH=src python scripts/architecture_report.py              # all figures, as JSON
    PYTHONPATH=src python scripts/architecture_report.py --no-step    # without the traced training step

The traced step: one optimizer step of ``FlowGRPOTrainer`` on the shipped toy world (4 prompts x 4 images), with
every Python function call recorded (``sys.setprofile``); the count is of the package's source files whose code ran
between the start of ``training_step`` and its return.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "flowgrpo"


def largest_definitions() -> dict:
    biggest_class, biggest_function = ("", 0), ("", 0)
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = f"{path.relative_to(ROOT)}:{node.name}"
                if isinstance(node, ast.ClassDef) and lines > biggest_class[1]:
                    biggest_class = (where, lines)
                elif not isinstance(node, ast.ClassDef) and lines > biggest_function[1]:
                    biggest_function = (where, lines)
    return {"largest_class": biggest_class, "largest_function": biggest_function}


def trainer_chain() -> dict:
    """The classes of FlowGRPOTrainer's MRO that the package defines: names, lines, methods."""
    from flowgrpo.trainer.algorithms.flow_grpo_trainer import FlowGRPOTrainer

    own = [c for c in FlowGRPOTrainer.__mro__ if c.__module__.startswith("flowgrpo.")]
    lines = sum(len(inspect.getsource(c).splitlines()) for c in own)
    methods = sum(sum(1 for v in vars(c).values() if inspect.isfunction(v)) for c in own)
    bases = {c.__name__: [b.__name__ for b in c.__bases__] for c in own}
    return {"classes": [c.__name__ for c in own], "bases": bases, "lines": lines, "methods": methods}


#: the packages a training run is made of, and the tooling around them that they must not import (pyproject.toml's
#: import-linter layers state the rule; this counts its breaches)
CORE_PACKAGES = ("schedulers", "models", "rewards", "trainer")
TOOLING_PACKAGES = ("benchmarking", "gpu_check", "toy", "testing", "plan", "evaluate")


def _top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private_names(line: str, imported: str) -> list[str]:
    """The private names (one leading underscore) a ``from X import a, _b as c`` line takes from module ``imported``;
    a private-named submodule imported as such is not a private name of another module."""
    if not line.startswith("from ") or " import " not in line:
        return []
    names = line.split(" import ", 1)[1].strip("()\\ ").split(",")
    names = [name.strip().split(" as ")[0].strip("() ") for name in names]
    return [name for name in names if name.startswith("_") and not name.startswith("__")
            and imported.rpartition(".")[2] != name]


def import_figures() -> dict:
    """From grimp's import graph of the package (imports inside functions count, ``if TYPE_CHECKING:`` ones do not):
    the circles of imports between modules, the core's imports of tooling, and the number of private names imported
    across modules."""
    import grimp

    sys.path.insert(0, str(ROOT / "tests"))
    from support.import_contracts import module_circles

    graph = grimp.build_graph("flowgrpo", exclude_type_checking_imports=True, cache_dir=None)
    layer_violations, private = [], set()
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if not imported.startswith("flowgrpo"):
                continue
            if _top_package(importer) in CORE_PACKAGES and _top_package(imported) in TOOLING_PACKAGES:
                layer_violations.append((importer, imported))
            for detail in graph.get_import_details(importer=importer, imported=imported):
                private.update((importer, imported, name) for name in _private_names(detail["line_contents"], imported))
    return {"cycles": module_circles(graph, "flowgrpo"), "layer_violations": layer_violations,
            "private_imports": len(private)}


def traced_step_files() -> dict:
    import tempfile

    import torch
    from datasets import Dataset
    from peft import LoraConfig

    from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
    from flowgrpo.toy.build import cached_toy_world, read_prompts

    torch.set_num_threads(1)
    world = cached_toy_world("full", seed=0, log=lambda message: None)
    prompts = read_prompts(world, "train")[:8]
    with tempfile.TemporaryDirectory() as out:
        args = FlowGRPOConfig(output_dir=out, resolution=32, num_inference_steps=6, guidance_scale=3.0,
                              max_sequence_length=8, sde_window_size=2, sde_window_range=[0, 3], num_generations=4,
                              per_device_train_batch_size=16, max_steps=1, report_to="none", use_cpu=True,
                              disable_tqdm=True, eval_strategy="no", save_strategy="no", logging_steps=1,
                              learning_rate=1e-4, beta=0.0, cpu_threads=1)
        trainer = FlowGRPOTrainer(model=str(world), reward_funcs=["toy_shape_score"], args=args,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_v"]))
        files: set[str] = set()
        original = type(trainer).training_step

        def profile(frame, event, arg):
            if event == "call":
                name = frame.f_code.co_filename
                if name.startswith(str(PACKAGE)):
                    files.add(str(Path(name).relative_to(ROOT)))

        def traced(self, *a, **k):
            sys.setprofile(profile)
            threading.setprofile(profile)
            try:
                return original(self, *a, **k)
            finally:
                sys.setprofile(None)
                threading.setprofile(None)

        type(trainer).training_step = traced
        try:
            trainer.train()
        finally:
            type(trainer).training_step = original
    return {"files": len(files), "file_list": sorted(files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-step", action="store_true", help="skip the traced training step")
    parser.add_argument("--output", default=None, help="write the JSON here instead of standard output")
    cli = parser.parse_args()
    report = {**largest_definitions(), "trainer_chain": trainer_chain(), **import_figures()}
    if not cli.no_step:
        report["training_step"] = traced_step_files()
    text = json.dumps(report, indent=1)
    if cli.output:
        Path(cli.output).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)


if __name__ == "__main__":
    main()
