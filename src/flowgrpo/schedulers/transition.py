r"""The SDE transition of one recorded step, in one place: a velocity in, the transition's mean, std and the
log-probability of the recorded next state out.

Every part that recomputes a rollout's step calls `sde_transition`: the trainers' losses (Flow-GRPO's ratio, on-policy
distillation's KL to the teacher), the health guards' KL probe, the importance weights of stale samples and the
planner's step. They differ only in where the velocity comes from (the policy, the reference, a teacher, a fake
transformer) and in the `SDESettings` they pass, which the rollout engine builds once from the configuration and the
schedule (`RolloutEngine.sde`), so that no caller reaches into the scheduler.

With ``a`` = ``noise_level``, ``dt = sigma' - sigma`` and ``v`` the velocity at ``(x, sigma)`` (the math of
`sde_step_from_sigmas`):

    "sde"   sigma_t = a sqrt(sigma / (1 - sigma))          (sigma = 1: sigma_max_fallback in the denominator)
            mean = x (1 + sigma_t^2 dt / (2 sigma)) + v (1 + sigma_t^2 (1 - sigma) / (2 sigma)) dt,
            std = sigma_t sqrt(-dt)
    "cps"   std = sigma' sin(a pi / 2),  mean = (1 - sigma') (x - sigma v) + sqrt(sigma'^2 - std^2) (x + (1 - sigma) v)
    "dance" std = a sqrt(sigma - sigma'),  mean = x + dt (v - a^2 / 2 score)
    log p(x' | x) = mean over elements of [-(x' - mean)^2 / (2 std^2) - log std - log(2 pi) / 2]

computed in float32 (float64 when an input is), with gradient through ``v`` only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

__all__ = ["SDESettings", "sde_transition"]


@dataclass(frozen=True)
class SDESettings:
    """The stochastic step a rollout samples and a replay recomputes.

    ``noise_level`` a >= 0 (0: the ODE step, no log-prob); ``sde_type`` ``"sde"``, ``"cps"`` or ``"dance"``;
    ``sigma_max_fallback``: the schedule's ``sigmas[1]``, used in the ``1 - sigma`` denominator of ``"sde"`` where
    ``sigma == 1``; ``log_prob_reduction``: ``"mean"`` (default) or ``"sum"`` over the non-batch dimensions."""

    noise_level: float
    sde_type: str = "sde"
    sigma_max_fallback: float | None = None
    log_prob_reduction: str = "mean"

    def with_noise(self, noise_level: float | None = None, sde_type: str | None = None) -> SDESettings:
        """The same schedule's settings with another noise level or step type (e.g. the health guards' probe)."""
        return replace(self, noise_level=self.noise_level if noise_level is None else float(noise_level),
                       sde_type=self.sde_type if sde_type is None else sde_type)


def sde_transition(velocity: torch.Tensor, state: torch.Tensor, sigma: float | torch.Tensor,
                   sigma_next: float | torch.Tensor, sde: SDESettings, next_state: torch.Tensor | None = None,
                   generator: torch.Generator | list[torch.Generator] | None = None):
    """The transition ``state -> next_state`` of the module docstring under ``sde``: a
    `FlowMatchSDESchedulerOutput` with ``prev_sample_mean``, ``std`` ``(batch,)`` and ``log_prob`` ``(batch,)`` of
    ``next_state`` (returned unchanged as ``prev_sample``); without ``next_state`` one is drawn with ``generator``.
    ``sigma`` / ``sigma_next``: numbers, 0-d tensors or one value per sample."""
    from .sde_step import sde_step_from_sigmas

    return sde_step_from_sigmas(velocity, state, sigma, sigma_next, prev_sample=next_state,
                                noise_level=sde.noise_level, sde_type=sde.sde_type, generator=generator,
                                log_prob_reduction=sde.log_prob_reduction, sigma_max_fallback=sde.sigma_max_fallback)
