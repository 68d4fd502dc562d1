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
- `sa_solver_sample` / `sa_solver_sigmas` / `sa_predictor_step` / `sa_corrector_step`: SA-Solver, the stochastic
  predictor-corrector of AWM's official rollouts (tau on the steps inside a noise range; `sde_noise_level_for_tau`
  relates its tau to this project's ``noise_level``).
- `gaussian_kl` / `kl_estimate`: KL between two transitions with the same std, and its estimators.
- `grpo_guard_log_ratio`: GRPO-Guard's normalised log-likelihood ratio.
"""

from .dpm_solver import ODE_SOLVERS, FlowODESolver, compress_sigmas, dpmpp_2m_step, euler_step, solve_flow_ode
from .kl import KL_ESTIMATORS, gaussian_kl, kl_estimate
from .policy_ratio import RATIO_NORMALIZATIONS, grpo_guard_log_ratio
from .sa_solver import (
    SASolverOutput,
    sa_corrector_step,
    sa_predictor_step,
    sa_solver_sample,
    sa_solver_sigmas,
    sa_solver_tau,
    sde_noise_level_for_tau,
    tau_for_sde_noise_level,
)
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
    "KL_ESTIMATORS",
    "ODE_SOLVERS",
    "RATIO_NORMALIZATIONS",
    "SDE_WINDOW_STRATEGIES",
    "FlowMatchSDEScheduler",
    "FlowMatchSDESchedulerOutput",
    "FlowODESolver",
    "RolloutStep",
    "SASolverOutput",
    "compress_sigmas",
    "dpmpp_2m_step",
    "euler_step",
    "gaussian_kl",
    "grpo_guard_log_ratio",
    "kl_estimate",
    "progressive_window_start",
    "rollout_steps",
    "sa_corrector_step",
    "sa_predictor_step",
    "sa_solver_sample",
    "sa_solver_sigmas",
    "sa_solver_tau",
    "sample_sde_window",
    "scheduled_sde_window",
    "sde_step_from_sigmas",
    "sde_noise_level_for_tau",
    "sde_step_with_logprob",
    "solve_flow_ode",
    "tau_for_sde_noise_level",
    "valid_window_starts",
]
