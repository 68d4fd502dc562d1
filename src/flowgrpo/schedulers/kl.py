"""KL divergence to the reference policy: the analytic Gaussian KL and its sample estimators.

For one stochastic step both policies are Gaussians with the same std (the transition's std ``s``): the policy
``N(mu_theta, s^2)`` and the reference ``N(mu_ref, s^2)``. `gaussian_kl` is their exact KL; `kl_estimate`
offers it next to the estimators on the sampled next state ``x'`` and a velocity-space penalty (see there).
"""

from __future__ import annotations

import torch

from .sde_step import check_reduction, compute_dtype_for, reduce_per_sample

__all__ = ["KL_ESTIMATORS", "gaussian_kl", "kl_estimate"]

KL_ESTIMATORS = ("analytic", "k1", "k3", "velocity")


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


def _per_sample_std(std: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    batch = like.shape[0]
    std_t = std if isinstance(std, torch.Tensor) else torch.tensor(float(std))
    std_t = std_t.to(device=like.device, dtype=like.dtype)
    if std_t.numel() == batch and std_t.ndim >= 1 and std_t.shape[0] == batch and like.ndim > 1:
        std_t = std_t.reshape((batch,) + (1,) * (like.ndim - 1))
    try:
        return torch.broadcast_to(std_t, like.shape)
    except RuntimeError:
        raise ValueError(
            f"std of shape {tuple(std_t.shape)} cannot be matched to tensors of shape {tuple(like.shape)}: pass a "
            "number, one value per sample, or a tensor broadcastable to the means."
        ) from None


def kl_estimate(
    estimator: str,
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: float | torch.Tensor,
    prev_sample: torch.Tensor | None = None,
    velocity: torch.Tensor | None = None,
    ref_velocity: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    r"""Per-sample KL penalty between the policy and the reference on one transition, reduced like the log-prob.

    With ``s`` the transition's std and, per element, the log-density ratio of the sampled next state
    ``d = log N(x'; mu_ref, s^2) - log N(x'; mu_theta, s^2) = ((x' - mu_theta)^2 - (x' - mu_ref)^2) / (2 s^2)``:

    - ``"analytic"``: ``(mu_theta - mu_ref)^2 / (2 s^2)``, the exact KL (`gaussian_kl`);
    - ``"k1"``: ``-d = log p_theta(x') - log p_ref(x')``;
    - ``"k3"``: ``exp(d) - 1 - d``, non-negative, unbiased for the KL when ``x'`` is drawn from the policy;
    - ``"velocity"``: ``(v_theta - v_ref)^2``, the squared difference of the two velocity predictions.

    Each is computed per element and reduced over the non-batch dimensions by ``reduction`` (``"mean"``, as the
    log-probs). For ``"k3"`` this order matters: ``exp`` of a mean-reduced log ratio is not an unbiased estimate,
    per-element terms are (each element is an independent Gaussian). ``d`` is clamped to at most 20 inside the
    ``exp``. Elements of deterministic samples (``s = 0``) contribute 0 to the ``x'``-based estimators.
    All four are 0 when the policy equals the reference.

    Args:
        estimator: one of ``KL_ESTIMATORS``.
        mean, ref_mean: transition means of the policy (with gradient) and of the reference, ``(batch, ...)``.
        std: the transition's std (a number, one per sample, or broadcastable).
        prev_sample: the sampled next state ``x'`` (``"k1"``, ``"k3"``).
        velocity, ref_velocity: the two velocity predictions (``"velocity"``).
        reduction: ``"mean"`` or ``"sum"``.

    Returns:
        Tensor of shape ``(batch,)`` in the compute dtype (float32, or float64).
    """
    check_reduction(reduction, "reduction")
    if estimator == "analytic":
        return gaussian_kl(mean, ref_mean, std, reduction)
    if estimator == "velocity":
        if velocity is None or ref_velocity is None:
            raise ValueError("kl_estimator='velocity' needs velocity and ref_velocity.")
        if velocity.shape != ref_velocity.shape:
            raise ValueError(f"velocity {tuple(velocity.shape)} and ref_velocity {tuple(ref_velocity.shape)} differ.")
        dtype = compute_dtype_for(velocity, ref_velocity)
        return reduce_per_sample((velocity.to(dtype) - ref_velocity.to(dtype)) ** 2, reduction)
    if estimator not in ("k1", "k3"):
        raise ValueError(f"kl_estimator={estimator!r} is not valid; choose one of "
                         f"{', '.join(map(repr, KL_ESTIMATORS))}.")
    if prev_sample is None:
        raise ValueError(f"kl_estimator={estimator!r} needs prev_sample, the sampled next state x'.")
    if not (mean.shape == ref_mean.shape == prev_sample.shape):
        raise ValueError(f"mean {tuple(mean.shape)}, ref_mean {tuple(ref_mean.shape)} and prev_sample "
                         f"{tuple(prev_sample.shape)} must have the same shape.")
    dtype = compute_dtype_for(mean, ref_mean, prev_sample, std if isinstance(std, torch.Tensor) else None)
    target = prev_sample.detach().to(dtype)
    mu, mu_ref = mean.to(dtype), ref_mean.to(dtype)
    std_t = _per_sample_std(std, mu)
    stochastic = std_t > 0
    safe_var = torch.where(stochastic, std_t, torch.ones_like(std_t)) ** 2
    d = torch.where(stochastic, ((target - mu) ** 2 - (target - mu_ref) ** 2) / (2 * safe_var), torch.zeros_like(mu))
    if estimator == "k1":
        return reduce_per_sample(-d, reduction)
    d = d.clamp(max=20.0)
    return reduce_per_sample(torch.exp(d) - 1 - d, reduction)
