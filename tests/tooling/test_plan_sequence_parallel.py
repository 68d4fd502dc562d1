"""``flowgrpo plan --sequence_parallel_size S``: activations and the transformer's FLOPs divided by S, Ulysses'
all-to-all bytes added to the step time (checked against a count by hand), and the refusals, on the tiny Wan
pipeline (planned from its local folder) and the tiny recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.plan import main, plan_recipe

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "recipes" / "tiny_cpu.yaml")
TWO_GPUS = dict(config_file=str(REPO / "accelerate_configs" / "multi_gpu.yaml"), num_processes=2,
                with_suggestions=False)


def _wan(path, *overrides: str) -> list[str]:
    # 16 x 48 px, 9 frames: 3 x 1 x 3 = 9 video tokens; 16 text tokens; one micro-batch of 2 videos without CFG
    return ["--model_name_or_path", str(path), "--height", "16", "--width", "48", "--num_frames", "9",
            "--guidance_scale", "1.0", "--per_device_train_batch_size", "2",
            "--max_sequence_length", "16", *overrides]


def test_plan_divides_activations_and_flops_and_adds_the_all_to_all(tiny_pipeline_path, tmp_path):
    path = tiny_pipeline_path("wan")
    one = plan_recipe(TINY, _wan(path), **TWO_GPUS)
    two = plan_recipe(TINY, _wan(path, "--sequence_parallel_size", "2"), **TWO_GPUS)
    assert "sequence_parallel" not in one
    assert two["breakdown_gb"]["activations"] == pytest.approx(one["breakdown_gb"]["activations"] / 2, abs=2e-3)
    for key in ("weights", "gradients", "optimizer_states"):  # the data-parallel terms are unchanged
        assert two["breakdown_gb"][key] == one["breakdown_gb"][key]
    assert two["step_flops"] < one["step_flops"]
    sp = two["sequence_parallel"]
    assert sp["size"] == 2 and sp["data_parallel_replicas"] == 1
    # by hand: the tiny Wan has 2 blocks of 4 heads x 16; a block's input is 2 videos x (9 + 16) tokens x 64 x 4 bytes
    # (float32); 4 steps sampled, 3 trained (every step but the last) with a forward and a backward each; each GPU
    # sends (S - 1) / S^2 = 1/4 of each of the 4 exchanged tensors per layer and pass
    block = 2 * (9 + 16) * 64 * 4
    expected = (4 + 3 * 2) * 2 * 4 * block / 4
    assert sp["all_to_all_gb_per_step"] == pytest.approx(expected / 1e9, abs=1e-3)
    out = tmp_path / "plan.json"
    assert main([TINY, *_wan(path, "--sequence_parallel_size", "2"), "--num_processes", "2", "--config_file",
                 str(REPO / "accelerate_configs" / "multi_gpu.yaml"), "--json", str(out), "--no_suggestions"]) == 0
    assert json.loads(out.read_text())["sequence_parallel"]["size"] == 2


def test_plan_refuses_what_training_refuses(capsys):
    assert main([TINY, "--sequence_parallel_size", "2", "--num_processes", "2", "--config_file",
                 str(REPO / "accelerate_configs" / "multi_gpu.yaml")]) == 2
    assert "sequence_parallel_size=2 with sd3: SD3's transformer" in capsys.readouterr().err
    assert main([TINY, "--sequence_parallel_size", "3", "--num_processes", "2", "--config_file",
                 str(REPO / "accelerate_configs" / "multi_gpu.yaml")]) == 2
    assert "sequence_parallel_size=3 does not divide the 2 processes" in capsys.readouterr().err
