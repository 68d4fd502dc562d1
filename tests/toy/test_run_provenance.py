"""What a toy run records of its making (flowgrpo.toy.provenance) and the reuse rule built on it: a run is reused only
when its code digest, recomputed from today's sources, is the recorded one (and its teachers' weights too); the
commit and whether the tree was clean are read from git."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flowgrpo.toy import provenance
from flowgrpo.toy.provenance import code_record, digest_now, git_state, reusable_code, weights_digest

REPO = Path(__file__).resolve().parents[2]


def test_the_code_digest_follows_every_imported_source(tmp_path, monkeypatch):
    package = tmp_path / "flowgrpo"
    (package / "toy").mkdir(parents=True)
    for path, text in ((package / "__init__.py", ""), (package / "toy" / "__init__.py", ""),
                       (package / "toy" / "learning.py", "STEPS = 300\n")):
        path.write_text(text)
    monkeypatch.setattr(provenance, "_PACKAGE_ROOT", package)
    modules = ["flowgrpo", "flowgrpo.toy", "flowgrpo.toy.learning"]
    record = {"digest": digest_now(modules), "modules": modules, "consistent": True}
    assert reusable_code(record)
    (package / "toy" / "learning.py").write_text("STEPS = 301\n")  # one changed line of one imported module
    assert not reusable_code(record)
    (package / "toy" / "learning.py").write_text("STEPS = 300\n")
    assert reusable_code(record)
    (package / "toy" / "learning.py").unlink()  # a module that is gone
    assert not reusable_code(record)
    assert not reusable_code({**record, "consistent": False}) and not reusable_code(None)


def test_a_record_is_inconsistent_when_a_source_changed_during_the_run():
    record = code_record()
    assert record["consistent"] and "flowgrpo.toy.provenance" in record["modules"] and reusable_code(record)
    assert not code_record(start={"flowgrpo.toy.provenance": "0" * 64})["consistent"]


def test_git_state_reads_the_commit_and_a_clean_code_tree(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    state = git_state(tmp_path)
    assert state["clean"] and len(state["commit"]) == 40
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "run.json").write_text("{}")  # an archived run: not code
    assert git_state(tmp_path)["clean"]
    (tmp_path / "src" / "b.py").write_text("y = 2\n")  # an untracked module
    assert not git_state(tmp_path)["clean"]


def test_a_run_made_from_other_code_or_teachers_is_not_reused(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    import learning_benchmark as bench

    settings = bench.leaderboard_runs(3, [0], ["fast-random"], None)[0][0]
    evaluation = {"prompts": 4, "images_per_prompt": 1}
    result = {"settings": dataclasses.asdict(settings), "eval": evaluation, "world": "w", "code": code_record()}
    path = tmp_path / "seed0.json"

    def reused(run, settings=settings, **kwargs):
        path.write_text(json.dumps(run))
        return bench.reusable_run(path, settings, evaluation, "w", **kwargs) is not None

    assert reused(result)
    other = {**result, "code": {**result["code"], "digest": "0" * 64}}
    assert not reused(other) and reused(other, require_code=False)  # --finished-only still shows it
    assert not reused({k: v for k, v in result.items() if k != "code"})  # no digest recorded
    # a distillation run: its teachers' weights must be the experts' of today
    teacher = tmp_path / "shape"
    teacher.mkdir()
    (teacher / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    student = dataclasses.replace(settings, extra_config={"teachers": [{"lora": str(teacher)}]})
    run = {**result, "settings": dataclasses.asdict(student),
           "teachers": [{"lora": str(teacher), "sha256": weights_digest(teacher)}]}
    assert reused(run, student)
    (teacher / "pytorch_lora_weights.safetensors").write_bytes(b"retrained")
    assert not reused(run, student)


@pytest.mark.parametrize("attempt", ["awm-colour-kept-cfg3-600", "dgpo-colour-kept-600"])
def test_goal_attempts_are_the_rows_with_the_constraint(attempt):
    sys.path.insert(0, str(REPO / "scripts"))
    import learning_goals

    settings = learning_goals.attempt_settings(attempt, 3)
    config = settings.config_kwargs()
    assert settings.max_steps == 600 and settings.seed == 3
    assert config["reward_constraints"]["toy_color"] == {"min_delta": -0.01, "source": "evaluation"}
    assert config.get("rollouts_at_eval_guidance", False) == ("cfg3" in attempt)
