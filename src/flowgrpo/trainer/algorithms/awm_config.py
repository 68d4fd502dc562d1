"""AWMConfig: the settings of Advantage Weighted Matching, as a `transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares are those of `OnlineRLConfig`; this class adds AWM's own (official
``scripts/train_sd3_awm.py``, configs ``config/dgx_awm.py``): the sampler of the training rollouts
(``rollout_sampler``: the official stochastic SA-Solver with its settings, or a deterministic solver) and of
evaluation (``sampler``), the CFG scale of the trained velocities (``train_guidance_scale``), the noise levels trained
on each clean rollout (``train_timesteps``, ``time_type``, ``time_shift``, ``timestep_fraction``), the
log-likelihood surrogate's ``weighting``, the clipped ratio (``loss_type``, ``clip_range``, ``advantage_max``), the
velocity KL to the reference (``beta``, ``kl_weight``) and the EMA adapter (``ema_beta``, ``kl_ema_weight``,
``kl_ema_decay``, ``kl_ema_decay_type``, ``off_policy``). Defaults are the paper's GenEval settings on SD3.5-M
(``geneval_sd3_no_cfg_1node``): CFG-free, 14 rollout steps by SA-Solver (tau 0.4 on the steps that end at a noise
level in [0.3, 0.9], predictor and corrector of order 2), the conditional velocity trained, 6 trained levels by
``discrete_wo_init`` in the first 90% of the steps, ``ghuber`` weighting with power 0.25, ``exp_first``, clip range 1,
advantages scaled to 1, beta 0.001 (``Uniform``), EMA-adapter KL 1 (``Uniform``, decay min(0.3, 0.001 k)),
on-policy, global std, lr 3e-4, evaluation with Euler of the raw weights and, with ``use_ema``, of their EMA
(``eval_raw_weights``). The paper's 14 rollout and 40 evaluation steps are SD3.5-M's (``recipes/awm_geneval.yaml``);
unset, the steps are the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...schedulers.sa_solver import SA_SOLVER_NOISE_RANGE, SA_SOLVER_TAU
from ..algorithm_spec import (
    AlgorithmFacts,
    AlgorithmSpec,
    PlannedStep,
    PolicyCopy,
    RolloutRecord,
    TransitionProbe,
    WorkerNeeds,
)
from ..config_docs import document_config
from ..online_config import OnlineRLConfig, check_choice
from .train_guidance import TrainGuidanceArguments

AWM_SAMPLERS = ("dpmpp_2m", "euler")
#: the samplers of AWM's training rollouts: the official stochastic SA-Solver or a deterministic solver
AWM_ROLLOUT_SAMPLERS = ("sa_solver", "dpmpp_2m", "euler")
TIME_TYPES = ("discrete", "discrete_with_init", "discrete_wo_init", "uniform", "logit_normal")
WEIGHTINGS = ("Uniform", "t", "t**2", "huber", "ghuber")
LOSS_TYPES = ("sum_first", "exp_first")
KL_WEIGHTS = ("Uniform", "ELBO")
KL_EMA_DECAY_TYPES = ("linear", "constant")

__all__ = ["AWM_ROLLOUT_SAMPLERS", "AWM_SAMPLERS", "KL_EMA_DECAY_TYPES", "KL_WEIGHTS", "LOSS_TYPES", "TIME_TYPES",
           "WEIGHTINGS", "AWMConfig", "SPEC", "describe_awm"]


@document_config
@dataclass
class AWMConfig(TrainGuidanceArguments, OnlineRLConfig):
    r"""Configuration for [`AWMTrainer`]: the shared settings of [`OnlineRLConfig`] plus AWM's rollouts, trained noise
    levels, weighted flow-matching surrogate, clipped ratio and KL terms (the math: ``algorithms/awm_loss.py``)."""

    # ---- rollouts ------------------------------------------------------------------------------------
    sampler: str = field(
        default="euler",
        metadata={"help": "Deterministic solver of evaluation, and of the rollouts when rollout_sampler is null: "
                          "'euler' (AWM's official evaluation: Euler, 40 steps) or 'dpmpp_2m'."},
    )
    rollout_sampler: str | None = field(
        default="sa_solver",
        metadata={"help": "Sampler of the training rollouts. 'sa_solver' (AWM's official, stochastic): SA-Solver's "
                          "predictor-corrector (orders sa_solver_predictor_order / sa_solver_corrector_order, one "
                          "model call a step) on the scheduler's levels with AWM's own first (1 - 1e-3) and "
                          "second-to-last (half the third-to-last) levels, noise of stochasticity sa_solver_tau on "
                          "the steps that end inside sa_solver_noise_range (flowgrpo.schedulers.sa_solver). "
                          "'dpmpp_2m' or 'euler': deterministic. null: the evaluation sampler. AWM keeps only each "
                          "rollout's clean sample, so the loss needs no trajectory from any of them."},
    )
    sa_solver_tau: float = field(
        default=SA_SOLVER_TAU,
        metadata={"help": "SA-Solver's stochasticity tau inside sa_solver_noise_range (AWM: 0.4, its "
                          "sample.noise_level). The same SDE as this project's 'sde' step at noise_level sqrt(2) tau "
                          "(0.4 -> 0.566)."},
    )
    sa_solver_noise_range: list[float] = field(
        default_factory=lambda: list(SA_SOLVER_NOISE_RANGE),
        metadata={"help": "[lo, hi]: the SA-Solver steps that end at a noise level lo <= sigma <= hi are stochastic, "
                          "the others deterministic (AWM: [0.3, 0.9])."},
    )
    sa_solver_predictor_order: int = field(default=2, metadata={"help": "SA-Solver's predictor order, 1 or 2 (AWM: 2)."})
    sa_solver_corrector_order: int = field(
        default=2, metadata={"help": "SA-Solver's corrector order: 0 (no corrector), 1 or 2 (AWM: 2)."},
    )
    num_inference_steps: int | None = field(
        default=None, metadata={"help": "Rollout steps (AWM on SD3.5-M: 14). Unset: the model card's steps."})
    eval_num_inference_steps: int | None = field(
        default=None, metadata={"help": "Evaluation steps (AWM on SD3.5-M: 40). Unset: the model card's steps."})
    guidance_scale: float | None = field(
        default=None,
        metadata={"help": "CFG scale of the rollouts (AWM: 1.0, CFG-free); the trained velocities use "
                          "train_guidance_scale. Unset: CFG-free (the family's no-guidance value; a guidance "
                          "embedding keeps the model's value)."},
    )
    scale_rewards: str = field(
        default="batch",
        metadata={"help": "Advantage std: 'batch' (AWM's global std with per-prompt means), 'group' or 'none'."},
    )

    # ---- the trained noise levels ----------------------------------------------------------------------
    train_timesteps: int = field(
        default=6,
        metadata={"help": "Noise levels t trained per clean rollout, each with fresh noise, in one batched forward "
                          "(AWM: 6)."},
    )
    time_type: str = field(
        default="discrete_wo_init",
        metadata={"help": "How the levels are drawn (shared by the micro-batch, as in the official code): "
                          "'discrete_wo_init' (one rollout level uniformly inside each of train_timesteps bins of "
                          "the steps 1 .. int(steps x timestep_fraction); AWM's default), 'discrete' (bins from step "
                          "0), 'discrete_with_init' (step 0 plus train_timesteps - 1 bins from step 1), 'uniform' "
                          "(stratified in [0.2, 1] per sample, shifted by time_shift) or 'logit_normal' (stratified "
                          "logit-normal, shifted by time_shift, at least 0.01)."},
    )
    time_shift: float = field(
        default=3.0, metadata={"help": "Shift s of the continuous time types: t <- s t / (1 + (s - 1) t) (AWM: 3)."},
    )
    timestep_fraction: float = field(
        default=0.9,
        metadata={"help": "The discrete time types draw from the first int(num_inference_steps x timestep_fraction) "
                          "rollout steps (AWM: 0.9)."},
    )

    # ---- objective -----------------------------------------------------------------------------------
    weighting: str = field(
        default="ghuber",
        metadata={"help": "The log-likelihood surrogate from e = mean((v_theta - (eps - x0))^2): 'Uniform' (-e), 't' "
                          "(-e t), 't**2' (-e t^2), 'huber' (-(sqrt(e + 1e-10) - 1e-5) t) or 'ghuber' "
                          "(-((e + 1e-10)^p - 1e-10^p) t / p, p = ghuber_power; AWM's default)."},
    )
    ghuber_power: float = field(default=0.25, metadata={"help": "p of the 'ghuber' weighting (AWM: 0.25)."})
    loss_type: str = field(
        default="exp_first",
        metadata={"help": "'exp_first': a ratio exp(logp - logp_old) per (level, sample), each clipped (AWM's "
                          "default); 'sum_first': one ratio per sample from the mean of its levels' log-probs."},
    )
    clip_range: float = field(default=1.0, metadata={"help": "PPO clip range of the ratio (AWM: 1.0)."})
    advantage_max: float | None = field(
        default=1.0,
        metadata={"help": "Advantages, clipped to +-adv_clip_max, are rescaled to +-advantage_max (A <- A / "
                          "adv_clip_max * advantage_max; AWM: 1). null keeps them as they are."},
    )
    beta: float = field(
        default=0.001,
        metadata={"help": "Weight of the velocity KL to the reference (LoRA disabled, or a frozen copy); AWM: 0.001 "
                          "(GenEval), 0.003 (OCR). 0 skips the reference pass (and, as in the official code, the "
                          "EMA-adapter KL)."},
    )
    kl_weight: str = field(
        default="Uniform",
        metadata={"help": "KL = mean((v_theta - v_ref)^2) ('Uniform', AWM's default) or that divided by 2 std^2 "
                          "with std = 0.7 sqrt(t / (1 - min(t, 0.99))) ('ELBO')."},
    )

    # ---- the EMA adapter -------------------------------------------------------------------------------
    ema_beta: float = field(
        default=1.0,
        metadata={"help": "Weight of the KL to the EMA adapter (a second copy of the policy; AWM: 1). 0 keeps no "
                          "EMA adapter unless off_policy."},
    )
    kl_ema_weight: str = field(default="Uniform", metadata={"help": "'Uniform' or 'ELBO', as kl_weight."})
    kl_ema_decay: float = field(
        default=0.3,
        metadata={"help": "After optimizer step k the EMA adapter moves: theta_ema <- d theta_ema + (1 - d) theta, "
                          "with d = min(kl_ema_decay, 0.001 k) ('linear', AWM's default) or kl_ema_decay "
                          "('constant'). AWM: 0.3."},
    )
    kl_ema_decay_type: str = field(default="linear", metadata={"help": "'linear' or 'constant' (see kl_ema_decay)."})
    off_policy: bool = field(
        default=False,
        metadata={"help": "Sample the rollouts, and compute the old log-probs, with the EMA adapter (AWM's off-policy "
                          "mode); false samples with the current policy (AWM's default)."},
    )

    # ---- evaluation ------------------------------------------------------------------------------------
    eval_raw_weights: bool = field(
        default=True,
        metadata={"help": "With use_ema, evaluate the raw weights too, as the official code evaluates both: the EMA's "
                          "metrics keep the eval_ keys, the raw weights' are logged as eval_raw_ (eval_raw_reward, "
                          "eval_raw_rewards/<name>/mean, ...). No effect without use_ema (the raw weights are the "
                          "ones evaluated)."},
    )

    _trainer_name = "AWMTrainer"
    _cfg_free_rollouts = "AWMConfig: CFG-free rollouts"

    def _check_algorithm(self) -> None:
        check_choice("sampler", self.sampler, AWM_SAMPLERS)
        if self.rollout_sampler is not None:
            check_choice("rollout_sampler", self.rollout_sampler, AWM_ROLLOUT_SAMPLERS)
        self._check_sa_solver()
        self._check_train_guidance()
        check_choice("time_type", self.time_type, TIME_TYPES)
        check_choice("weighting", self.weighting, WEIGHTINGS)
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("kl_weight", self.kl_weight, KL_WEIGHTS)
        check_choice("kl_ema_weight", self.kl_ema_weight, KL_WEIGHTS)
        check_choice("kl_ema_decay_type", self.kl_ema_decay_type, KL_EMA_DECAY_TYPES)
        count = self.train_timesteps
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"train_timesteps={count!r} must be an integer >= 1 (AWM: 6).")
        fraction = self.timestep_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"timestep_fraction={fraction!r} must be in (0, 1] (AWM: 0.9).")
        if self.time_type.startswith("discrete") and self.num_inference_steps is not None:
            last = int(self.num_inference_steps * fraction)
            low = 0 if self.time_type == "discrete" else 1
            if last < low:
                raise ValueError(f"time_type={self.time_type!r} draws levels from rollout steps {low} .. {last} "
                                 f"(int(num_inference_steps={self.num_inference_steps} x timestep_fraction="
                                 f"{fraction})), an empty range; raise num_inference_steps or timestep_fraction.")
        if self.clip_range <= 0:
            raise ValueError(f"clip_range={self.clip_range} must be > 0 (AWM: 1.0).")
        if self.advantage_max is not None and self.advantage_max <= 0:
            raise ValueError(f"advantage_max={self.advantage_max} must be > 0, or null to keep the advantages.")
        if self.ghuber_power <= 0:
            raise ValueError(f"ghuber_power={self.ghuber_power} must be > 0 (AWM: 0.25).")
        if self.time_shift <= 0:
            raise ValueError(f"time_shift={self.time_shift} must be > 0 (AWM: 3.0).")
        if self.ema_beta < 0:
            raise ValueError(f"ema_beta={self.ema_beta} must be >= 0.")
        if not 0 <= self.kl_ema_decay < 1:
            raise ValueError(f"kl_ema_decay={self.kl_ema_decay} must be in [0, 1) (AWM: 0.3).")
        if not isinstance(self.off_policy, bool):
            raise ValueError(f"off_policy={self.off_policy!r} must be true or false.")
        if not isinstance(self.eval_raw_weights, bool):
            raise ValueError(f"eval_raw_weights={self.eval_raw_weights!r} must be true or false.")

    def _check_sa_solver(self) -> None:
        tau = self.sa_solver_tau
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau < 0:
            raise ValueError(f"sa_solver_tau={tau!r} must be a finite number >= 0 (AWM: 0.4; 0: deterministic).")
        bounds = self.sa_solver_noise_range
        if (isinstance(bounds, (str, bytes)) or not hasattr(bounds, "__len__") or len(bounds) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in bounds)
                or not 0 <= bounds[0] <= bounds[1] <= 1):
            raise ValueError(f"sa_solver_noise_range={bounds!r} must be two noise levels [lo, hi] with "
                             "0 <= lo <= hi <= 1 (AWM: [0.3, 0.9]).")
        self.sa_solver_noise_range = [float(b) for b in bounds]
        order = self.sa_solver_predictor_order
        if isinstance(order, bool) or order not in (1, 2):
            raise ValueError(f"sa_solver_predictor_order={order!r} is not supported; use 1 or 2 (AWM: 2).")
        order = self.sa_solver_corrector_order
        if isinstance(order, bool) or order not in (0, 1, 2):
            raise ValueError(f"sa_solver_corrector_order={order!r} is not supported; use 0 (no corrector), 1 or 2 "
                             "(AWM: 2).")

    @property
    def rollout_solver(self) -> str:
        """The sampler of the training rollouts: ``rollout_sampler``, or ``sampler`` when it is null."""
        return self.sampler if self.rollout_sampler is None else self.rollout_sampler

    @property
    def uses_ema_adapter(self) -> bool:
        """Whether an EMA adapter is kept: it samples (off_policy) or enters the loss (beta > 0 and ema_beta > 0)."""
        return self.off_policy or (self.beta > 0 and self.ema_beta > 0)


# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
def describe_awm(args: AWMConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """AWM's facts: rollouts (SA-Solver or a deterministic solver) that keep x0, by the policy or, off-policy, by the
    EMA adapter; one batched forward of the train_timesteps x B points per micro-batch."""
    ema = args.uses_ema_adapter
    frozen = (("reference",) if args.beta > 0 else ()) + (("old_policy",) if args.beta > 0 and args.ema_beta > 0
                                                          else ())
    return AlgorithmFacts(
        copies=(PolicyCopy("old_policy", "EMA adapter" + (" (samples the rollouts)" if args.off_policy else ""),
                           samples_rollouts=bool(args.off_policy)),) if ema else (),
        reads_reference=args.beta > 0,
        record=RolloutRecord("final_sample", fields=("x0", "t", "noise", "old_log_probs"),
                             loss_reads_log_probs=False),  # old_log_probs: a forward of its own, not the sampler's
        workers=WorkerNeeds(
            sampled_by="old_policy" if args.off_policy else "policy", synced=("old_policy",) if ema else (),
            staleness="a sample k steps old carries the sampling weights' surrogate log-probs, recorded at the "
                      "rollout: the clipped ratio is taken against them (off-policy by design with off_policy).",
            switch_step=None, whole_groups=False, trainer_replay=""),
        probe=TransitionProbe("noised_sample", noise_level=0.7),
        step=PlannedStep("noised_sample", trained_timesteps=1, trained_batch=int(args.train_timesteps),
                         frozen_forwards=frozen, loss="velocity_mse"),
    )


SPEC = AlgorithmSpec(
    name="awm", title="AWM", config="flowgrpo.trainer.algorithms.awm_config:AWMConfig",
    trainer="flowgrpo.trainer.algorithms.awm_trainer:AWMTrainer",
    summary="Advantage Weighted Matching: the clipped ratio of a weighted flow-matching surrogate on clean rollouts",
    describe=describe_awm,
    eval_guidance_rollouts_refusal=None,  # its loss reads only the clean samples, at train_guidance_scale
)
