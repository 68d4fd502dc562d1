"""The algorithm spec: every built-in algorithm registered once (entry point and table agree), the facts each gives,
and nothing outside ``trainer/algorithms/`` and the registry restating an algorithm (no per-algorithm table, no
comparison with a trainer's name, no ``isinstance`` on an algorithm's configuration, no import of
``flowgrpo.trainer.algorithms``, and in the parts that must ask the spec, no read of an algorithm's own setting)."""

from __future__ import annotations

import ast
import dataclasses
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from flowgrpo.trainer.algorithm_spec import AlgorithmSpec
from flowgrpo.trainer.registry import BUILTIN_TRAINERS, ENTRY_POINT_GROUP, TRAINERS, check_trainer_name, spec_of

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "flowgrpo"
#: the parts that must ask the spec for every algorithm fact (issue: plan/, cli/, trainer/health/, trainer/rollout/)
ASKING_PARTS = ("plan/", "cli/", "trainer/")


def test_builtins_register_through_the_entry_point_group_as_a_plugin_would():
    points = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name, (spec_path, config, trainer) in BUILTIN_TRAINERS.items():
        assert points[name] == spec_path
        spec = TRAINERS[name]
        assert isinstance(spec, AlgorithmSpec) and spec.name == name
        assert (spec.config, spec.trainer) == (config, trainer)
        assert spec_of(spec.config_class()(output_dir="/tmp/unused", report_to=[],
                                           **_valid_kwargs(name))) is spec


def _valid_kwargs(name: str) -> dict:
    return {"dgpo": {"per_device_train_batch_size": 16}, "crd": {"per_device_train_batch_size": 24},
            "diffusion_opd": {"teacher_lora": "teacher"}}.get(name, {})


def _config(name: str, **kwargs):
    return TRAINERS[name].config_class()(output_dir="/tmp/unused", report_to=[], num_inference_steps=10,
                                         **{**_valid_kwargs(name), **kwargs})


def test_each_algorithm_states_its_copies_record_workers_probe_and_step():
    grpo = TRAINERS["flow_grpo"].facts(_config("flow_grpo", sde_window_size=3, sde_window_range=[0, 4]))
    assert grpo.copies == () and grpo.record.kind == "transitions" and grpo.record.steps == 3
    assert grpo.record.last_step == 4 + 3 - 2 and grpo.workers.importance_weights
    assert (grpo.step.trained_input, grpo.step.trained_timesteps, grpo.step.loss) == ("recorded_transition", 3, "ratio")
    dppo = TRAINERS["flow_grpo"].facts(_config("flow_grpo", policy_loss="dppo", num_iterations=2))
    assert dppo.record.means and dppo.step.stored_per_step == 3 and not dppo.workers.refusal
    assert "anchor" in dppo.workers.trainer_replay and "anchor" in dppo.workers.staleness
    dance = TRAINERS["flow_grpo"].facts(_config("flow_grpo", sde_type="dance", timestep_fraction=0.5))
    assert dance.step.trained_timesteps == 4  # int(9 recorded steps x 0.5): DanceGRPO's subset

    nft = TRAINERS["diffusion_nft"].facts(_config("diffusion_nft", timestep_fraction=0.5))
    assert [c.name for c in nft.copies] == ["old_policy"] and nft.copies[0].samples_rollouts
    assert nft.workers.sampled_by == "old_policy" and nft.workers.synced == ("old_policy",)
    assert (nft.step.trained_input, nft.step.trained_timesteps) == ("noised_sample", 5)
    assert nft.step.frozen_forwards[0] == "old_policy" and nft.probe.source == "noised_sample"

    crd = TRAINERS["crd"].facts(_config("crd"))
    assert crd.named_copies == ("sampling",) and crd.workers.sampled_by == "sampling"
    assert crd.workers.synced == ("sampling",)  # the old copy only the loss reads stays on the trainer
    dgpo = TRAINERS["dgpo"].facts(_config("dgpo", dgpo_switch_ema_ref=7, max_steps=20))
    assert dgpo.keeps_old_policy and dgpo.copies[0].samples_rollouts and dgpo.step.trained_timesteps == 4
    assert (dgpo.workers.sampled_by, dgpo.workers.synced, dgpo.workers.switch_step) == ("old_policy", ("old_policy",), 7)
    tree = TRAINERS["flow_grpo"].facts(_config("flow_grpo", **BRANCH))
    assert tree.workers.whole_groups and not grpo.workers.whole_groups
    awm = TRAINERS["awm"].facts(_config("awm", off_policy=True))
    assert awm.workers.sampled_by == "old_policy" and awm.step.trained_batch == awm.step.trained_batch > 0
    dpo = TRAINERS["diffusion_dpo"].facts(_config("diffusion_dpo", dpo_mode="offline"))
    assert dpo.record.kind == "pairs" and "offline" in dpo.workers.refusal and dpo.reads_reference
    opd = TRAINERS["diffusion_opd"].facts(_config("diffusion_opd"), use_lora=True)
    teacher = opd.copy("teacher")
    assert (teacher.count, teacher.kind) == (1, "adapter") and opd.step.frozen_forwards == ("teacher",)
    assert TRAINERS["diffusion_opd"].facts(_config("diffusion_opd"), use_lora=False).copy("teacher").kind == "model"
    assert opd.workers.synced == () and "teachers" in opd.workers.trainer_replay
    # the seven trainers of the Ray issue run on rollout workers; offline Diffusion-DPO (it samples nothing) and the
    # reward-gradient trainer (its rollout is its loss) are refused
    assert [name for name in TRAINERS if name in BUILTIN_TRAINERS
            and TRAINERS[name].facts(_config(name)).workers.refusal] == ["reward_backprop"]


#: a BranchGRPO tree of 4 leaves over 10 steps
BRANCH = {"branch_steps": [0, 3], "branch_factor": 2, "num_generations": 4, "sde_window_size": 0}
#: the rows of docs/distributed.md's table of what rollout workers need: (name, trainer, settings)
WORKER_TABLE_ROWS = [
    ("Flow-GRPO family", "flow_grpo", {}),
    ("Flow-GRPO, truncated_importance_cap", "flow_grpo", {"rollout_backend": "ray", "truncated_importance_cap": 2.0}),
    ("Flow-DPPO (policy_loss: dppo)", "flow_grpo", {"policy_loss": "dppo", "num_iterations": 2}),
    ("BranchGRPO (branch_steps)", "flow_grpo", BRANCH),
    ("DiffusionNFT", "diffusion_nft", {}),
    ("AWM, off_policy", "awm", {"off_policy": True}),
    ("online Diffusion-DPO", "diffusion_dpo", {"dpo_mode": "online"}),
    ("DGPO", "dgpo", {"dgpo_switch_ema_ref": 200, "max_steps": 1000}),
    ("CRD", "crd", {}),
    ("on-policy distillation", "diffusion_opd", {}),
]


def test_the_distributed_page_states_what_each_algorithms_spec_says_of_workers():
    """docs/distributed.md's table of staleness per algorithm is the one the specs give (`worker_needs_table`)."""
    from flowgrpo.trainer.algorithm_spec import worker_needs_table

    table = worker_needs_table([(title, TRAINERS[name].facts(_config(name, **settings)))
                                for title, name, settings in WORKER_TABLE_ROWS])
    page = (PACKAGE.parents[1] / "docs" / "distributed.md").read_text(encoding="utf-8")
    assert table in page, "docs/distributed.md must hold this table (regenerate it from the specs):\n" + table


def test_a_users_subclass_of_a_configuration_is_that_algorithm():
    from flowgrpo import FlowGRPOConfig

    @dataclasses.dataclass
    class MyConfig(FlowGRPOConfig):
        my_weight: float = 1.0

    assert spec_of(MyConfig(output_dir="/tmp/unused", report_to=[])) is TRAINERS["flow_grpo"]
    with pytest.raises(ValueError, match="is not the configuration of a registered trainer"):
        spec_of(object())


def test_a_misspelt_trainer_gets_the_closest_names():
    with pytest.raises(ValueError, match=r"trainer='flow_gpro' is not a trainer; did you mean 'flow_grpo'\?"):
        check_trainer_name("flow_gpro")
    assert check_trainer_name("dgpo") == "dgpo"


# ---- nothing restates an algorithm outside algorithms/ and the registry -------------------------------------------
def _algorithm_facts() -> tuple[set[str], set[str], set[str]]:
    """(trainer names, configuration class names, settings that belong to an algorithm, not to OnlineRLConfig)."""
    from flowgrpo.trainer.online_config import OnlineRLConfig

    shared = {f.name for f in dataclasses.fields(OnlineRLConfig)}
    configs, own = set(), set()
    for name in TRAINERS:
        cls = TRAINERS[name].config_class()
        configs.add(cls.__name__)
        own |= {f.name for f in dataclasses.fields(cls)} - shared
    return set(TRAINERS), configs, own


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks (imports for type checkers only)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def algorithm_restatements(root: Path = PACKAGE) -> list[str]:
    """Every place outside ``trainer/algorithms/`` and the registry that restates an algorithm (see the module
    docstring), as ``path:line: what``."""
    names, configs, own = _algorithm_facts()
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
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
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in typing_only:
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
                if any(m.split(".")[-2:-1] == ["algorithms"] or m.endswith(".algorithms") or m == "algorithms"
                       or ".algorithms." in f".{m}." for m in modules):
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


def test_no_algorithm_is_restated_outside_its_folder_and_the_registry():
    assert algorithm_restatements() == []


def test_the_restatement_check_finds_each_kind(tmp_path):
    """The check itself: a tree with one of each restatement is reported line by line."""
    part = tmp_path / "plan"
    part.mkdir()
    (part / "bad.py").write_text(
        "from ..trainer.algorithms.nft_config import DiffusionNFTConfig\n"
        "COPIES = {'diffusion_nft': 1}\n"
        "def f(args, trainer):\n"
        "    if trainer in ('flow_grpo', 'diffusion_opd'):\n"
        "        return getattr(args, 'sde_window_size', 0) + args.noise_level\n"
        "    return isinstance(args, DiffusionNFTConfig)\n", encoding="utf-8")
    found = algorithm_restatements(tmp_path)
    assert len(found) == 7, found
    kinds = {line.split(": ", 1)[1].split(" '")[0].split(" on ")[0] for line in found}
    assert kinds == {"imports from trainer.algorithms", "a table keyed by the trainer name",
                     "compares with the trainer name", "isinstance", "reads the algorithm setting"}
