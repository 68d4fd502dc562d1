"""Flow-matching SDE sampling with exact transition log-probabilities.

- `FlowMatchSDEScheduler`: drop-in replacement for diffusers' `FlowMatchEulerDiscreteScheduler` (SDE / CPS steps
  inside an SDE window, ODE steps outside).
- `sde_step_from_sigmas` / `sde_step_with_logprob`: one step with its log-probability, from noise levels or from
  a scheduler's timesteps (the training path recomputes log-probs of stored samples with these).
- `sample_sde_window`: the window of stochastic steps of one rollout.
- `gaussian_kl`: KL between two transitions with the same std.
"""

from .kl import gaussian_kl
from .scheduling_flow_match_sde import FlowMatchSDEScheduler
from .sde_step import FlowMatchSDESchedulerOutput, sde_step_from_sigmas, sde_step_with_logprob
from .sde_window import sample_sde_window

__all__ = [
    "FlowMatchSDEScheduler",
    "FlowMatchSDESchedulerOutput",
    "gaussian_kl",
    "sample_sde_window",
    "sde_step_from_sigmas",
    "sde_step_with_logprob",
]
