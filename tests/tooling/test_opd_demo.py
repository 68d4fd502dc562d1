"""scripts/opd_demo.py without training: the leaderboard's distillation runs read as the demo's students, the refusal
of runs evaluated differently, and the table. (Training the experts and students is minutes of CPU: the trainer
itself is tested in tests/trainer/algorithms/test_opd_trainer.py and tests/toy/test_toy_dppo_branch_opd_learning.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import opd_demo  # noqa: E402


def _run(folder: Path, seed: int, shape: float, color: float, images: int = 8) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    run = {"settings": {"seed": seed, "max_steps": 300}, "eval": {"prompts": 43, "images_per_prompt": images},
           "after": {"shape": shape, "color": color, "all": shape * color, "n": 43 * images}}
    (folder / f"seed{seed}.json").write_text(json.dumps(run))


def test_leaderboard_runs_are_the_students_and_the_table_summarises_them(tmp_path):
    _run(tmp_path / "diffusion-opd", 0, 0.60, 0.90)
    _run(tmp_path / "diffusion-opd", 1, 0.50, 0.94)
    rows, seeds = opd_demo.leaderboard_students(tmp_path, 43, 8)
    assert seeds == [0, 1]  # the students' own seeds, whatever --seeds says
    assert sorted(rows) == ["student seed 0 (leaderboard, 300 steps)", "student seed 1 (leaderboard, 300 steps)"]
    assert rows["student seed 1 (leaderboard, 300 steps)"]["color"] == 0.94
    results = {"world": {"shape": 0.44, "color": 0.94}, **rows,
               "students": {"shape": {"mean": 0.55, "min": 0.5, "max": 0.6},
                            "color": {"mean": 0.92, "min": 0.9, "max": 0.94}}}
    text = opd_demo.render({"results": results, "prompts": 43, "images_per_prompt": 8, "expert_recipe": "r.yaml",
                            "expert_steps": 300, "student_steps": 300, "students_from": str(tmp_path)})
    assert "| world | 44.0% | 94.0% |" in text and "| students, mean (lowest-highest) | 55.0% (50.0%-60.0%)" in text
    assert "leaderboard's diffusion-opd runs" in text


def test_runs_evaluated_otherwise_or_missing_are_refused_with_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="holds no runs: make them with scripts/learning_benchmark.py"):
        opd_demo.leaderboard_students(tmp_path, 43, 8)
    _run(tmp_path / "diffusion-opd", 0, 0.6, 0.9, images=4)
    with pytest.raises(SystemExit, match="pass --images_per_prompt 4"):
        opd_demo.leaderboard_students(tmp_path, 43, 8)
