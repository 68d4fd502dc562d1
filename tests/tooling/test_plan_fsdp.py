"""FSDP2's own sharding on a fake process group against the planner's per-GPU states (flowgrpo.plan.fsdp_fake).

No GPU and no memory: the full-size SD3.5-Medium transformer with the recipe's LoRA is built on the meta device,
sharded by ``fully_shard`` over a fake process group of 8 ranks and materialised as fake tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_fsdp2_on_a_fake_process_group_shards_the_ocr_recipe_as_planned(capsys):
    from flowgrpo.plan import main

    assert main([str(REPO / "recipes" / "ocr.yaml"), "--check_sharding", "--no_suggestions"]) == 0
    assert "FSDP2 on a fake process group (8 ranks, 25 wrapped modules)" in capsys.readouterr().out

    from flowgrpo.plan.cli import plan_recipe

    result = plan_recipe(str(REPO / "recipes" / "ocr.yaml"), check_sharding=True, with_suggestions=False)
    check = result["details"]["fsdp2_check"]
    assert check["world_size"] == 8 and check["wrapped_modules"] == 25  # 24 JointTransformerBlocks and the model
    # rank 0 holds ceil(d / 8) rows of every parameter: at least numel x bytes / 8, and the padding of uneven first
    # dimensions is small at full size
    for term, ratio in check["rank0_over_planned"].items():
        assert 1.0 <= ratio < 1.01, (term, ratio)
    # the planner's own terms are those numel x bytes / 8 figures (LoRA: float32 AdamW states, two per parameter)
    planned = check["planned_gb"]
    assert result["breakdown_gb"]["optimizer_states"] == pytest.approx(planned["optimizer_states"], abs=1e-3)
    assert planned["trained_weights"] * 2 == pytest.approx(planned["optimizer_states"], rel=1e-12)


def test_fsdp2_check_refuses_what_it_cannot_check():
    from flowgrpo.plan.accelerate_config import Parallelism
    from flowgrpo.plan.fsdp_fake import fsdp2_states

    with pytest.raises(ValueError, match="zero2"):
        fsdp2_states(None, None, Parallelism("zero2", 8, source="ds.yaml"))
