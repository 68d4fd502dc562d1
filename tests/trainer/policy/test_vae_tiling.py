"""``vae_tiling``: the policy's pipeline decodes in the VAE's tiles; a VAE that cannot is refused by name."""

from __future__ import annotations

import pytest
import torch


def test_policy_switches_the_vae_to_tiles(tiny_pipeline_path, tmp_path):
    from flowgrpo import FlowGRPOConfig
    from flowgrpo.trainer.policy.policy import Policy

    args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=2, num_generations=2,
                          num_frames=5, resolution=32, vae_tiling=True, dtype="float32")
    policy = Policy(str(tiny_pipeline_path("wan")), args)
    assert policy.pipeline.vae.use_tiling


def test_a_vae_without_tiles_is_refused():
    from flowgrpo.trainer.policy.loading import check_vae_tiling

    with pytest.raises(ValueError, match=r"vae_tiling=True, but this pipeline's VAE \(Linear\) cannot decode in tiles"):
        check_vae_tiling(torch.nn.Linear, "Linear")
