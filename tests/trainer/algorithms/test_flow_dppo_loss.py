"""Flow-DPPO's divergence trust region (flowgrpo.trainer.algorithms.flow_dppo_loss): the hand check of DESIGN section
11, the divergence from transition means against the Gaussian KL by hand, the drop rule, the gradient and the
diagnostics."""

import pytest
import torch

from flowgrpo.schedulers.sde_step import sde_step_from_sigmas
from flowgrpo.trainer.algorithms.flow_dppo_loss import dppo_drop_mask, flow_dppo_loss, transition_divergence


def means_with_divergence(divergence, std, shape=(2, 3, 3)):
    """Old and new means whose per-element mean of (mu - mu_old)^2 / (2 std^2) is ``divergence`` (a constant shift)."""
    old = torch.zeros(len(divergence), *shape, dtype=torch.float64)
    shift = torch.sqrt(2 * torch.tensor(divergence, dtype=torch.float64)) * std
    return old + shift.view(-1, 1, 1, 1), old


def test_hand_check_of_design_section_11():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    rho = torch.tensor([1.2, 0.9, 0.8, 1.1], dtype=torch.float64)
    mean, old = means_with_divergence([2e-5, 2e-5, 2e-5, 5e-6], 0.3)
    out = flow_dppo_loss(torch.log(rho), adv, mean, old, 0.3, dppo_tau=1e-5)
    assert out.divergence.tolist() == pytest.approx([2e-5, 2e-5, 2e-5, 5e-6], rel=1e-9)
    assert out.drop_mask.tolist() == [True, False, True, False]
    assert float(out.loss) == pytest.approx(0.05, abs=1e-12)
    assert float(out.dropped_frac) == 0.5 and float(out.outside_frac) == 0.75
    assert float(out.mean_divergence) == pytest.approx(16.25e-6) and float(out.max_divergence) == pytest.approx(2e-5)


def test_gradient_is_the_unclipped_policy_gradient_of_the_kept_samples():
    log_ratio = torch.log(torch.tensor([1.2, 0.9, 0.8, 1.1, 1.3], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0], dtype=torch.float64)
    mean, old = means_with_divergence([2e-5, 2e-5, 2e-5, 5e-6, 1e-6], 0.5)
    out = flow_dppo_loss(log_ratio, adv, mean, old, torch.full((5,), 0.5))
    out.loss.backward()
    rho = torch.exp(log_ratio.detach())
    expected = torch.where(out.drop_mask, torch.zeros(5, dtype=torch.float64), -adv * rho / 5)
    assert torch.allclose(log_ratio.grad, expected, rtol=1e-12)
    # no ratio clipping: sample 4 (rho 1.3, far outside any PPO range, but inside the divergence region) keeps its
    # full gradient
    assert float(log_ratio.grad[4]) == pytest.approx(-2.0 * 1.3 / 5)


def test_divergence_is_the_per_element_mean_of_the_gaussian_kl_of_real_sde_steps():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    v_new = v + 0.01 * torch.randn(3, 2, 4, 4, generator=g)
    old = sde_step_from_sigmas(v, x, 0.8, 0.7, noise_level=0.7, generator=g)
    new = sde_step_from_sigmas(v_new, x, 0.8, 0.7, prev_sample=old.prev_sample, noise_level=0.7)
    d = transition_divergence(new.prev_sample_mean, old.prev_sample_mean, new.std)
    by_hand = ((new.prev_sample_mean.double() - old.prev_sample_mean.double()) ** 2
               / (2 * new.std.double().view(-1, 1, 1, 1) ** 2)).mean(dim=(1, 2, 3))
    assert torch.allclose(d.double(), by_hand, rtol=1e-5)
    # on the first pass the trained weights are the anchor's: nothing is dropped, the loss is -mean(A rho)
    adv = torch.tensor([1.0, -1.0, 0.5])
    first = flow_dppo_loss(new.log_prob - new.log_prob.detach(), adv, old.prev_sample_mean, old.prev_sample_mean,
                           old.std)
    assert not bool(first.drop_mask.any()) and float(first.loss) == pytest.approx(float(-adv.mean()))


def test_drop_rule_table():
    ratio = torch.tensor([1.1, 0.9, 1.1, 0.9, 1.1, 0.9, 1.0, 1.0])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0, 1.0, -1.0])
    far = torch.full((8,), 1.0)
    assert dppo_drop_mask(ratio, adv, far, 0.5).tolist() == [True, False, False, True, False, False, False, False]
    assert not bool(dppo_drop_mask(ratio, adv, far * 0.1, 0.5).any())
    assert dppo_drop_mask(ratio, adv, far * 0.5, 0.5)[0]  # D >= tau is outside


def test_bad_tau_is_refused():
    with pytest.raises(ValueError, match="dppo_tau=0"):
        flow_dppo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1, 2), torch.zeros(1, 2), 1.0, dppo_tau=0)
