"""Flow-matching SDE sampling with exact transition log-probabilities.

- `FlowMatchSDEScheduler`: drop-in replacement for diffusers' `FlowMatchEulerDiscreteScheduler` (SDE / CPS steps
  inside an SDE window, ODE steps outside).
- `sde_step_from_sigmas` / `sde_step_with_logprob`: one step with its log-probability, from noise levels or from
  a scheduler's timesteps (the training path recomputes log-probs of stored samples with these).
- `sample_sde_window` / `scheduled_sde_window`: the window of stochastic steps of one rollout (random, MixGRPO's
  progressive schedule, or fixed); `rollout_steps`: a rollout's steps with the stretch after the window
  optionally compressed.
- `dpmpp_2m_step` / `FlowODESolver` / `solve_flow_ode` / `compress_sigmas`: deterministic steps with Euler or
  DPM-Solver++ 2M, and coarser schedules over the same noise range (MixGRPO-Flash).

The losses built on these steps (the clipped ratio, GRPO-Guard's ratio, the KL estimators) are the trainers':
``flowgrpo.trainer.algorithms.flow_grpo_loss``.
"""

from .dpm_solver import ODE_SOLVERS, FlowODESolver, compress_sigmas, dpmpp_2m_step, euler_step, solve_flow_ode
from .scheduling_flow_match_sde import FlowMatchSDEScheduler
from .sde_step import FlowMatchSDESchedulerOutput, sde_step_from_sigmas, sde_step_with_logprob
from .sde_window import (
    SDE_WINDOW_STRATEGIES,
    RolloutStep,
    progressive_window_start,
    rollout_steps,
    sample_sde_window,
    scheduled_sde_window,
    valid_window_starts,
)

__all__ = [
    "ODE_SOLVERS",
    "SDE_WINDOW_STRATEGIES",
    "FlowMatchSDEScheduler",
    "FlowMatchSDESchedulerOutput",
    "FlowODESolver",
    "RolloutStep",
    "compress_sigmas",
    "dpmpp_2m_step",
    "euler_step",
    "progressive_window_start",
    "rollout_steps",
    "sample_sde_window",
    "scheduled_sde_window",
    "sde_step_from_sigmas",
    "sde_step_with_logprob",
    "solve_flow_ode",
    "valid_window_starts",
]
