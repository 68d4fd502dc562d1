r"""DiffusionNFT's negative-aware loss on the forward process, as pure functions.

Notation: x0 a rollout's final (clean) sample, eps fresh Gaussian noise, sigma (``t``) one of the rollout's noise
levels, x_t = (1 - sigma) x0 + sigma eps its forward-process point, v_theta the trained policy's velocity at
(x_t, sigma), v_old the old policy's (no gradient: ``sg``), A the sample's group advantage (`advantages.py`), clipped
to +-C with C = ``adv_clip_max``.

* Reward weight (the optimality probability): r = clamp(A / C / 2 + 0.5, 0, 1), so r = 1 for the best samples,
  0 for the worst, 1/2 for an average one.
* Implicit positive and negative policies, both linear in v_theta:

      v+ = nft_beta v_theta + (1 - nft_beta) sg(v_old),      v- = (1 + nft_beta) sg(v_old) - nft_beta v_theta,

  and their data predictions x0+ = x_t - sigma v+, x0- = x_t - sigma v-.
* Adaptive weights, per sample (means over the non-batch dimensions): w+ = sg(max(mean|x0+ - x0|, 1e-5)) and the
  same for w-;  L+ = mean((x0+ - x0)^2) / w+,  L- = mean((x0- - x0)^2) / w-.
* Policy loss: mean over samples of C (r L+ + (1 - r) L-) / nft_beta (C = 5 by default, the published factor).
  Reference penalty (``beta > 0``): kl = mean over samples of mean((v_theta - sg(v_ref))^2). Loss = policy + beta kl.

With the old policy equal to the current one (v_old = v_theta in value) v+ = v- = v_theta, x0+ = x0- = x0_hat
= x_t - sigma v_theta and w+ = w- = w, and since x0_hat - x0 = sigma (v_theta - v*) with v* = eps - x0 the
flow-matching target, the gradient of the policy loss with respect to v_theta of sample b is

      d loss / d v_theta[b] = 2 C sigma^2 (2 r_b - 1) (v_theta[b] - v*[b]) / (w N B)

(N elements per sample, B samples): samples better than their group's mean (r > 1/2) pull the velocity toward
the flow-matching target of their own clean image, worse ones push it away, average ones do nothing; nft_beta drops
out. ``tests/trainer/algorithms/test_nft.py`` checks this against autograd on a tiny model. Everything is computed in float32 at least
(float64 inputs stay float64), whatever the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...schedulers.flow_matching import noised_sample, per_sample

#: Smallest adaptive weight (w+ and w-), as published.
MIN_ADAPTIVE_WEIGHT = 1e-5

__all__ = ["MIN_ADAPTIVE_WEIGHT", "NFTLoss", "implicit_policies", "nft_loss", "noised_sample", "reward_weight"]


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def reward_weight(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(A / adv_clip_max / 2 + 0.5, 0, 1): each sample's weight on the positive branch of the loss."""
    return (advantages / adv_clip_max / 2 + 0.5).clamp(0.0, 1.0)


def implicit_policies(v_theta: torch.Tensor, v_old: torch.Tensor, nft_beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(v+, v-) = (nft_beta v_theta + (1 - nft_beta) sg(v_old), (1 + nft_beta) sg(v_old) - nft_beta v_theta)."""
    v_old = v_old.detach()
    return nft_beta * v_theta + (1 - nft_beta) * v_old, (1 + nft_beta) * v_old - nft_beta * v_theta


@dataclass
class NFTLoss:
    """What `nft_loss` returns: the scalar ``loss`` to differentiate, its parts, and per-sample terms for logging."""

    loss: torch.Tensor            # policy_loss + beta * kl
    policy_loss: torch.Tensor     # mean over samples of adv_clip_max (r L+ + (1 - r) L-) / nft_beta
    positive_loss: torch.Tensor   # L+ per sample, shape (B,)
    negative_loss: torch.Tensor   # L- per sample, shape (B,)
    kl: torch.Tensor | None       # mean((v_theta - v_ref)^2) over everything; None without a reference


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor,
             sigma: torch.Tensor | float, reward_weights: torch.Tensor, nft_beta: float, *,
             adv_clip_max: float = 5.0, v_ref: torch.Tensor | None = None, beta: float = 0.0,
             kl_gate: torch.Tensor | None = None,
             min_weight: float = MIN_ADAPTIVE_WEIGHT) -> NFTLoss:
    """DiffusionNFT's loss for one trained noise level of a micro-batch (the formulas are the module docstring's).

    Args:
        v_theta: the trained policy's velocity at (x_t, sigma), with gradient; shape (B, ...).
        v_old: the old policy's velocity at the same point (its gradient is never used).
        x0: the rollouts' final samples; x_t: their forward-process points at ``sigma`` (`noised_sample`).
        sigma: the noise level, a scalar or one per sample.
        reward_weights: r per sample in [0, 1] (`reward_weight`), shape (B,).
        nft_beta: DiffusionNFT's beta (> 0).
        adv_clip_max: the advantage clip C, which also scales the policy loss (5 as published).
        v_ref: the reference policy's velocity for the penalty (``beta > 0``), or None.
        kl_gate: GARDO's gate, (B,) booleans: the penalty is the mean over the gated samples only (0 when none is).
        beta: the penalty's weight.
        min_weight: floor of the adaptive weights.
    """
    if not nft_beta > 0:
        raise ValueError(f"nft_beta={nft_beta} must be > 0.")
    dtype = _compute_dtype(v_theta, v_old, x0, x_t)
    v_theta = v_theta.to(dtype)
    v_old = v_old.detach().to(dtype)
    x0, x_t = x0.detach().to(dtype), x_t.detach().to(dtype)
    s = per_sample(sigma, x0).to(dtype)
    r = reward_weights.detach().to(dtype).reshape(-1)
    dims = tuple(range(1, x0.dim()))

    v_pos, v_neg = implicit_policies(v_theta, v_old, nft_beta)
    err_pos = (x_t - s * v_pos) - x0
    err_neg = (x_t - s * v_neg) - x0
    with torch.no_grad():
        w_pos = err_pos.abs().mean(dim=dims).clamp(min=min_weight)
        w_neg = err_neg.abs().mean(dim=dims).clamp(min=min_weight)
    positive = err_pos.square().mean(dim=dims) / w_pos
    negative = err_neg.square().mean(dim=dims) / w_neg
    policy = (adv_clip_max * (r * positive + (1 - r) * negative) / nft_beta).mean()
    kl = None
    loss = policy
    if v_ref is not None:
        from .flow_grpo_loss import gated_mean

        kl = gated_mean((v_theta - v_ref.detach().to(dtype)).square().mean(dim=dims), kl_gate)
        loss = policy + beta * kl
    return NFTLoss(loss=loss, policy_loss=policy, positive_loss=positive, negative_loss=negative, kl=kl)
