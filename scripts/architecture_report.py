"""Figures of the package's shape: the largest class and function, the trainer chain, import circles, private
imports across modules, the files one training step runs through, the places outside ``trainer/algorithms/`` and
the registry that restate an algorithm, and the files a new algorithm touches.

    PYTHONPATH=src python scripts/architecture_report.py              # all figures, as JSON
    PYTHONPATH=src python scripts/architecture_report.py --no-step    # without the traced training step
    PYTHONPATH=src python scripts/architecture_report.py --before 4e9f473   # and the same figures at that commit

A restatement is a place that knows an algorithm by name instead of asking its spec (``flowgrpo.trainer.
algorithm_spec``): a comparison with a trainer's name, a table keyed by one, an ``isinstance`` on an algorithm's
configuration, an import of ``flowgrpo.trainer.algorithms``, and, in the parts that must ask the spec (``plan/``,
``cli/``, ``trainer/`` outside ``algorithms/``), a read of a setting that only an algorithm's configuration has.
``tests/trainer/test_algorithm_spec.py`` holds the package to none.

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


def largest_definitions(package: Path = PACKAGE) -> dict:
    biggest_class, biggest_function = ("", 0), ("", 0)
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = f"src/flowgrpo/{path.relative_to(package).as_posix()}:{node.name}"
                if isinstance(node, ast.ClassDef) and lines > biggest_class[1]:
                    biggest_class = (where, lines)
                elif not isinstance(node, ast.ClassDef) and lines > biggest_function[1]:
                    biggest_function = (where, lines)
    return {"largest_class": biggest_class, "largest_function": biggest_function}


# ---- algorithms: where they are restated, what a new one touches -------------------------------------------------
#: the parts that must ask the algorithm's spec for every fact about an algorithm
ASKING_PARTS = ("plan/", "cli/", "trainer/")


def _algorithm_names() -> tuple[set[str], set[str], set[str]]:
    """(trainer names, configuration class names, settings that belong to an algorithm, not to OnlineRLConfig)."""
    import dataclasses

    from flowgrpo.trainer.online_config import OnlineRLConfig
    from flowgrpo.trainer.registry import TRAINERS

    shared = {f.name for f in dataclasses.fields(OnlineRLConfig)}
    configs, own = set(), set()
    for name in TRAINERS:
        cls = TRAINERS[name].config_class()
        configs.add(cls.__name__)
        own |= {f.name for f in dataclasses.fields(cls)} - shared
    return set(TRAINERS), configs, own


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports_algorithms(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
    else:
        modules = [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
    return any(f".{m}.".find(".algorithms.") >= 0 for m in modules)


def algorithm_restatements(package: Path = PACKAGE) -> list[str]:
    """Every place of the package under ``package`` outside ``trainer/algorithms/`` and the registry that restates an
    algorithm (the module docstring), as ``path:line: what``."""
    names, configs, own = _algorithm_names()
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("trainer/algorithms/") or rel == "trainer/registry.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = _type_checking_lines(tree)
        asks_spec = rel.startswith(ASKING_PARTS)
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Compare):
                for side in (node.left, *node.comparators):
                    elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    found += [f"{where}: compares with the trainer name {e.value!r}" for e in elements
                              if isinstance(e, ast.Constant) and e.value in names]
            elif isinstance(node, ast.Dict):
                found += [f"{where}: a table keyed by the trainer name {k.value!r}" for k in node.keys
                          if isinstance(k, ast.Constant) and k.value in names]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                    and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                found += [f"{where}: isinstance on {k.id}" for k in kinds
                          if isinstance(k, ast.Name) and k.id in configs]
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in typing_only \
                    and _imports_algorithms(node):
                found.append(f"{where}: imports from trainer.algorithms")
            if not asks_spec:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in own:
                found.append(f"{where}: reads the algorithm setting {node.args[1].value!r}")
            elif isinstance(node, ast.Attribute) and node.attr in own and isinstance(node.value, ast.Name) \
                    and node.value.id in ("args", "training_args"):
                found.append(f"{where}: reads the algorithm setting {node.attr!r}")
    return found


def new_algorithm_files() -> dict:
    """What the plugin of the tests (tests/support/plugin_package.py, a complete algorithm) adds: its source files and
    its entry points."""
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location("plugin_package", ROOT / "tests" / "support" / "plugin_package.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with tempfile.TemporaryDirectory() as folder:
        site = module.install_plugin_package(Path(folder))
        sources = sorted(p.name for p in site.glob("*.py"))
        points = [line for p in site.glob("*.dist-info/entry_points.txt")
                  for line in p.read_text(encoding="utf-8").splitlines() if "=" in line]
    return {"source_files": sources, "entry_points": points}


def revision_tree(revision: str, into: Path) -> Path:
    """The package's source at a git ``revision``, extracted under ``into``; returns its ``flowgrpo`` folder."""
    import subprocess
    import tarfile

    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", revision, "src/flowgrpo"], stdout=f,
                       check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src" / "flowgrpo"


def algorithm_figures(package: Path = PACKAGE) -> dict:
    places = algorithm_restatements(package)
    return {"restatements": len(places), "restatement_list": places}


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
    parser.add_argument("--before", default=None, metavar="REVISION",
                        help="also the largest definitions and the algorithm restatements at this git revision")
    cli = parser.parse_args()
    report = {**largest_definitions(), "trainer_chain": trainer_chain(), **import_figures(),
              "algorithms": algorithm_figures(), "new_algorithm": new_algorithm_files()}
    if cli.before:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            old = revision_tree(cli.before, Path(folder))
            report["before"] = {"revision": cli.before, **largest_definitions(old),
                                "algorithms": algorithm_figures(old)}
    if not cli.no_step:
        report["training_step"] = traced_step_files()
    text = json.dumps(report, indent=1)
    if cli.output:
        Path(cli.output).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)


if __name__ == "__main__":
    main()
