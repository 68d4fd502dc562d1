"""RewardBackpropConfig: the settings of the reward-gradient trainer (DRaFT, DRaFT-LV, ReFL, AlignProp), as a
`transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares are those of `OnlineRLConfig`; this class adds the method
(``reward_backprop_mode``), the sampler steps trained with gradient (``backprop_steps``, ``lv_draws``, ReFL's and
AlignProp's draws), the loss's scale, ReFL's pretraining loss and the optional KL to the base (``kl_beta``). The math:
``flowgrpo.trainer.algorithms.reward_backprop_loss``. Defaults: DRaFT-K with K = 1 at the rewards' own scale; each
mode's published constants (ReFL's target 2 and scale 1e-3, DRaFT-LV's 2 draws) are its defaults.

There are no groups and no advantages: the rollout is the loss, each image's reward backpropagated into the sampler's
last steps, so only rewards that give a gradient (``differentiable = True``, docs/rewards.md) can be trained on; the
others are refused by name when the trainer is built (a weight-0 reward is scored on the PIL path and logged).
Flow-GRPO's sampler and objective settings are not fields of this class (`REFUSED_SETTINGS` says why for each).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..algorithm_spec import AlgorithmFacts, AlgorithmSpec, PlannedStep, RolloutRecord, TransitionProbe, WorkerNeeds
from ..config_docs import document_config
from ..online_config import OnlineRLConfig, check_choice
from ..timestep_passes import parse_timesteps_per_pass
from .reward_backprop_loss import (
    ALIGNPROP_TRUNCATIONS,
    REFL_LOSSES,
    REWARD_BACKPROP_MODES,
    default_refl_step_range,
)

__all__ = ["ALIGNPROP_TRUNCATIONS", "REFL_LOSSES", "REFUSED_SETTINGS", "REWARD_BACKPROP_MODES", "SPEC",
           "RewardBackpropConfig", "describe_reward_backprop"]

#: the settings of other trainers' configurations that the reward-gradient trainer does not use, and why
REFUSED_SETTINGS: dict[str, str] = {
    "noise_level": "it samples with the deterministic Euler steps it backpropagates through",
    "sde_type": "it samples with the deterministic Euler steps it backpropagates through",
    "sde_window_size": "it has no SDE window: backprop_steps (or the mode's draw) sets the steps trained",
    "sde_window_range": "it has no SDE window",
    "sde_window_strategy": "it has no SDE window",
    "ode_solver": "its steps are Euler steps, with and without gradient",
    "epsilon": "it has no likelihood ratio to clip: the reward's gradient is the loss's",
    "kl_estimator": "its KL to the base is kl_beta * mean((v_theta - v_base)^2) at the states of the steps trained",
    "timestep_fraction": "the steps trained are set by backprop_steps and the mode",
    "sampler": "its steps are Euler steps, with and without gradient",
}


@document_config
@dataclass
class RewardBackpropConfig(OnlineRLConfig):
    r"""Configuration for [`RewardBackpropTrainer`]: the shared settings of [`OnlineRLConfig`] plus the reward-gradient
    method, the steps trained with gradient, ReFL's loss and pretraining loss and the KL to the base (the math:
    ``flowgrpo.trainer.algorithms.reward_backprop_loss``)."""

    # ---- the method ------------------------------------------------------------------------------------
    reward_backprop_mode: str = field(
        default="draft",
        metadata={"help": "'draft' (DRaFT-K: the last backprop_steps sampling steps with gradient, the reward of the "
                          "decoded sample backpropagated through them), 'draft_lv' (DRaFT-LV: the last step only, with "
                          "lv_draws re-noisings of the final sample), 'refl' (ReFL: one step with gradient at a step "
                          "drawn from refl_step_range, its x0-prediction decoded and scored) or 'alignprop' (DRaFT-K "
                          "with K drawn for every rollout, alignprop_truncation)."},
    )
    backprop_steps: int = field(
        default=1,
        metadata={"help": "K, the sampling steps trained with gradient at the end of the trajectory (draft: 1 .. "
                          "num_inference_steps, K = num_inference_steps is full DRaFT; the paper's most efficient is "
                          "K = 1). alignprop: the largest K of the uniform draw, or the mean K of the gaussian one. "
                          "draft_lv and refl train one step: leave it at 1."},
    )
    lv_draws: int = field(
        default=2,
        metadata={"help": "DRaFT-LV: re-noisings of each final sample at the last noise level, each denoised by the "
                          "last step with gradient and scored; their reward gradients are averaged (DRaFT: 2)."},
    )
    backprop_checkpointing: bool = field(
        default=True,
        metadata={"help": "Gradient checkpointing through the sampler's steps: each step trained with gradient keeps "
                          "only its input and is recomputed in the backward pass (and the decoder, slice by slice of "
                          "vae_decode_batch_size), so memory grows by a latent per step instead of a forward's "
                          "activations. Combine with activation_checkpointing for the transformer's own blocks."},
    )
    reward_loss_scale: float | None = field(
        default=None,
        metadata={"help": "The loss is -reward_loss_scale x reward (refl: reward_loss_scale x relu(refl_target - "
                          "reward)). Unset: 1e-3 for refl (ReFL's grad_scale), 1 otherwise."},
    )

    # ---- ReFL ---------------------------------------------------------------------------------------------
    refl_step_range: list[int] | None = field(
        default=None,
        metadata={"help": "ReFL: [lo, hi], the step with gradient drawn uniformly from lo .. hi inclusive once per "
                          "micro-batch; the steps before it are sampled without gradient. Unset: [floor(0.75 T), T - "
                          "1] for T = num_inference_steps, the official [30, 39] of 40 steps."},
    )
    refl_loss: str = field(
        default="relu",
        metadata={"help": "ReFL: 'relu' (relu(refl_target - reward), ReFL's: an image above the target gives no "
                          "gradient) or 'linear' (-reward)."},
    )
    refl_target: float = field(
        default=2.0, metadata={"help": "ReFL: the reward above which relu stops pushing (ReFL's 2, for ImageReward)."},
    )
    refl_pretrain_weight: float = field(
        default=0.0,
        metadata={"help": "ReFL: > 0 adds the pretraining (denoising) loss on the images of the train dataset's "
                          "refl_pretrain_column with this weight, at noise levels drawn uniformly (the official SDXL "
                          "script's apply_pre_loss, on the same rows as the reward loss). 0: reward loss only (the "
                          "official SD 1.4 script)."},
    )
    refl_pretrain_column: str = field(
        default="pretrain_image",
        metadata={"help": "ReFL: the train dataset's column of images for the pretraining loss (paths, PIL images or "
                          "datasets.Image values), each a real image of its row's prompt."},
    )

    # ---- AlignProp ----------------------------------------------------------------------------------------
    alignprop_truncation: str = field(
        default="uniform",
        metadata={"help": "AlignProp: how K is drawn for each rollout: 'uniform' (1 .. backprop_steps; the official "
                          "uniform strategy of 50 steps is backprop_steps 20) or 'gaussian' (K = T - int(z), z ~ N(T - "
                          "backprop_steps, alignprop_truncation_std), drawn again until 1 <= K <= T - 1; the official "
                          "default of 50 steps is backprop_steps 8, std 5)."},
    )
    alignprop_truncation_std: float = field(
        default=5.0, metadata={"help": "AlignProp: the std, in steps, of the gaussian draw (official: 5)."},
    )

    # ---- objective ----------------------------------------------------------------------------------------
    kl_beta: float = field(
        default=0.0,
        metadata={"help": "Weight of the KL to the base (LoRA disabled, or a frozen copy for full fine-tuning): "
                          "kl_beta x mean((v_theta - v_base)^2) at the states of the steps trained with gradient, "
                          "logged as kl. 0 (DRaFT, ReFL, AlignProp) skips the base's forward."},
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "The shared KL weight, set from kl_beta (the planner and the health guards read it); give "
                          "kl_beta instead."},
    )
    num_generations: int = field(
        default=1,
        metadata={"help": "Images per prompt in a batch. The reward-gradient methods have no groups: 1 (every image "
                          "its own prompt) unless you want several samples of each prompt."},
    )

    _trainer_name = "RewardBackpropTrainer"
    _min_group_size: ClassVar[int] = 1

    def _check_algorithm(self) -> None:
        check_choice("reward_backprop_mode", self.reward_backprop_mode, REWARD_BACKPROP_MODES)
        check_choice("refl_loss", self.refl_loss, REFL_LOSSES)
        check_choice("alignprop_truncation", self.alignprop_truncation, ALIGNPROP_TRUNCATIONS)
        mode, steps = self.reward_backprop_mode, self.num_inference_steps
        k = self.backprop_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"backprop_steps={k!r} must be an integer >= 1 (the sampling steps trained with "
                             "gradient; DRaFT's most efficient: 1).")
        if mode in ("draft_lv", "refl") and k != 1:
            raise ValueError(f"backprop_steps={k} with reward_backprop_mode={mode!r}, which trains one step; set "
                             "backprop_steps: 1, or use 'draft' (DRaFT-K) or 'alignprop'.")
        if steps is not None and mode == "draft" and k > steps:
            raise ValueError(f"backprop_steps={k} is more than num_inference_steps={steps}; at most {steps} (full "
                             "DRaFT).")
        if steps is not None and mode == "alignprop" and k > steps - 1:
            raise ValueError(f"backprop_steps={k} with alignprop, which never backpropagates through step 0: at most "
                             f"num_inference_steps - 1 = {steps - 1}.")
        draws = self.lv_draws
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
            raise ValueError(f"lv_draws={draws!r} must be an integer >= 1 (DRaFT-LV: 2).")
        if not self.alignprop_truncation_std > 0:
            raise ValueError(f"alignprop_truncation_std={self.alignprop_truncation_std} must be > 0 (official: 5).")
        if self.reward_loss_scale is not None and not self.reward_loss_scale > 0:
            raise ValueError(f"reward_loss_scale={self.reward_loss_scale} must be > 0, or unset for the mode's own.")
        if self.refl_pretrain_weight < 0:
            raise ValueError(f"refl_pretrain_weight={self.refl_pretrain_weight} must be >= 0 (0: no pretraining loss).")
        if self.refl_pretrain_weight > 0 and mode != "refl":
            raise ValueError(f"refl_pretrain_weight={self.refl_pretrain_weight} adds ReFL's pretraining loss, but "
                             f"reward_backprop_mode={mode!r}; use 'refl' or set refl_pretrain_weight: 0.")
        self._check_refl_range()
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta={self.kl_beta} must be >= 0.")
        if self.beta not in (0.0, self.kl_beta):
            raise ValueError(f"beta={self.beta}: the reward-gradient trainer's KL weight is kl_beta (beta follows it); "
                             f"set kl_beta: {self.beta} and leave beta unset.")
        self.beta = float(self.kl_beta)
        refused = {
            "filter_zero_std_groups": (self.filter_zero_std_groups, "there are no groups to refill: the reward's "
                                       "gradient needs no spread"),
            "regularizer": (self.regularizer == "gardo", "GARDO gates a policy-gradient KL; use kl_beta"),
            "base_model_tail_steps": (self.base_model_tail_steps > 0, "the last steps are the ones trained"),
            "reward_aggregation": (self.reward_aggregation != "weighted_sum", "the gradient is that of the weighted sum "
                                   "of the rewards; normalising within groups needs groups"),
            "num_iterations": (self.num_iterations != 1, "every pass samples afresh (the rollout is the loss), so a "
                               "second pass is just more steps: raise max_steps"),
            "train_timesteps_per_pass": (parse_timesteps_per_pass(self.train_timesteps_per_pass) != 1,
                                         "its parts are whole sampling chains with gradient (a draw's chain, ReFL's "
                                         "pretraining loss), each backpropagated before the next so that one chain's "
                                         "activations are held at a time; there are no recorded timesteps to stack"),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{name}={getattr(self, name)!r} cannot be used with the reward-gradient trainer: "
                                 f"{why}.")

    def _check_refl_range(self) -> None:
        steps = self.num_inference_steps
        if self.refl_step_range is None:
            if steps is not None and self.reward_backprop_mode == "refl":
                self.refl_step_range = default_refl_step_range(int(steps))
            return
        values = self.refl_step_range
        if isinstance(values, int) or len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                               for v in values):
            raise ValueError(f"refl_step_range={values!r} must be two integers [lo, hi] (inclusive; official [30, 39] "
                             "of 40 steps).")
        lo, hi = (int(v) for v in values)
        if lo < 0 or hi < lo or (steps is not None and hi > steps - 1):
            raise ValueError(f"refl_step_range={[lo, hi]} must satisfy 0 <= lo <= hi <= num_inference_steps - 1 = "
                             f"{'T - 1' if steps is None else steps - 1} (the step with gradient is one of the "
                             "sampling steps).")
        self.refl_step_range = [lo, hi]

    @property
    def loss_scale(self) -> float:
        """The loss's scale: ``reward_loss_scale``, or the mode's own (ReFL's 1e-3, else 1)."""
        if self.reward_loss_scale is not None:
            return float(self.reward_loss_scale)
        return 1e-3 if self.reward_backprop_mode == "refl" else 1.0

    @property
    def uses_pretrain_loss(self) -> bool:
        """Whether ReFL's pretraining loss is a part of each step."""
        return self.reward_backprop_mode == "refl" and self.refl_pretrain_weight > 0


# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
def planned_backprop_steps(args: RewardBackpropConfig) -> int:
    """The most sampler steps one chain runs with gradient (what the planner plans the activations of): draft's K,
    1 for draft_lv and refl, alignprop's largest draw (uniform: backprop_steps; gaussian: mean + 2 std, capped at
    T - 1)."""
    steps = int(args.num_inference_steps or 0)
    if args.reward_backprop_mode == "alignprop" and args.alignprop_truncation == "gaussian":
        return max(1, min(steps - 1, int(args.backprop_steps + 2 * args.alignprop_truncation_std)))
    return int(args.backprop_steps) if args.reward_backprop_mode in ("draft", "alignprop") else 1


def sampling_passes_without_gradient(args: RewardBackpropConfig) -> float:
    """Transformer passes per sample sampled without gradient before the chain: T - K (draft), T - E[K] (alignprop),
    E[m] (refl), T (draft_lv: the whole trajectory, then the re-noised last steps)."""
    steps = int(args.num_inference_steps or 0)
    mode = args.reward_backprop_mode
    if mode == "draft":
        return float(steps - args.backprop_steps)
    if mode == "alignprop":
        mean_k = (1 + args.backprop_steps) / 2 if args.alignprop_truncation == "uniform" else args.backprop_steps
        return float(max(0.0, steps - mean_k))
    if mode == "refl":
        lo, hi = args.refl_step_range or default_refl_step_range(max(steps, 1))
        return (lo + hi) / 2
    return float(steps)


def describe_reward_backprop(args: RewardBackpropConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """The reward-gradient trainer's facts: no copies, a record of the prompts only (the rollout runs inside the loss,
    with gradient through its last steps), one trained chain per micro-batch (draft_lv: one per draw; refl with its
    pretraining loss: one more pass), nothing a rollout worker could sample for it."""
    mode = args.reward_backprop_mode
    chains = int(args.lv_draws) if mode == "draft_lv" else 1 + int(args.uses_pretrain_loss)
    return AlgorithmFacts(
        copies=(),
        reads_reference=args.kl_beta > 0,
        record=RolloutRecord("prompts", fields=("embeds", "prompts", "columns")),
        workers=WorkerNeeds(
            refusal=(f"reward_backprop_mode={mode!r} samples inside its loss, with gradient through the sampler's "
                     "last steps: there is no rollout a worker could sample ahead."),
            staleness="no stale samples: every image is sampled by the weights it trains."),
        probe=TransitionProbe("noised_sample", noise_level=0.7),
        step=PlannedStep("sampled_state", trained_timesteps=chains,
                         rollout_passes=sampling_passes_without_gradient(args),
                         frozen_forwards=("reference",) if args.kl_beta > 0 else (), loss="reward_gradient",
                         stored_per_step=0, unsharded_reference=args.kl_beta > 0, noise_level=0.0,
                         backprop_steps=planned_backprop_steps(args),
                         checkpointed_steps=bool(args.backprop_checkpointing)),
    )


SPEC = AlgorithmSpec(
    name="reward_backprop", title="Reward backpropagation (DRaFT, ReFL, AlignProp)",
    config="flowgrpo.trainer.algorithms.reward_backprop_config:RewardBackpropConfig",
    trainer="flowgrpo.trainer.algorithms.reward_backprop_trainer:RewardBackpropTrainer",
    summary="a differentiable reward backpropagated through the sampler's last steps (DRaFT-K, DRaFT-LV, ReFL, "
            "AlignProp)",
    describe=describe_reward_backprop,
    refused_settings=REFUSED_SETTINGS,
    eval_guidance_rollouts_refusal=("its rollout is its loss: the reward's gradient flows back through the sampler "
                                    "at guidance_scale, so there is no separate rollout guidance to change"),
    advantage_free=("a reward-gradient trainer does not read: its loss is the reward itself, backpropagated through "
                    "the sampler (a constraint would be a weighted reward term there)"),
)
