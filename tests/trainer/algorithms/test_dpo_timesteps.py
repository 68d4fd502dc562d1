"""The noise levels of Diffusion-DPO's loss (flowgrpo.trainer.algorithms.dpo_timesteps): logit-normal(0, 1) through
the scheduler's shift exactly as flow_grpo's ``train_sd3_dpo.py`` draws them, and the uniform draw."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling

from flowgrpo.trainer.algorithms.dpo_timesteps import (
    logit_normal_sigmas,
    sample_dpo_sigmas,
    training_sigmas,
    uniform_sigmas,
)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_training_levels_are_the_schedulers(shift):
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    assert torch.equal(training_sigmas(shift), scheduler.sigmas)
    assert torch.equal(training_sigmas(shift) * 1000, scheduler.timesteps)


def test_logit_normal_levels_are_the_references_draw():
    """flow_grpo: u = compute_density_for_timestep_sampling('logit_normal', 0, 1); indices = (u * 1000).long();
    timesteps = scheduler.timesteps[indices]; sigmas = the scheduler's sigmas at those timesteps (SD3.5-M: shift 3)."""
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = compute_density_for_timestep_sampling("logit_normal", 64, logit_mean=0, logit_std=1,
                                              generator=torch.Generator().manual_seed(5))
    indices = (u * scheduler.config.num_train_timesteps).long()
    reference = scheduler.sigmas[indices]
    ours = logit_normal_sigmas(64, 3.0, torch.Generator().manual_seed(5))
    assert ours.dtype == torch.float32 and ours.shape == (64,)
    assert torch.equal(ours, reference)
    assert torch.equal(ours * 1000, scheduler.timesteps[indices])  # the transformer's timestep
    assert torch.equal(sample_dpo_sigmas("logit_normal", 64, 3.0, torch.Generator().manual_seed(5)), ours)


def test_logit_normal_levels_follow_the_shifted_logit_normal():
    sigmas = logit_normal_sigmas(200_000, 3.0, torch.Generator().manual_seed(0)).double()
    # t = 3 r / (1 + 2 r) with r logit-normal(0, 1) (rounded up to a multiple of 1 / 1000): median 3 / 4
    assert sigmas.median().item() == pytest.approx(0.75, abs=3e-3)
    r = sigmas / (3 - 2 * sigmas)  # the unshifted level
    logits = torch.log(r / (1 - r.clamp(max=1 - 1e-9)))
    finite = logits[r < 1]
    assert finite.mean().item() == pytest.approx(0.0, abs=0.01) and finite.std().item() == pytest.approx(1.0, abs=0.01)
    # share of draws above the unshifted level 0.9: P(z > logit 0.9) for z ~ N(0, 1)
    expected = 0.5 * math.erfc(math.log(9) / math.sqrt(2))
    assert (r > 0.9 + 1e-6).double().mean().item() == pytest.approx(expected, abs=0.003)
    assert 0 < sigmas.min().item() and sigmas.max().item() <= 1.0


def test_uniform_levels_are_the_shifted_uniform():
    g = torch.Generator().manual_seed(4)
    ours = uniform_sigmas(10, 3.0, g)
    u = torch.rand(10, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours, 3 * u / (1 + 2 * u))
    assert torch.equal(uniform_sigmas(5, 1.0, torch.Generator().manual_seed(2)),
                       torch.rand(5, generator=torch.Generator().manual_seed(2)))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="dpo_timestep_distribution='cosine'"):
        sample_dpo_sigmas("cosine", 4, 3.0)
    with pytest.raises(ValueError, match="shift=0"):
        logit_normal_sigmas(4, 0)
    with pytest.raises(ValueError, match="count=-1"):
        uniform_sigmas(-1, 1.0)
