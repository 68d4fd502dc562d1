r"""Flow-GRPO's loss on one recorded transition, with the pieces its variants add: the clipped likelihood ratio,
GRPO-Guard's normalised ratio, the KL estimators and GARDO's gate.

For step j of a micro-batch of B samples with advantages A, the stored transition x_j -> x_{j+1} and its sampling
log-prob log p_old, the current policy's transition mean mu_theta and std s (the step's, from the SDE), and the
reference's mean mu_ref:

    log r = log p_theta(x_{j+1}) - log p_old          (``ratio_normalization="none"``: the exact ratio)
          = mean(eps (mu_theta - mu_old))              (``"grpo_guard"``: eps = (x_{j+1} - mu_old) / s)
    r = exp(log r)
    policy_loss = mean_i max(-A_i r_i, -A_i clip(r_i, 1 - epsilon, 1 + epsilon))
    kl_i = one of (per element, reduced by the mean over non-batch dimensions):
             analytic  (mu_theta - mu_ref)^2 / (2 s^2)
             k1        log p_theta(x') - log p_ref(x')
             k3        exp(d) - 1 - d,  d = log p_ref(x') - log p_theta(x')
             velocity  (v_theta - v_ref)^2
    kl = mean_i kl_i                                   (GARDO: the mean over the gated samples only, 0 if none)
    loss = policy_loss + beta kl

On the first pass over a fresh batch the ratio is exactly 1 (same inputs, dtype and batch composition as sampling);
the trainer checks it. The per-step losses of a micro-batch are averaged by the trainer (each divided by the
number of trained steps and the accumulation steps).

GRPO-Guard: per element, log p_theta(x') - log p_old(x') = eps (mu_theta - mu_old) / s - (mu_theta - mu_old)^2 /
(2 s^2). The second term is always negative, so exact ratios are biased below 1 and PPO clipping acts mostly on one
side; and the 1 / s scale differs from step to step. GRPO-Guard keeps the centred, scale-free first part. Both are
exactly 0 when mu_theta = mu_old.

KL: for one stochastic step both policies are Gaussians with the same std (the transition's std s), so
`gaussian_kl` is their exact KL; `kl_estimate` offers it next to the sample estimators on the sampled next state
and the velocity-space penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...schedulers.sde_step import check_reduction, compute_dtype_for, reduce_per_sample
from .flow_grpo_config import KL_ESTIMATORS, RATIO_NORMALIZATIONS

__all__ = ["KL_ESTIMATORS", "RATIO_NORMALIZATIONS", "FlowGRPOLoss", "clipped_policy_loss", "flow_grpo_loss",
           "gated_mean", "gaussian_kl", "grpo_guard_log_ratio", "kl_estimate"]



@dataclass
class FlowGRPOLoss:
    """``loss`` (with gradient) = ``policy_loss + beta kl``; ``log_ratio`` and ``ratio`` per sample; ``kl`` the
    (gated) mean KL, None without a KL term."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None = None


def clipped_policy_loss(ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float) -> torch.Tensor:
    """PPO's clipped surrogate, ``mean(max(-A r, -A clip(r, 1 - epsilon, 1 + epsilon)))``."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    return torch.maximum(unclipped, clipped).mean()


def gated_mean(per_sample: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """GARDO's gate as it enters a KL term: the mean of ``per_sample`` over the gated samples (0 when none is
    gated); the plain mean when ``gate`` is None."""
    if gate is None:
        return per_sample.mean()
    gate = gate.to(per_sample.device)
    if not bool(gate.any()):
        return per_sample.sum() * 0.0
    return per_sample[gate].mean()


def flow_grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, epsilon: float, *,
                   ratio_normalization: str = "none", mean: torch.Tensor | None = None,
                   old_mean: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None,
                   std: torch.Tensor | None = None, beta: float = 0.0, kl_estimator: str = "analytic",
                   ref_mean: torch.Tensor | None = None, velocity: torch.Tensor | None = None,
                   ref_velocity: torch.Tensor | None = None, kl_gate: torch.Tensor | None = None) -> FlowGRPOLoss:
    """The loss of the module docstring for one recorded step of a micro-batch.

    Args:
        log_prob: log p_theta(x_{j+1}) per sample (with gradient); ``old_log_prob``: the sampling policy's.
        advantages: A per sample; ``epsilon``: the clip range.
        ratio_normalization: ``"none"`` or ``"grpo_guard"`` (needs ``mean``, ``old_mean``, ``prev_sample``, ``std``).
        mean, std: the current policy's transition mean and std; ``prev_sample``: x_{j+1}; ``old_mean``: the
            sampling policy's mean.
        beta: the KL weight (0: no KL term); ``kl_estimator``: one of ``KL_ESTIMATORS``; ``ref_mean`` /
            ``velocity`` / ``ref_velocity``: what the estimator reads; ``kl_gate``: GARDO's gate (bool per sample).
    """
    if ratio_normalization == "grpo_guard":
        log_ratio = grpo_guard_log_ratio(mean, old_mean, prev_sample, std)
    else:
        log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    policy_loss = clipped_policy_loss(ratio, advantages, epsilon)
    loss, kl = policy_loss, None
    if beta > 0:
        kl = gated_mean(kl_estimate(kl_estimator, mean, ref_mean, std, prev_sample=prev_sample, velocity=velocity,
                                    ref_velocity=ref_velocity), kl_gate)
        loss = loss + beta * kl
    return FlowGRPOLoss(loss=loss, policy_loss=policy_loss, log_ratio=log_ratio, ratio=ratio, kl=kl)


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
