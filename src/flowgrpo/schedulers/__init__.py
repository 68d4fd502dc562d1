"""Flow-matching SDE sampling with exact transition log-probabilities.

- `FlowMatchSDEScheduler`: drop-in replacement for diffusers' `FlowMatchEulerDiscreteScheduler` (SDE / CPS steps
  inside an SDE window, ODE steps outside).
- `sde_step_from_sigmas` / `sde_step_with_logprob`: one step with its log-probability, from noise levels or from
  a scheduler's timesteps (the training path recomputes log-probs of stored samples with these).
- `sde_transition` / `SDESettings`: the transition of one recorded step (velocity -> mean, std, log-prob of the
  recorded next state), the one function every replay calls (trainers, health guards, importance weights, planner).
- `flow_matching`: the forward process x_t = (1 - sigma) x0 + sigma eps and the flow-matching error.
- `sample_sde_window` / `scheduled_sde_window`: the window of stochastic steps of one rollout (random, MixGRPO's
  progressive schedule, or fixed); `rollout_steps`: a rollout's steps with the stretch after the window
  optionally compressed.
- `dpmpp_2m_step` / `FlowODESolver` / `solve_flow_ode` / `compress_sigmas`: deterministic steps with Euler or
  DPM-Solver++ 2M, and coarser schedules over the same noise range (MixGRPO-Flash).
- `sa_solver_sample` / `sa_solver_sigmas` / `sa_predictor_step` / `sa_corrector_step`: SA-Solver, the stochastic
  predictor-corrector of AWM's official rollouts (tau on the steps inside a noise range; `sde_noise_level_for_tau`
  relates its tau to this project's ``noise_level``).

The losses built on these steps (the clipped ratio, GRPO-Guard's ratio, the KL estimators) are the trainers':
``flowgrpo.trainer.algorithms.flow_grpo_loss``.
"""

# Imported on first use: the SDE scheduler and step need diffusers, the solvers torch alone, and the trainer's
# configurations import some constants of this package without loading diffusers.
_LAZY = {
    "FlowMatchSDEScheduler": "scheduling_flow_match_sde",
    "FlowMatchSDESchedulerOutput": "sde_step",
    "FlowODESolver": "dpm_solver",
    "ODE_SOLVERS": "dpm_solver",
    "RolloutStep": "sde_window",
    "SASolverOutput": "sa_solver",
    "SDESettings": "transition",
    "SDE_WINDOW_STRATEGIES": "sde_window",
    "compress_sigmas": "dpm_solver",
    "dpmpp_2m_step": "dpm_solver",
    "euler_step": "dpm_solver",
    "progressive_window_start": "sde_window",
    "rollout_steps": "sde_window",
    "sa_corrector_step": "sa_solver",
    "sa_predictor_step": "sa_solver",
    "sa_solver_sample": "sa_solver",
    "sa_solver_sigmas": "sa_solver",
    "sa_solver_tau": "sa_solver",
    "sample_sde_window": "sde_window",
    "scheduled_sde_window": "sde_window",
    "sde_noise_level_for_tau": "sa_solver",
    "sde_step_from_sigmas": "sde_step",
    "sde_step_with_logprob": "sde_step",
    "sde_transition": "transition",
    "solve_flow_ode": "dpm_solver",
    "tau_for_sde_noise_level": "sa_solver",
    "valid_window_starts": "sde_window",
}

__all__ = [
    "ODE_SOLVERS",
    "SDE_WINDOW_STRATEGIES",
    "FlowMatchSDEScheduler",
    "FlowMatchSDESchedulerOutput",
    "FlowODESolver",
    "RolloutStep",
    "SASolverOutput",
    "SDESettings",
    "compress_sigmas",
    "dpmpp_2m_step",
    "euler_step",
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
    "sde_transition",
    "solve_flow_ode",
    "tau_for_sde_noise_level",
    "valid_window_starts",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'flowgrpo.schedulers' has no attribute {name!r}")
