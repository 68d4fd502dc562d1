r"""Flow-DPPO, a divergence trust region for Flow-GRPO (arXiv 2606.11025; UniRL ``unirl/algorithms/flowdppo.py``,
verl-omni ``FlowDPPOLoss``), as pure functions: ``policy_loss: dppo`` of `FlowGRPOConfig`.

Notation (as Flow-GRPO's, ``flowgrpo.schedulers.sde_step``): for one recorded SDE step of a sample, x' the sampled
next state, mu_theta the transition mean under the trained weights, mu_old the frozen anchor (the transition mean
under the weights that sampled the batch, replayed once per batch without gradient), s the transition's std
(``sigma_t sqrt(-dt)`` for ``sde_type="sde"``), logp the Gaussian log-density of x' (mean over the non-batch
dimensions), A the sample's advantage (not clipped beyond Flow-GRPO's advantage clip).

    rho = exp(logp_theta - logp_old)                                (or GRPO-Guard's normalised log ratio)
    D   = mean[(mu_theta - mu_old)^2 / (2 s^2)]                     the per-element mean of the exact Gaussian KL
    drop = (D >= tau) and ((rho > 1 and A > 0) or (rho < 1 and A < 0))
    L   = mean over samples of where(drop, 0, -A rho)               (dropped samples count as zeros in the mean)

with tau = ``dppo_tau`` (1e-5, calibrated for the per-element mean). Instead of clipping every ratio to
[1 - eps, 1 + eps], a sample's update is switched off only when the policy has already moved far from the anchor
*and* keeps moving in its advantage's direction; corrective moves (rho < 1 with A > 0, rho > 1 with A < 0) and
every move inside the region pass with the unclipped gradient -A rho d logp. No reference KL is part of the
published objective. On the first pass over a fresh batch mu_theta = mu_old, so D = 0 and nothing is dropped: the
trust region only matters from the second pass on (``num_iterations >= 2``; UniRL: 2).

Hand check (``tests/trainer/algorithms/test_flow_dppo_loss.py``): A = (1, 1, -1, -1), rho = (1.2, 0.9, 0.8, 1.1),
D = (2e-5, 2e-5, 2e-5, 5e-6), tau = 1e-5: samples 0 and 2 are dropped, L = (0.9 * -1 + 1.1 * 1) / 4 = 0.05.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .flow_grpo_loss import gaussian_kl

#: The published trust-region size, for the per-element mean of the Gaussian KL.
DEFAULT_DPPO_TAU = 1e-5

__all__ = ["DEFAULT_DPPO_TAU", "FlowDPPOLoss", "dppo_drop_mask", "flow_dppo_loss", "transition_divergence"]


def transition_divergence(mean: torch.Tensor, old_mean: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """D per sample: mean over the non-batch dimensions of (mu_theta - mu_old)^2 / (2 s^2), no gradient, float32 at
    least. ``std``: a number, one value per sample, or a tensor broadcastable to the means; 0 where the step is
    deterministic (D is then 0)."""
    with torch.no_grad():
        return gaussian_kl(mean.detach(), old_mean.detach(), std.detach() if isinstance(std, torch.Tensor) else std,
                           reduction="mean")


def dppo_drop_mask(ratio: torch.Tensor, advantages: torch.Tensor, divergence: torch.Tensor,
                   tau: float = DEFAULT_DPPO_TAU) -> torch.Tensor:
    """(D >= tau) and ((rho > 1 and A > 0) or (rho < 1 and A < 0)), booleans per sample."""
    ratio, advantages, divergence = ratio.detach(), advantages.detach(), divergence.detach()
    outside = divergence >= tau
    return outside & (((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0)))


@dataclass
class FlowDPPOLoss:
    """What `flow_dppo_loss` returns: the scalar ``loss`` and the diagnostics worth logging."""

    loss: torch.Tensor          # mean of where(drop, 0, -A rho)
    ratio: torch.Tensor         # rho per sample (with gradient)
    divergence: torch.Tensor    # D per sample
    drop_mask: torch.Tensor     # dropped samples
    outside_mask: torch.Tensor  # samples with D >= tau (dropped or passed as corrective)

    @property
    def dropped_frac(self) -> torch.Tensor:
        """Share of dropped samples."""
        return self.drop_mask.float().mean()

    @property
    def outside_frac(self) -> torch.Tensor:
        """Share of samples with D >= tau, dropped or not."""
        return self.outside_mask.float().mean()

    @property
    def mean_divergence(self) -> torch.Tensor:
        """Mean of D over the samples."""
        return self.divergence.mean()

    @property
    def max_divergence(self) -> torch.Tensor:
        """Largest D."""
        return self.divergence.max()


def flow_dppo_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                   std: float | torch.Tensor, *, dppo_tau: float = DEFAULT_DPPO_TAU) -> FlowDPPOLoss:
    """The Flow-DPPO loss of one recorded step of a micro-batch (the formulas are the module docstring's).

    Args:
        log_ratio: logp_theta - logp_old per sample (or GRPO-Guard's normalised log ratio), with gradient, ``(B,)``.
        advantages: A per sample, ``(B,)``.
        mean: mu_theta, the transition mean under the trained weights (its gradient is not used here: the
            divergence only selects samples); old_mean: the frozen anchor mu_old.
        std: the transition's std s (a number or one value per sample).
        dppo_tau: the trust region's size tau (> 0).
    """
    if not dppo_tau > 0:
        raise ValueError(f"dppo_tau={dppo_tau} must be > 0 (Flow-DPPO: 1e-5).")
    dtype = torch.promote_types(log_ratio.dtype, torch.float32)
    ratio = torch.exp(log_ratio.to(dtype).reshape(-1))
    adv = advantages.detach().to(dtype=dtype, device=ratio.device).reshape(-1)
    divergence = transition_divergence(mean, old_mean, std).to(device=ratio.device).reshape(-1)
    if not ratio.shape == adv.shape == divergence.shape:
        raise ValueError(f"log_ratio {tuple(ratio.shape)}, advantages {tuple(adv.shape)} and the means' batch "
                         f"{tuple(divergence.shape)} must hold one value per sample.")
    drop = dppo_drop_mask(ratio, adv, divergence, dppo_tau)
    per_sample = torch.where(drop, torch.zeros((), dtype=dtype, device=ratio.device), -adv * ratio)
    return FlowDPPOLoss(loss=per_sample.mean(), ratio=ratio, divergence=divergence, drop_mask=drop,
                        outside_mask=divergence >= dppo_tau)
