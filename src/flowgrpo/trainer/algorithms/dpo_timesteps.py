r"""The noise levels of Diffusion-DPO's flow-matching loss, drawn as the references draw them.

Each (t, eps) draw gives a pair one noise level t, shared by its preferred and rejected sample.

* ``"logit_normal"`` (flow_grpo ``scripts/train_sd3_dpo.py``, with diffusers'
  ``compute_density_for_timestep_sampling("logit_normal", logit_mean=0, logit_std=1)``): ``z ~ N(0, 1)``,
  ``u = sigmoid(z)``, index ``i = floor(N u)`` into the scheduler's ``N`` training levels (``N`` =
  ``num_train_timesteps``, 1000), and t is the level there::

      t = s r / (1 + (s - 1) r),    r = (N - i) / N,    s = the scheduler's shift (SD3.5-M: 3.0)

  in float32, as ``FlowMatchEulerDiscreteScheduler`` builds ``sigmas`` at construction (its level ``i`` is the
  shifted ``(N - i) / N``); the transformer's timestep is ``N t``. Since the logit-normal is symmetric, r is
  logit-normal too, rounded up to a multiple of 1 / N, so t is a shifted logit-normal (median ``s / (1 + s)``, 0.75
  at s = 3). A scheduler with dynamic shifting (FLUX) builds its training levels unshifted: s = 1
  (`scheduler_training_shift`).
* ``"uniform"``: ``u ~ U(0, 1)``, ``t = s u / (1 + (s - 1) u)`` with ``s`` the configuration's ``time_shift``.

Both draw from the given generator only, ``count`` values in one call, so a seeded draw is reproducible.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["DPO_TIMESTEP_DISTRIBUTIONS", "logit_normal_sigmas", "sample_dpo_sigmas", "scheduler_training_shift",
           "training_sigmas", "uniform_sigmas"]

DPO_TIMESTEP_DISTRIBUTIONS = ("logit_normal", "uniform")


def _check(count: int, shift: float) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count={count!r} must be an integer >= 0 (noise levels to draw).")
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift={shift!r} must be a finite number > 0 (SD3.5-M's scheduler: 3.0; 1.0: no shift).")


def scheduler_training_shift(config: Any) -> float:
    """The shift of a flow-matching scheduler's training levels, from its configuration: ``shift``, or 1 with
    dynamic shifting (FLUX), whose ``FlowMatchEulerDiscreteScheduler`` builds its training ``sigmas`` unshifted."""
    if config.get("use_dynamic_shifting", False):
        return 1.0
    return float(config.get("shift", 1.0))


def training_sigmas(shift: float, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The ``N`` training levels of a flow-matching scheduler of that shift, level ``i`` the shifted ``(N - i) / N``,
    in float32 exactly as ``FlowMatchEulerDiscreteScheduler(num_train_timesteps=N, shift=shift).sigmas``."""
    _check(0, shift)
    if isinstance(num_train_timesteps, bool) or not isinstance(num_train_timesteps, int) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps={num_train_timesteps!r} must be an integer >= 1.")
    steps = torch.linspace(1, num_train_timesteps, num_train_timesteps, dtype=torch.float32).flip(0)
    sigmas = steps / num_train_timesteps
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def logit_normal_sigmas(count: int, shift: float, generator: torch.Generator | None = None,
                        num_train_timesteps: int = 1000) -> torch.Tensor:
    """``count`` logit-normal(0, 1) noise levels through the scheduler's ``shift`` (see the module docstring);
    float32, shape ``(count,)``."""
    _check(count, shift)
    z = torch.normal(0.0, 1.0, size=(count,), generator=generator)
    index = (torch.sigmoid(z) * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)
    return training_sigmas(shift, num_train_timesteps)[index]


def uniform_sigmas(count: int, shift: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """``count`` levels ``t = s u / (1 + (s - 1) u)``, ``u ~ U(0, 1)``; float32, shape ``(count,)``."""
    _check(count, shift)
    u = torch.rand(count, generator=generator, dtype=torch.float32)
    return shift * u / (1 + (shift - 1) * u)


def sample_dpo_sigmas(distribution: str, count: int, shift: float, generator: torch.Generator | None = None,
                      num_train_timesteps: int = 1000) -> torch.Tensor:
    """``count`` noise levels from ``distribution`` (``"logit_normal"``: ``shift`` is the scheduler's;
    ``"uniform"``: the configuration's ``time_shift``)."""
    if distribution == "logit_normal":
        return logit_normal_sigmas(count, shift, generator, num_train_timesteps)
    if distribution == "uniform":
        return uniform_sigmas(count, shift, generator)
    raise ValueError(f"dpo_timestep_distribution={distribution!r} is not valid; choose one of "
                     f"{', '.join(map(repr, DPO_TIMESTEP_DISTRIBUTIONS))}.")
