"""KL divergence between two Gaussian transitions that share their standard deviation."""

from __future__ import annotations

import torch

from .sde_step import check_reduction, compute_dtype_for, reduce_per_sample

__all__ = ["gaussian_kl"]


def gaussian_kl(
    mean_a: torch.Tensor, mean_b: torch.Tensor, std: float | torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    r"""Per-sample ``KL(N(mean_a, std^2 I) || N(mean_b, std^2 I))``, reduced like the log-prob.

    For two Gaussians with the same std the KL of each element is

        KL = (mean_a - mean_b)^2 / (2 std^2)

    and it is reduced over all non-batch dimensions by the ``"mean"`` (default) or the ``"sum"``. ``std`` is the
    *transition* std (``FlowMatchSDESchedulerOutput.std``, e.g. ``sigma_t * sqrt(-dt)`` for ``"sde"``), not
    ``sigma_t`` alone. Samples whose std is 0 (deterministic steps) get a KL of 0.

    Args:
        mean_a, mean_b: transition means of the two policies, shape ``(batch, ...)`` (gradients flow through both).
        std: a number, one value per sample (``(batch,)`` or ``(batch, 1, ...)``), or a tensor broadcastable to the
            means.
        reduction: ``"mean"`` or ``"sum"``.

    Returns:
        Tensor of shape ``(batch,)``, float32 (float64 when an input is float64).
    """
    check_reduction(reduction, "reduction")
    if mean_a.shape != mean_b.shape:
        raise ValueError(f"mean_a has shape {tuple(mean_a.shape)} but mean_b has {tuple(mean_b.shape)}; they must match.")
    if mean_a.ndim < 1:
        raise ValueError("The means must have a leading batch dimension, got 0-d tensors.")
    std_t = std if isinstance(std, torch.Tensor) else None
    dtype = compute_dtype_for(mean_a, mean_b, std_t)
    batch = mean_a.shape[0]
    diff = mean_a.to(dtype) - mean_b.to(dtype)

    if std_t is None:
        std_t = torch.tensor(float(std), dtype=dtype, device=diff.device)
    std_t = std_t.to(device=diff.device, dtype=dtype)
    if std_t.numel() == batch and std_t.ndim >= 1 and std_t.shape[0] == batch and diff.ndim > 1:
        std_t = std_t.reshape((batch,) + (1,) * (diff.ndim - 1))
    try:
        std_t = torch.broadcast_to(std_t, diff.shape)
    except RuntimeError:
        raise ValueError(
            f"std of shape {tuple(std_t.shape)} cannot be matched to means of shape {tuple(diff.shape)}: pass a "
            "number, one value per sample, or a tensor broadcastable to the means."
        ) from None
    stochastic = std_t > 0
    safe_std = torch.where(stochastic, std_t, torch.ones_like(std_t))
    kl = torch.where(stochastic, diff**2 / (2 * safe_std**2), torch.zeros_like(diff))
    return reduce_per_sample(kl, reduction)
