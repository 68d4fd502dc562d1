r"""Diffusion on-policy distillation (arXiv 2605.15055; verl-omni ``DistillKLLoss``, UniRL ``DiffusionOPD``), as pure
functions.

The student samples its own SDE rollouts; a frozen teacher (a second LoRA adapter on the same base, or another base
model; one teacher per domain) replays every recorded state x_j at the same step, without gradient. With mu_S the
student's transition mean at (x_j, step j), mu_T the teacher's, and s the step's transition std (the Flow-GRPO SDE's
``sigma_t sqrt(-dt)``), the per-step KL between the two Gaussian transitions N(mu_S, s^2) and N(mu_T, s^2) is

    exact:  KL_j = mean[(mu_S - mu_T)^2] / (2 s^2)          (mean over the non-batch dimensions)
    ode:    KL_j = mean[(mu_S - mu_T)^2] / 2                 (s replaced by 1: UniRL's mean matching for ODE rollouts)

and the loss is its mean over the trained steps and the samples. The gradient flows through mu_S only: d KL_j /
d mu_S = (mu_S - mu_T) / (N s^2) per element (N elements per sample), so the student's transitions are pulled to the
teacher's on the states the student itself visits. Rewards play no part in the loss (they are only logged).

Differences between the published codes: UniRL's ``add_kl_coefficient=True`` divides by the transition std (our
``exact``) and its default ``False`` by 1 (``ode``); verl-omni's ``DistillKLLoss`` divides by the SDE's
``std_dev_t`` without the sqrt(-dt) factor (the Flow-GRPO reference code's KL quirk), which is not offered here.

Hand check (``tests/trainer/algorithms/test_opd_loss.py``): mu_S - mu_T = 0.02 everywhere, s = 0.5 -> 0.0008; ``ode`` -> 0.0002.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .flow_grpo_loss import gaussian_kl
from .opd_config import OPD_KL_MODES

__all__ = ["OPD_KL_MODES", "OPDLoss", "opd_loss", "opd_step_kl"]


def opd_step_kl(mean: torch.Tensor, teacher_mean: torch.Tensor, std: float | torch.Tensor,
                opd_kl: str = "exact") -> torch.Tensor:
    """KL_j per sample, shape ``(B,)``, with gradient through ``mean`` (the student's) only; float32 at least.

    ``exact`` needs a stochastic step (std > 0 for every sample): on a deterministic step the Gaussian KL is
    undefined, and the ``ode`` form is the one to use."""
    if opd_kl not in OPD_KL_MODES:
        raise ValueError(f"opd_kl={opd_kl!r} is not valid; choose 'exact' (divide by the step's std) or 'ode' "
                         "(divide by 1).")
    teacher_mean = teacher_mean.detach()
    if opd_kl == "ode":
        return gaussian_kl(mean, teacher_mean, 1.0, reduction="mean")
    std_t = std if isinstance(std, torch.Tensor) else torch.tensor(float(std))
    if bool((std_t.detach() <= 0).any()):
        raise ValueError("opd_kl='exact' divides by the step's transition std, but a step has std 0 (a "
                         "deterministic step, or noise_level 0); sample the student's rollouts with the SDE "
                         "(noise_level > 0) or use opd_kl='ode'.")
    return gaussian_kl(mean, teacher_mean, std.detach() if isinstance(std, torch.Tensor) else std, reduction="mean")


@dataclass
class OPDLoss:
    """What `opd_loss` returns: the scalar ``loss`` (mean KL) and the per-sample KL of the step(s)."""

    loss: torch.Tensor
    kl: torch.Tensor  # per (sample, step): shape (B,) for one step, (B, S) for several


def opd_loss(mean: torch.Tensor, teacher_mean: torch.Tensor, std: float | torch.Tensor, opd_kl: str = "exact", *,
             steps_dim: bool = False) -> OPDLoss:
    """The distillation loss: the mean of KL_j over the samples (and steps).

    One step: means ``(B, ...)``, std a number or ``(B,)``. Several steps at once (``steps_dim=True``, the layout of
    UniRL's replay): means ``(B, S, ...)``, std a number, ``(S,)`` (one per step) or ``(B, S)``."""
    if mean.shape != teacher_mean.shape:
        raise ValueError(f"student means {tuple(mean.shape)} and teacher means {tuple(teacher_mean.shape)} must "
                         "have the same shape.")
    if not steps_dim:
        kl = opd_step_kl(mean, teacher_mean, std, opd_kl)
        return OPDLoss(loss=kl.mean(), kl=kl)
    if mean.ndim < 3:
        raise ValueError(f"steps_dim=True needs means of shape (B, S, ...); got {tuple(mean.shape)}.")
    b, s = mean.shape[:2]
    if isinstance(std, torch.Tensor):
        if std.shape not in ((), (s,), (b, s)):
            raise ValueError(f"std of shape {tuple(std.shape)} does not fit means {tuple(mean.shape)}: pass a "
                             f"number, ({s},) or ({b}, {s}).")
        std = std.expand(b, s).reshape(-1)
    kl = opd_step_kl(mean.reshape(b * s, *mean.shape[2:]), teacher_mean.reshape(b * s, *mean.shape[2:]), std,
                     opd_kl).reshape(b, s)
    return OPDLoss(loss=kl.mean(), kl=kl)
