"""Every trainer trains exactly as recorded: the same weights and the same logged metrics after two steps on the
toy world, and a checkpoint written by the recorded code resumes to the same weights.

The record (``behaviour_data/behaviour_record.json``) and the checkpoints (``behaviour_data/checkpoints/``) were written by
``tests/support/behaviour_runs.py`` before the trainer was restructured into its parts; a restructuring or any other
change that is meant to keep behaviour must keep them. Weights are compared exactly (SHA-256 of the exported LoRA)
where the CPU kernels are those of the record, and through 8 random projections within a relative 1e-4 elsewhere
(other SIMD kernels round differently); metrics within a relative 1e-4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.behaviour_runs import RESUMED_RUNS, RUNS, cpu_capability, run_one

DATA = Path(__file__).parent / "behaviour_data"
RECORD = json.loads((DATA / "behaviour_record.json").read_text())
FIX = ("the trainer no longer trains as recorded. If the change of behaviour is intended, record again "
       "(tests/support/behaviour_runs.py --record ...) and say why in the commit.")


@pytest.fixture(scope="module")
def toy_world():
    from flowgrpo.toy.build import cached_toy_world

    return cached_toy_world("full", seed=0, log=lambda message: None)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the record's
    yield
    torch.set_num_threads(threads)


def assert_same_weights(got: dict, want: dict, what: str) -> None:
    assert got["numel"] == want["numel"], what
    if cpu_capability() == RECORD["cpu_capability"]:
        assert got["sha256"] == want["sha256"], f"{what}: {FIX}"
    assert got["projection"] == pytest.approx(want["projection"], rel=1e-4, abs=1e-6), f"{what}: {FIX}"


def assert_same_metrics(got: list[dict], want: list[dict], what: str) -> None:
    assert [sorted(g) for g in got] == [sorted(w) for w in want], f"{what}: the logged keys changed; {FIX}"
    for g, w in zip(got, want):
        for key, value in w.items():
            if value is None:
                assert g[key] is None, f"{what}: {key}"
            else:
                assert g[key] == pytest.approx(value, rel=1e-4, abs=1e-7), f"{what}: {key}; {FIX}"


@pytest.mark.run_first
@pytest.mark.parametrize("name", [n for n in RUNS if n not in RESUMED_RUNS])
def test_trainer_trains_as_recorded(name, toy_world, tmp_path):
    got = run_one(name, toy_world, tmp_path)
    want = RECORD["runs"][name]
    assert_same_weights(got["weights"], want["weights"], f"{name} exported LoRA")
    assert_same_weights(got["checkpoint_weights"], want["checkpoint_weights"], f"{name} checkpoint-2 LoRA")
    assert_same_metrics(got["metrics"], want["metrics"], name)


@pytest.mark.parametrize("name", RESUMED_RUNS)
def test_recorded_checkpoint_resumes_to_the_recorded_weights(name, toy_world, tmp_path):
    """checkpoint-1 as the recorded code wrote it (LoRA, optimizer, EMA or old policy, reference, health state)
    resumes, and step 2 ends where the uninterrupted recorded run ended."""
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(DATA / "checkpoints" / name / "checkpoint-1", checkpoint)
    got = run_one(name, toy_world, tmp_path / "run", resume_from=checkpoint)
    want = RECORD["runs"][name]
    assert_same_weights(got["weights"], want["weights"], f"{name} resumed, exported LoRA")
    step2 = [m for m in want["metrics"] if m.get("step") == 2 and "loss" in m]
    assert_same_metrics([m for m in got["metrics"] if m.get("step") == 2 and "loss" in m], step2, f"{name} step 2")
