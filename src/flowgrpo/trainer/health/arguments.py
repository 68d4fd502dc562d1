"""HealthArguments: the settings of gold evaluation rewards, best-model selection, diagnostics, alarms and guards.

A dataclass mixed into `OnlineRLConfig` (so every trainer's configuration and the launch line's ``--help`` have
these fields). ``metric_for_best_model``, ``greater_is_better`` and ``load_best_model_at_end`` are
``transformers.TrainingArguments``' own fields, with their meaning; ``early_stopping_*`` are those of
``transformers.EarlyStoppingCallback``; ``sync_ref_model``, ``ref_model_mixup_alpha`` and ``ref_model_sync_steps``
those of ``trl.GRPOConfig``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["ON_HACKING", "REGULARIZERS", "HealthArguments", "check_constraint_arguments", "check_health_arguments"]

ON_HACKING = ("warn", "stop")
REGULARIZERS = ("gardo",)


@dataclass
class HealthArguments:
    # ---- gold rewards at evaluation ----------------------------------------------------------------
    eval_reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Gold rewards: computed at evaluation only, never trained on (registry names or "
                          "'module:function' paths). Logged as eval_rewards/<name>/{mean,std,count,change,change_se} "
                          "next to the training rewards, shown on the contact sheet and in the model card. They "
                          "reveal reward hacking that the training rewards cannot see; use one as "
                          "metric_for_best_model (e.g. eval_rewards/toy_shape/mean)."},
    )
    eval_reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per gold reward; their weighted sum is logged as eval_gold_reward. "
                          "Default: all 1."},
    )
    eval_reward_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments per gold reward name (JSON string accepted on the command line), as "
                          "reward_kwargs."},
    )
    # ---- early stopping (transformers.EarlyStoppingCallback) --------------------------------------
    early_stopping_patience: int | None = field(
        default=None,
        metadata={"help": "Stop when metric_for_best_model has not improved for this many evaluations "
                          "(transformers' EarlyStoppingCallback; needs metric_for_best_model and evaluations). "
                          "None: never stop early."},
    )
    early_stopping_threshold: float = field(
        default=0.0,
        metadata={"help": "How much metric_for_best_model must improve on its best to count as an improvement "
                          "(EarlyStoppingCallback's early_stopping_threshold)."},
    )
    # ---- diagnostics and alarms ----------------------------------------------------------------------
    health_kl_steps: int = field(
        default=10,
        metadata={"help": "Every N optimizer steps log health/kl_to_reference, the analytic KL of one SDE step "
                          "between the policy and the reference on a few rollout samples, even when beta is 0 "
                          "(with LoRA the reference is the base, the adapter switched off; full fine-tuning logs it "
                          "only when a reference copy is kept anyway: beta > 0, sync_ref_model, GARDO or "
                          "base_model_tail_steps). 0 never."},
    )
    hacking_tolerance: float = field(
        default=0.05,
        metadata={"help": "The hacking alarm (health/hacking_alarm) fires at an evaluation where a gold reward's "
                          "mean has fallen by more than this from its best while the training reward rose."},
    )
    on_hacking: str = field(
        default="warn",
        metadata={"help": "What the hacking alarm does: 'warn' logs it and warns; 'stop' saves a checkpoint, keeps "
                          "the best one, and ends training like a normal run (exit status 0) with a clear message."},
    )
    diversity_collapse_ratio: float = field(
        default=0.3,
        metadata={"help": "The diversity alarm (health/diversity_alarm) fires while the within-group diversity "
                          "(mean of the last 5 steps) is below this fraction of its first value. 0 disables it."},
    )
    # ---- guards ----------------------------------------------------------------------------------
    filter_zero_std_groups: bool = field(
        default=False,
        metadata={"help": "Dynamic sampling (DAPO): drop the groups whose rewards are all equal (no learning "
                          "signal) and refill the batch with groups of fresh prompts, up to max_resample_rounds "
                          "rounds; groups still without signal after that are kept. Batch shapes stay fixed. Logs "
                          "health/dropped_groups and health/resample_rounds."},
    )
    max_resample_rounds: int = field(
        default=2, metadata={"help": "Most refill rounds of dynamic sampling per generation batch."},
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={"help": "Refresh the reference policy during training as TRL's SyncRefModelCallback does: every "
                          "ref_model_sync_steps steps, ref <- (1 - ref_model_mixup_alpha) ref + ref_model_mixup_alpha "
                          "policy. With LoRA the reference is then a second adapter ('ref', a copy of the trained "
                          "adapter at the start) instead of the base model with the adapter disabled."},
    )
    ref_model_mixup_alpha: float = field(
        default=0.6, metadata={"help": "Weight of the policy when the reference is refreshed (TRL: 0.6)."},
    )
    ref_model_sync_steps: int = field(
        default=512, metadata={"help": "Optimizer steps between reference refreshes (TRL: 512)."},
    )
    regularizer: str | None = field(
        default=None,
        metadata={"help": "'gardo': GARDO (arXiv 2512.24138): the KL penalty only on the samples whose reward is "
                          "most uncertain (the proxy and the gardo_auxiliary_rewards disagree most), the reference "
                          "reset to the policy when the KL passes gardo_kl_threshold or every gardo_reset_steps, and "
                          "advantages amplified for good samples that are diverse within their group. Needs beta > 0 "
                          "(docs/learning_health.md has every formula)."},
    )
    gardo_auxiliary_rewards: list[str] | None = field(
        default=None,
        metadata={"help": "GARDO: names among reward_funcs of the auxiliary rewards whose ranks measure the proxy's "
                          "uncertainty (the official code: aesthetic and imagereward). Give them weight 0 in "
                          "reward_weights to keep them out of the training reward, as the official code does."},
    )
    gardo_kl_threshold: float = field(
        default=3e-4, metadata={"help": "GARDO: a step whose mean KL exceeds this resets the reference (official "
                                        "kl_thres)."},
    )
    gardo_reset_steps: int = field(
        default=15, metadata={"help": "GARDO: the reference is reset at the latest after this many generation "
                                      "batches (official reset_freq)."},
    )
    gardo_diversity: bool = field(
        default=True, metadata={"help": "GARDO: diversity-aware advantage shaping (off: the gate and the resets "
                                        "only)."},
    )
    base_model_tail_steps: int = field(
        default=0,
        metadata={"help": "Sample the last k steps of every training rollout with the reference model (MixGRPO's "
                          "remedy for hacking). They must lie outside the trained SDE window."},
    )
    # ---- reward constraints --------------------------------------------------------------------------
    reward_constraints: dict | str | None = field(
        default=None,
        metadata={"help": "Rewards to keep, each with a bound and a Lagrange multiplier (JSON on the command line), "
                          "e.g. {'pickscore': {'min_delta': -0.01, 'source': 'rollouts'}, 'aesthetic': {'min': 5.8, "
                          "'source': 'evaluation'}}. Per reward name one bound, 'min' (absolute) or 'min_delta' "
                          "(relative to the value at the start), optionally 'lr' (its own dual step size), and 'source': "
                          "'rollouts' (the mean over each scored "
                          "rollout batch; default) or 'evaluation' (the periodic evaluation's mean at its own "
                          "settings; needs an eval dataset, eval_strategy 'steps' and, with min_delta, "
                          "eval_on_start). A constrained reward that is not among reward_funcs is scored with weight 0: "
                          "it stays out of the objective and acts only through its multiplier. The advantage becomes "
                          "(A_0 + sum_i lambda_i A_i) / (1 + sum_i lambda_i); logged as constraint/<name>/{value, "
                          "bound,slack,multiplier} (docs/learning_health.md)."},
    )
    constraint_lr: float = field(
        default=1.0,
        metadata={"help": "Step size eta of the multipliers' dual ascent, lambda <- max(0, lambda + eta (bound - "
                          "value)), applied at every scored generation (source rollouts) or evaluation (source "
                          "evaluation). In multiplier units per unit of the reward below its bound: a reward in [0, 1] "
                          "measured at every evaluation needs a larger eta than one measured at every step. >= 0."},
    )

    def _check_health(self) -> None:
        check_health_arguments(self)


def check_health_arguments(args) -> None:
    """Validate the fields above (called from the configuration's ``__post_init__``)."""
    for name in ("eval_reward_kwargs",):
        value = getattr(args, name)
        if isinstance(value, str):
            setattr(args, name, json.loads(value))
    if args.eval_reward_funcs is not None and isinstance(args.eval_reward_funcs, str):
        args.eval_reward_funcs = [args.eval_reward_funcs]
    if args.eval_reward_weights is not None:
        if not args.eval_reward_funcs or len(args.eval_reward_weights) != len(args.eval_reward_funcs):
            raise ValueError(f"eval_reward_weights={args.eval_reward_weights} needs one weight per eval_reward_funcs "
                             f"entry ({args.eval_reward_funcs}).")
    if args.on_hacking not in ON_HACKING:
        raise ValueError(f"on_hacking={args.on_hacking!r} is not valid; choose one of 'warn', 'stop'.")
    if args.regularizer is not None and args.regularizer not in REGULARIZERS:
        raise ValueError(f"regularizer={args.regularizer!r} is not valid; choose 'gardo' or leave it unset.")
    if args.hacking_tolerance < 0:
        raise ValueError(f"hacking_tolerance={args.hacking_tolerance} must be >= 0.")
    if not 0 <= args.diversity_collapse_ratio < 1:
        raise ValueError(f"diversity_collapse_ratio={args.diversity_collapse_ratio} must be in [0, 1) (0 disables "
                         "the diversity alarm).")
    if args.health_kl_steps < 0:
        raise ValueError(f"health_kl_steps={args.health_kl_steps} must be >= 0 (0: never).")
    if args.max_resample_rounds < 0:
        raise ValueError(f"max_resample_rounds={args.max_resample_rounds} must be >= 0.")
    if not 0 < args.ref_model_mixup_alpha <= 1:
        raise ValueError(f"ref_model_mixup_alpha={args.ref_model_mixup_alpha} must be in (0, 1].")
    if args.ref_model_sync_steps < 1:
        raise ValueError(f"ref_model_sync_steps={args.ref_model_sync_steps} must be >= 1.")
    if args.base_model_tail_steps < 0 or args.base_model_tail_steps >= args.num_inference_steps:
        raise ValueError(f"base_model_tail_steps={args.base_model_tail_steps} must be in [0, num_inference_steps="
                         f"{args.num_inference_steps}).")
    if args.early_stopping_patience is not None:
        if args.early_stopping_patience < 1:
            raise ValueError(f"early_stopping_patience={args.early_stopping_patience} must be >= 1.")
        if args.metric_for_best_model is None:
            raise ValueError("early_stopping_patience needs metric_for_best_model (the evaluation metric to watch, "
                             "e.g. eval_rewards/toy_shape/mean).")
        if str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "no":
            raise ValueError("early_stopping_patience needs evaluations: set eval_strategy (e.g. 'steps' with "
                             "eval_steps) and an eval dataset.")
    if getattr(args, "load_best_model_at_end", False) and args.metric_for_best_model in (None, "loss", "eval_loss"):
        raise ValueError("load_best_model_at_end needs metric_for_best_model: an evaluation metric these trainers log, "
                         "e.g. eval_rewards/<gold reward>/mean or eval_gold_reward (there is no eval_loss).")
    check_constraint_arguments(args)
    if args.regularizer == "gardo":
        if args.beta <= 0:
            raise ValueError(f"regularizer='gardo' gates the KL penalty, which beta={args.beta} turns off; set beta "
                             "> 0 (the official GARDO recipes: 0.04).")
        if not args.gardo_auxiliary_rewards:
            raise ValueError("regularizer='gardo' needs gardo_auxiliary_rewards: the reward_funcs names (weight 0) "
                             "whose ranks measure the training reward's uncertainty.")
        if args.gardo_kl_threshold <= 0 or args.gardo_reset_steps < 1:
            raise ValueError(f"gardo_kl_threshold={args.gardo_kl_threshold} must be > 0 and gardo_reset_steps="
                             f"{args.gardo_reset_steps} >= 1.")


def check_constraint_arguments(args) -> None:
    """Parse ``reward_constraints`` (a JSON string on the command line) into its checked form and check
    ``constraint_lr`` and the evaluation a constraint of source ``evaluation`` reads; the reward names are checked
    against the rewards by the trainer, before anything loads (`constraints.check_constraint_rewards`)."""
    from .constraints import parse_reward_constraints

    if isinstance(args.constraint_lr, bool) or not isinstance(args.constraint_lr, (int, float)) or \
            not args.constraint_lr >= 0:
        raise ValueError(f"constraint_lr={args.constraint_lr!r} must be a number >= 0 (the multipliers' step size; "
                         "0 keeps them at 0).")
    specs = parse_reward_constraints(args.reward_constraints)
    args.reward_constraints = {spec.name: spec.as_dict() for spec in specs} or None
    from_evaluation = [spec for spec in specs if spec.source == "evaluation"]
    if not from_evaluation:
        return
    names = ", ".join(spec.name for spec in from_evaluation)
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "steps" or not args.eval_steps:
        raise ValueError(f"reward_constraints {names} read the periodic evaluation (source: evaluation), but "
                         f"eval_strategy={str(getattr(args.eval_strategy, 'value', args.eval_strategy))!r} with "
                         f"eval_steps={args.eval_steps!r} never evaluates during training; set eval_strategy: steps "
                         "and eval_steps (and an eval dataset), or use source: rollouts.")
    relative = [spec.name for spec in from_evaluation if spec.min_delta is not None]
    if relative and not args.eval_on_start:
        raise ValueError(f"reward_constraints {', '.join(relative)} bound the evaluation relative to its start "
                         "(min_delta, source: evaluation), which is the evaluation before training: set "
                         "eval_on_start: true, or give an absolute bound (min).")
