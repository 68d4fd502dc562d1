"""Sequence parallelism trains what one process trains (CPU, gloo; ``sequence_parallel_worker.py``).

One subprocess runs two launches (forked ranks, one start-up): two processes with ``sequence_parallel_size`` 2 for
Wan T2V (9 video tokens: an uneven split), LTX-2 (video and sound, 5 sound tokens) and HunyuanVideo 1.5 with
Flow-GRPO, Wan with DiffusionNFT, a run resumed from its checkpoint, the same Wan run on two data-parallel ranks, and
one split transformer call of each other family that uses diffusers' plans; then four processes, 2 data-parallel x 2
sequence-parallel, with the FSDP2 check. Meanwhile this process trains the
same runs alone, the reference of the two-process runs. Every check compares the decoded frames, the rollouts'
log-probs (NFT: its final latents) and the weights after two optimizer steps, within 1e-5.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# One worker runs the module's tests (the other would wait on the launches' lock, its core idle, rather than take other
# tests meanwhile); the launches make them one of the longest units, started first (tests/durations.json).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sequence_parallel_launches")]
sys.path.insert(0, str(Path(__file__).parent))

import sequence_parallel_worker as worker  # noqa: E402

TOLERANCE = 1e-5
FAMILY_RUNS = ("wan", "ltx2", "hunyuanvideo15", "wan_nft")
PHASES = [
    {"processes": 2, "runs": [["wan", 2], ["wan_resumed", 2], ["ltx2", 2], ["hunyuanvideo15", 2], ["wan_nft", 2],
                              ["wan", 1]], "families": list(worker.PLAN_FAMILIES)},
    {"processes": 4, "runs": [["wan", 2]], "fsdp2": 2},
]


@pytest.fixture(scope="module")
def launches(tiny_pipeline_path, tmp_path_factory):
    """Start the launches, train the single-process references meanwhile, wait; the folder holding both. Built once
    per test session, even when test workers split this module (the folder is shared by the session's workers)."""
    from flowgrpo.build_cache import build_folder_once

    paths = {family: str(tiny_pipeline_path(family)) for family in ("wan", "ltx2", "hunyuanvideo15")}
    paths.update({name: str(tiny_pipeline_path(family, variant))
                  for name, (family, variant, _, _) in worker.PLAN_FAMILIES.items()})
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's folder

    def build(out: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, "tests/distributed/sequence_parallel_worker.py", "--pipelines",
                                 json.dumps(paths), "--output_dir", str(out / "launches"), "--phases",
                                 json.dumps(PHASES)],
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for name in FAMILY_RUNS:
                worker.run(name, paths, out / "single", 1)
            log, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, log[-8000:]
        (out / "done.json").write_text(json.dumps({"phases": PHASES}))

    return build_folder_once(shared / "sequence_parallel_launches", build, marker="done.json",
                             what="sequence-parallel launches")


def _record(folder: Path, name: str, size: int, rank: int = 0) -> dict:
    return torch.load(folder / worker.run_folder(name, size) / f"rank{rank}.pt")


def _max_difference(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def assert_same_training(expected: dict, got: dict) -> None:
    """Frames, rollout tensors and final weights equal within `TOLERANCE`; the same rewards logged."""
    assert len(got["frames"]) == len(expected["frames"]) > 0
    assert _max_difference(expected["frames"], got["frames"]) < TOLERANCE
    assert len(got["rollouts"]) == len(expected["rollouts"]) == 2
    for gen_expected, gen_got in zip(expected["rollouts"], got["rollouts"]):
        for mb_expected, mb_got in zip(gen_expected, gen_got, strict=True):
            assert set(mb_got) == set(mb_expected) and mb_got
            for key in mb_expected:
                assert float((mb_got[key] - mb_expected[key]).abs().max()) < TOLERANCE, key
    assert set(got["weights"]) == set(expected["weights"])
    moved = max(float(t.abs().max()) for k, t in expected["weights"].items() if "lora_B" in k)
    assert moved > 20 * TOLERANCE  # the LoRA moved from its start, far beyond the tolerance
    for key, tensor in expected["weights"].items():
        assert float((got["weights"][key] - tensor).abs().max()) < TOLERANCE, key
    rewards = [log["reward"] for log in expected["logs"] if "reward" in log]
    assert [log["reward"] for log in got["logs"] if "reward" in log] == pytest.approx(rewards, abs=1e-6)
    # the evaluation counts every prompt once: the same metrics (3 samples, not 3 per process)
    assert expected["eval"]["eval_rewards/brightness_reward/count"] == 3.0
    for key in ("eval_reward", "eval_reward_std", "eval_rewards/brightness_reward/count"):
        assert got["eval"][key] == pytest.approx(expected["eval"][key], abs=1e-6), key


@pytest.mark.parametrize("name", FAMILY_RUNS)
def test_two_sequence_parallel_processes_train_as_one(launches, name):
    single = _record(launches / "single", name, 1)
    world2 = launches / "launches" / "world2"
    ranks = [_record(world2, name, 2, rank) for rank in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for record in ranks:  # both processes of the group hold the whole samples and the same weights
        assert_same_training(single, record)
    # the rewards are counted once: the logged mean and std are the single process's, not of a doubled batch
    for key in ("reward", "reward_std"):
        assert [log.get(key) for log in ranks[0]["logs"]] == [log.get(key) for log in ranks[1]["logs"]]


def test_resumed_run_ends_where_the_uninterrupted_one_does(launches):
    world2 = launches / "launches" / "world2"
    assert (world2 / worker.run_folder("wan", 2) / "checkpoint-1").is_dir()
    uninterrupted, resumed = _record(world2, "wan", 2), _record(world2, "wan_resumed", 2)
    for key, tensor in uninterrupted["weights"].items():
        assert float((resumed["weights"][key] - tensor).abs().max()) < TOLERANCE, key


def test_exported_lora_is_the_single_process_one(launches):
    from safetensors.torch import load_file

    name = worker.run_folder("wan", 2)
    exported = load_file(launches / "launches" / "world2" / name / "pytorch_lora_weights.safetensors")
    expected = load_file(launches / "single" / worker.run_folder("wan", 1) / "pytorch_lora_weights.safetensors")
    assert set(exported) == set(expected) and all(k.startswith("transformer.") for k in exported)
    for key, tensor in expected.items():
        assert float((exported[key] - tensor).abs().max()) < TOLERANCE, key


def test_two_by_two_processes_train_as_two_data_parallel(launches):
    world2, world4 = launches / "launches" / "world2", launches / "launches" / "world4"
    for replica in (0, 1):
        expected = _record(world2, "wan", 1, replica)  # data-parallel rank `replica` of two
        for member in (0, 1):
            assert_same_training(expected, _record(world4, "wan", 2, 2 * replica + member))


def test_fsdp2_over_data_and_sequence_parallel_gives_the_mean_gradient(launches):
    ranks = [json.loads((launches / "launches" / "world4" / "fsdp2" / f"rank{r}.json").read_text())
             for r in range(4)]
    for record in ranks:
        assert record["world_size"] == 4 and record["compared"] > 0
        assert record["sharded_gradients"] == record["compared"]  # every LoRA gradient was a DTensor shard
        assert record["worst_relative_difference"] < TOLERANCE


@pytest.mark.parametrize("name", list(worker.PLAN_FAMILIES))
def test_diffusers_plans_split_the_other_families_exactly(launches, name):
    """FLUX.1, Kontext, FLUX.2 [klein], Qwen-Image-Edit-Plus and Wan 2.2 TI2V through diffusers' own plans: one call,
    split over two processes, gives the whole call's velocity and, summed, its gradients."""
    for rank in (0, 1):
        record = json.loads((launches / "launches" / "world2" / "families" / name / f"rank{rank}.json").read_text())
        assert record["gradients"] > 0 and record["missing"] == 0
        assert record["velocity_max_abs_diff"] < TOLERANCE * max(1.0, record["velocity_max_abs"])
        assert record["gradient_max_relative_diff"] < 1e-4

