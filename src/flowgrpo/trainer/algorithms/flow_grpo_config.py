"""FlowGRPOConfig: every knob of Flow-GRPO training, as a `transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares (groups, rollouts, rewards, memory, crash safety, logging) are those of
`OnlineRLConfig`; this class adds Flow-GRPO's own: the stochastic sampler (noise level, SDE or CPS), its windows
and solvers, and the clipped-ratio objective. Defaults follow the published Flow-GRPO recipes for Stable Diffusion
3.5 Medium where they exist (LoRA r=32/alpha=64, lr 3e-4, noise level 0.7, KL weight 0.04, clip range 1e-4,
advantage clip 5); each field's help says where its default comes from. The sampling settings (size, steps, guidance,
text length) are the model's own unless given (the published SD3.5-M ones, 512 px, 10 steps, 40 for evaluation, CFG
4.5, are in ``recipes/ocr.yaml`` and its siblings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..online_config import DTYPES, QUANTIZATIONS, REWARD_AGGREGATIONS, SCALE_REWARDS, OnlineRLConfig, check_choice

SDE_TYPES = ("sde", "cps", "dance")
SDE_WINDOW_STRATEGIES = ("random", "progressive", "fixed")
ODE_SOLVERS = ("euler", "dpmpp_2m")
RATIO_NORMALIZATIONS = ("none", "grpo_guard")
KL_ESTIMATORS = ("analytic", "k1", "k3", "velocity")

__all__ = ["DTYPES", "KL_ESTIMATORS", "ODE_SOLVERS", "QUANTIZATIONS", "RATIO_NORMALIZATIONS", "REWARD_AGGREGATIONS",
           "SCALE_REWARDS", "SDE_TYPES", "SDE_WINDOW_STRATEGIES", "FlowGRPOConfig"]


@dataclass
class FlowGRPOConfig(OnlineRLConfig):
    r"""Configuration for [`FlowGRPOTrainer`]: the shared settings of [`OnlineRLConfig`] (groups and batches,
    rollouts, rewards, memory, crash safety, logging) plus Flow-GRPO's stochastic sampler and clipped objective.
    """

    # ---- the stochastic sampler and its windows -----------------------------------------------------
    noise_level: float = field(
        default=0.7,
        metadata={"help": "SDE noise level a (Flow-GRPO: 0.7). For 'sde' the step std is a*sqrt(sigma/(1-sigma))*"
                          "sqrt(-dt); for 'cps' it is sigma' * sin(a*pi/2). 0 gives deterministic ODE sampling, "
                          "which cannot be trained."},
    )
    sde_type: str = field(
        default="sde",
        metadata={"help": "Stochastic sampler: 'sde' (Flow-GRPO's marginal-preserving reverse SDE), 'cps' "
                          "(coefficients-preserving sampling, suited to few steps) or 'dance' (DanceGRPO's step: "
                          "std = a*sqrt(sigma - sigma'), mean = x + dt*(v - a^2/2*score); recipes use a = 0.3)."},
    )
    sde_window_size: int = field(
        default=0,
        metadata={"help": "Flow-GRPO-Fast / MixGRPO windows: number of consecutive SDE steps per rollout; ODE "
                          "elsewhere, and only the window's steps are stored and trained. 0 = SDE on every step "
                          "but the last (plain Flow-GRPO)."},
    )
    sde_window_range: list[int] | None = field(
        default=None,
        metadata={"help": "Two integers [lo, hi): the window starts lo .. hi - 1 that sde_window_strategy chooses "
                          "from; windows end before the last step. Defaults to [0, min(num_inference_steps // 2, "
                          "num_inference_steps - sde_window_size)] for 'random' and to every window that ends "
                          "before the last step, [0, num_inference_steps - sde_window_size), for 'progressive' "
                          "and 'fixed'."},
    )
    sde_window_strategy: str = field(
        default="random",
        metadata={"help": "Where each rollout's SDE window starts: 'random' (Flow-GRPO-Fast: uniform over "
                          "sde_window_range, drawn per generation from the seed), 'progressive' (MixGRPO: at 0-based "
                          "optimizer step k the start is lo + (k // sde_window_shift_interval) * sde_window_stride, "
                          "then back to lo or staying at the last start, see sde_window_roll_back) or 'fixed' (always "
                          "lo). All three are functions of the step and the seed, so resuming continues them."},
    )
    sde_window_shift_interval: int = field(
        default=25,
        metadata={"help": "Progressive windows: optimizer steps between two moves of the window (MixGRPO: 25)."},
    )
    sde_window_stride: int = field(
        default=1, metadata={"help": "Progressive windows: sampling steps the window moves each time (MixGRPO: 1)."},
    )
    sde_window_roll_back: bool = field(
        default=True,
        metadata={"help": "Progressive windows: after the last valid start go back to the first one (MixGRPO's "
                          "default); false stays at the last start."},
    )
    ode_solver: str = field(
        default="euler",
        metadata={"help": "Solver of the deterministic steps outside the SDE window: 'euler' or 'dpmpp_2m' "
                          "(DPM-Solver++ 2M in lambda = log((1 - sigma) / sigma) on the data prediction "
                          "x0 = x - sigma v; first order on the first step of each deterministic stretch and on "
                          "the final step; MixGRPO-Flash). The window's steps and log-probs do not change."},
    )
    ode_compression_ratio: float = field(
        default=1.0,
        metadata={"help": "In (0, 1]; with ode_solver='dpmpp_2m', the n steps after the window are replaced by "
                          "max(1, int(n * ratio)) solver steps over the same noise range (MixGRPO-Flash: 0.4). "
                          "1.0 keeps every step."},
    )
    same_noise_per_group: bool = field(
        default=False,
        metadata={"help": "Start the G samples of a prompt from the same initial noise (MixGRPO's default); the "
                          "SDE noise inside the window still differs per sample. The noise is a function of the "
                          "seed, the generation and the prompt's dataset index, so a group split over micro-batches "
                          "or processes shares it."},
    )

    timestep_fraction: float = field(
        default=1.0,
        metadata={"help": "In (0, 1]: each sample trains a random int(steps * timestep_fraction) of its recorded SDE "
                          "steps (at least 1), drawn per sample from the seed and the micro-step (DanceGRPO: 0.6 of "
                          "its 16 steps). 1.0 trains every recorded step in order."},
    )

    # ---- the clipped objective -----------------------------------------------------------------------
    epsilon: float = field(
        default=1e-4,
        metadata={"help": "PPO clip range of the likelihood ratio. Flow-GRPO: 1e-4 (tuned for mean-reduced "
                          "log-probs)."},
    )
    ratio_normalization: str = field(
        default="none",
        metadata={"help": "Likelihood ratio of the clipped objective: 'none' (the exact Gaussian ratio) or "
                          "'grpo_guard' (GRPO-Guard: log ratio = mean over the non-batch dims of "
                          "eps * (mu_theta - mu_old), eps = (x' - mu_old) / std, which removes the downward bias of "
                          "the exact ratio and its per-step 1/std scale). 0 on-policy either way."},
    )
    kl_estimator: str = field(
        default="analytic",
        metadata={"help": "KL penalty to the reference (with beta > 0): 'analytic' (mean((mu_theta - mu_ref)^2) / "
                          "(2 std^2) with the transition std), 'k1' (logp_theta - logp_ref of the sampled x'), 'k3' "
                          "(exp(logp_ref - logp_theta) - 1 - (logp_ref - logp_theta), per element) or 'velocity' "
                          "(mean squared difference of the policy's and the reference's velocities). All use the "
                          "log-probs' mean over the non-batch dims."},
    )
    on_policy_tolerance: float = field(
        default=1e-3,
        metadata={"help": "On the first pass over a fresh batch the ratio must be exactly 1; warn when |ratio - 1| "
                          "exceeds this (dtype or batch-composition mismatch, dropout, non-determinism)."},
    )


    _trainer_name = "FlowGRPOTrainer"

    def _check_algorithm(self) -> None:
        check_choice("sde_type", self.sde_type, SDE_TYPES)
        check_choice("sde_window_strategy", self.sde_window_strategy, SDE_WINDOW_STRATEGIES)
        check_choice("ode_solver", self.ode_solver, ODE_SOLVERS)
        check_choice("ratio_normalization", self.ratio_normalization, RATIO_NORMALIZATIONS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for name in ("sde_window_roll_back", "same_noise_per_group"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false.")
        for name in ("sde_window_shift_interval", "sde_window_stride"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1.")
        ratio = self.ode_compression_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"ode_compression_ratio={ratio!r} must be in (0, 1] (1.0 keeps every step; "
                             "MixGRPO-Flash uses 0.4).")
        if ratio < 1 and self.ode_solver != "dpmpp_2m":
            raise ValueError(f"ode_compression_ratio={ratio} replaces the steps after the window by fewer "
                             f"DPM-Solver++ steps; it needs ode_solver='dpmpp_2m' (got ode_solver="
                             f"{self.ode_solver!r}). Set ode_solver: dpmpp_2m, or ode_compression_ratio: 1.0.")
        fraction = self.timestep_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"timestep_fraction={fraction!r} must be in (0, 1] (1.0 trains every recorded step; "
                             "DanceGRPO uses 0.6).")
        if self.noise_level < 0:
            raise ValueError(f"noise_level={self.noise_level} must be >= 0.")
        if self.epsilon <= 0:
            raise ValueError(f"epsilon={self.epsilon} must be > 0.")
        self._check_window()

    def _check_window(self) -> None:
        steps = self.num_inference_steps
        k = self.sde_window_size
        if steps is None and k > 0:  # the model's own step count: checked once the trainer has resolved it
            return
        if k < 0:
            raise ValueError(f"sde_window_size={k} must be >= 0 (0 = SDE on every step but the last).")
        if k == 0:
            if self.sde_window_strategy != "random":
                raise ValueError(f"sde_window_strategy={self.sde_window_strategy!r} moves an SDE window, but "
                                 "sde_window_size=0 makes every step but the last stochastic; set sde_window_size "
                                 "(e.g. 4 for MixGRPO) or use sde_window_strategy='random'.")
            return
        if k > steps - 1:
            raise ValueError(f"sde_window_size={k} must be at most num_inference_steps - 1 = {steps - 1} (the last "
                             "step is nearly deterministic and never trained); lower the window or raise the step "
                             "count.")
        if self.sde_window_range is None:
            if self.sde_window_strategy == "random":
                self.sde_window_range = [0, max(1, min(steps // 2, steps - k))]
            else:
                self.sde_window_range = [0, steps - k]
        if len(self.sde_window_range) != 2:
            raise ValueError(f"sde_window_range={self.sde_window_range} must be two integers [lo, hi).")
        lo, hi = (int(v) for v in self.sde_window_range)
        if lo < 0 or hi <= lo or hi + k > steps:
            raise ValueError(
                f"sde_window_range={[lo, hi]} with sde_window_size={k} does not fit num_inference_steps={steps}: "
                f"the latest window [{hi - 1}, {hi - 1 + k}) must end before the last step {steps - 1}. Use "
                f"0 <= lo < hi <= {steps - k}."
            )
        self.sde_window_range = [lo, hi]
