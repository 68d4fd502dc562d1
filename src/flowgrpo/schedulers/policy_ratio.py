"""Log-likelihood ratios of a stored transition under the current and the sampling policy.

Both policies are Gaussian transitions with the same std ``s`` (a function of the step's noise levels only): the
sampling ("old") policy ``N(mu_old, s^2)`` drew ``x'``, the current policy has mean ``mu_theta``. Per element,

    log p_theta(x') - log p_old(x') = eps (mu_theta - mu_old) / s - (mu_theta - mu_old)^2 / (2 s^2),
    eps = (x' - mu_old) / s.

``"none"`` uses this exact ratio (reduced by the mean over the non-batch dimensions, as the log-probs). Its second
term is always negative, so ratios are biased below 1 and PPO clipping acts mostly on one side; and its scale
``1 / s`` differs from step to step. GRPO-Guard (``"grpo_guard"``, `grpo_guard_log_ratio`) keeps only the
centred, scale-free first part. Both are exactly 0 on the first pass over a fresh batch (``mu_theta = mu_old``).
"""

from __future__ import annotations

import torch

from .sde_step import check_reduction, compute_dtype_for, reduce_per_sample

__all__ = ["RATIO_NORMALIZATIONS", "grpo_guard_log_ratio"]

RATIO_NORMALIZATIONS = ("none", "grpo_guard")


def grpo_guard_log_ratio(
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    prev_sample: torch.Tensor,
    std: float | torch.Tensor,
    reduction: str = "mean",
) -> torch.Tensor:
    r"""GRPO-Guard's normalised log ratio of one transition, per sample.

        log_ratio = reduce(eps * (mu_theta - mu_old)),   eps = (x' - mu_old) / s

    reduced over the non-batch dimensions by the mean (default) or the sum. Compared with the exact log ratio it
    drops the always-negative ``-(mu_theta - mu_old)^2 / (2 s^2)`` and the ``1 / s`` factor. Samples with ``s = 0``
    (deterministic steps) get 0. Gradients flow through ``mean`` only.

    Args:
        mean: the current policy's transition mean ``mu_theta``, ``(batch, ...)``.
        old_mean: the sampling policy's transition mean ``mu_old`` (stored at sampling time).
        prev_sample: the sampled next state ``x'``.
        std: the transition's std ``s`` (a number, one per sample ``(batch,)``, or broadcastable).
        reduction: ``"mean"`` or ``"sum"``.

    Returns:
        Tensor of shape ``(batch,)`` in the compute dtype (float32, or float64).
    """
    check_reduction(reduction, "reduction")
    if not (mean.shape == old_mean.shape == prev_sample.shape):
        raise ValueError(f"mean {tuple(mean.shape)}, old_mean {tuple(old_mean.shape)} and prev_sample "
                         f"{tuple(prev_sample.shape)} must have the same shape.")
    std_in = std if isinstance(std, torch.Tensor) else None
    dtype = compute_dtype_for(mean, old_mean, prev_sample, std_in)
    batch = mean.shape[0]
    mu, mu_old = mean.to(dtype), old_mean.detach().to(dtype)
    std_t = std_in if std_in is not None else torch.tensor(float(std))
    std_t = std_t.detach().to(device=mu.device, dtype=dtype)
    if std_t.numel() == batch and std_t.ndim >= 1 and std_t.shape[0] == batch and mu.ndim > 1:
        std_t = std_t.reshape((batch,) + (1,) * (mu.ndim - 1))
    std_t = torch.broadcast_to(std_t, mu.shape)
    stochastic = std_t > 0
    eps = torch.where(stochastic, (prev_sample.detach().to(dtype) - mu_old) / torch.where(stochastic, std_t, 1.0),
                      torch.zeros_like(mu))
    return reduce_per_sample(eps * (mu - mu_old), reduction)
