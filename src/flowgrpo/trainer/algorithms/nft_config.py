"""DiffusionNFTConfig: the settings of DiffusionNFT training, as a `transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares (groups, rollouts, rewards and advantages, memory, crash safety, logging)
are those of `OnlineRLConfig`; this class adds DiffusionNFT's own: the deterministic ``sampler`` of the rollouts, the
share of their timesteps that is trained, the negative-aware loss (``nft_beta``) and the old policy's decay schedule.
Defaults are the published DiffusionNFT ones (CFG-free rollouts of 10 DPM-Solver++ 2M steps, ``nft_beta`` 1.0, a
velocity penalty ``beta`` of 1e-4, the old policy's decay rising by 0.001 a step up to 0.5); the OCR setting of the
paper is ``nft_beta: 0.1``, ``old_policy_decay_start: 75``, ``old_policy_decay_rate: 0.0075``,
``old_policy_decay_max: 0.999`` (``recipes/nft_ocr.yaml``).

Flow-GRPO's sampler and objective settings (``noise_level``, ``sde_type``, the SDE windows, ``ode_solver``,
``epsilon``, ...) are not fields of this class: DiffusionNFT never samples an SDE and has no likelihood ratio.
Passing one is an error that says so (`FLOW_GRPO_ONLY_SETTINGS`), here and in recipes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

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

NFT_SAMPLERS = ("dpmpp_2m", "euler")

#: Flow-GRPO settings that DiffusionNFT does not use, and why (the message of the error when one is given).
FLOW_GRPO_ONLY_SETTINGS: dict[str, str] = {
    "noise_level": "DiffusionNFT samples deterministically (see sampler)",
    "sde_type": "DiffusionNFT samples deterministically (see sampler)",
    "sde_window_size": "DiffusionNFT has no SDE window: it trains on the final samples at timestep_fraction of the "
                       "rollout's noise levels",
    "sde_window_range": "DiffusionNFT has no SDE window",
    "sde_window_strategy": "DiffusionNFT has no SDE window",
    "sde_window_shift_interval": "DiffusionNFT has no SDE window",
    "sde_window_stride": "DiffusionNFT has no SDE window",
    "sde_window_roll_back": "DiffusionNFT has no SDE window",
    "ode_solver": "DiffusionNFT's rollout solver is the sampler setting ('dpmpp_2m' or 'euler')",
    "ode_compression_ratio": "DiffusionNFT samples every one of its num_inference_steps",
    "same_noise_per_group": "DiffusionNFT's sampler is deterministic, so a group sharing its initial noise would hold "
                            "G identical images",
    "epsilon": "DiffusionNFT has no likelihood ratio to clip",
    "ratio_normalization": "DiffusionNFT has no likelihood ratio",
    "kl_estimator": "DiffusionNFT's penalty is always the velocity one, beta * mean((v_theta - v_ref)^2)",
    "on_policy_tolerance": "DiffusionNFT has no likelihood ratio",
}


def flow_grpo_only_error(names: list[str]) -> str:
    """The message for Flow-GRPO settings given to DiffusionNFT."""
    lines = [f"  {name}: {FLOW_GRPO_ONLY_SETTINGS[name]}" for name in names]
    return ("These are Flow-GRPO settings that DiffusionNFT does not use; remove them (or train with "
            "trainer: flow_grpo):\n" + "\n".join(lines))


@document_config
@dataclass
class DiffusionNFTConfig(OnlineRLConfig):
    r"""Configuration for [`DiffusionNFTTrainer`]: the shared settings of [`OnlineRLConfig`] plus DiffusionNFT's
    deterministic rollouts, negative-aware loss and old policy (the math: ``flowgrpo.trainer.algorithms.nft_loss`` and
    ``flowgrpo.trainer.policy.old_policy``)."""

    # ---- rollouts ------------------------------------------------------------------------------------
    sampler: str = field(
        default="dpmpp_2m",
        metadata={"help": "Deterministic solver of the rollouts: 'dpmpp_2m' (DiffusionNFT's default: DPM-Solver++ 2M "
                          "on the data prediction, first order on the first and the final step) or 'euler'. Only "
                          "each rollout's final sample is kept; any solver works, since the loss never needs the "
                          "trajectory's likelihood. Evaluation samples with the same solver."},
    )
    guidance_scale: float | None = field(
        default=None,
        metadata={"help": "Classifier-free guidance scale of rollouts and of the trained velocity. DiffusionNFT "
                          "as published trains CFG-free (1.0: one transformer pass per step), which is what an unset "
                          "value gives (the family's no-guidance value; a guidance embedding keeps the model's value). "
                          "> 1 guides both with the negative prompt: our extension, with no published counterpart "
                          "(the official CFG>1 training path cannot run). Evaluate at several scales with "
                          "eval_guidance_scales."},
    )
    timestep_fraction: float = field(
        default=0.99,
        metadata={"help": "Share of the rollout's noise levels trained on each sample: int(num_inference_steps x "
                          "timestep_fraction) of them (DiffusionNFT: 0.99, i.e. 9 of 10), a random subset drawn per "
                          "sample, each with fresh noise. Each costs one forward and backward of the policy, one "
                          "forward of the old policy and, with beta > 0, one of the reference."},
    )

    # ---- objective -----------------------------------------------------------------------------------
    nft_beta: float = field(
        default=1.0,
        metadata={"help": "DiffusionNFT's beta: how far the implicit positive and negative policies move from the old "
                          "one (v+ = nft_beta v_theta + (1 - nft_beta) v_old, v- = (1 + nft_beta) v_old - nft_beta "
                          "v_theta). Published: 1.0; 0.1 for OCR and multi-reward runs. > 0."},
    )
    beta: float = field(
        default=1e-4,
        metadata={"help": "Weight of the penalty to the reference policy (LoRA disabled, or a frozen copy for full "
                          "fine-tuning): beta * mean((v_theta - v_ref)^2), logged as kl. DiffusionNFT: 1e-4. 0 "
                          "skips the reference pass."},
    )

    # ---- the old policy ------------------------------------------------------------------------------
    old_policy_decay_start: int = field(
        default=0,
        metadata={"help": "After each optimizer step k the old policy (which samples the rollouts) moves toward the "
                          "trained one: theta_old <- d theta_old + (1 - d) theta, with d = 0 for k < "
                          "old_policy_decay_start (the old policy is the current one) and d = min(old_policy_decay_rate "
                          "x (k - old_policy_decay_start), old_policy_decay_max) after. DiffusionNFT: 0 (OCR: 75)."},
    )
    old_policy_decay_rate: float = field(
        default=0.001,
        metadata={"help": "Growth of the old policy's decay d per optimizer step after old_policy_decay_start "
                          "(DiffusionNFT: 0.001; OCR: 0.0075)."},
    )
    old_policy_decay_max: float = field(
        default=0.5,
        metadata={"help": "Largest decay d of the old policy, in [0, 1) (DiffusionNFT: 0.5; OCR: 0.999, a slowly "
                          "moving old policy)."},
    )

    _trainer_name = "DiffusionNFTTrainer"
    _cfg_free_rollouts = "DiffusionNFTConfig: CFG-free rollouts"

    def _check_algorithm(self) -> None:
        check_choice("sampler", self.sampler, NFT_SAMPLERS)
        if not self.nft_beta > 0:
            raise ValueError(f"nft_beta={self.nft_beta} must be > 0 (DiffusionNFT: 1.0; 0.1 for OCR).")
        fraction = self.timestep_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"timestep_fraction={fraction!r} must be in (0, 1] (DiffusionNFT: 0.99).")
        if self.num_inference_steps is not None and self.num_trained_timesteps < 1:
            raise ValueError(f"timestep_fraction={fraction} of num_inference_steps={self.num_inference_steps} trains "
                             f"int({self.num_inference_steps} x {fraction}) = 0 timesteps per sample; raise "
                             "timestep_fraction to at least "
                             f"{1 / self.num_inference_steps:.3g}.")
        start = self.old_policy_decay_start
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"old_policy_decay_start={start!r} must be an integer >= 0 (an optimizer step).")
        if self.old_policy_decay_rate < 0:
            raise ValueError(f"old_policy_decay_rate={self.old_policy_decay_rate} must be >= 0.")
        if not 0 <= self.old_policy_decay_max < 1:
            raise ValueError(f"old_policy_decay_max={self.old_policy_decay_max} must be in [0, 1) (1 would freeze the "
                             "old policy for good).")

    @property
    def num_trained_timesteps(self) -> int | None:
        """Timesteps trained per sample: ``int(num_inference_steps * timestep_fraction)`` (``None`` until the step
        count is given or resolved)."""
        if self.num_inference_steps is None:
            return None
        return int(self.num_inference_steps * self.timestep_fraction)


def _reject_flow_grpo_settings(init):
    """Wrap the dataclass ``__init__`` so that a Flow-GRPO setting is a clear error instead of Python's "unexpected
    keyword argument"."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        given = [name for name in kwargs if name in FLOW_GRPO_ONLY_SETTINGS]
        if given:
            raise TypeError(flow_grpo_only_error(given))
        init(self, *args, **kwargs)

    return wrapper


DiffusionNFTConfig.__init__ = _reject_flow_grpo_settings(DiffusionNFTConfig.__init__)



# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
def describe_nft(args: DiffusionNFTConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """DiffusionNFT's facts: the old policy samples deterministic rollouts that keep x0; each sample trains
    ``int(steps x timestep_fraction)`` noise levels, each a forward of the old policy (no gradient) and of the
    trained one."""
    steps = int(args.num_inference_steps or 0)
    trained = max(1, int(steps * float(args.timestep_fraction)))
    return AlgorithmFacts(
        copies=(PolicyCopy("old_policy", "old policy (samples the rollouts, v_old in the loss)",
                           samples_rollouts=True),),
        reads_reference=args.beta > 0,
        record=RolloutRecord("final_sample", fields=("x0", "sigmas", "timesteps"), loss_reads_log_probs=False),
        workers=WorkerNeeds(
            sampled_by="old_policy", synced=("old_policy",),
            staleness="the old policy samples; a sample k steps old was drawn by the old policy of k steps before, "
                      "and the loss's v_old is the trainer's current old policy (the implicit negative policy is "
                      "unchanged in form).",
            switch_step=None, whole_groups=False, trainer_replay=""),
        probe=TransitionProbe("noised_sample", noise_level=0.7),
        step=PlannedStep("noised_sample", trained_timesteps=trained,
                         frozen_forwards=("old_policy",) + (("reference",) if args.beta > 0 else ()),
                         loss="velocity_mse"),
    )


SPEC = AlgorithmSpec(
    name="diffusion_nft", title="DiffusionNFT",
    config="flowgrpo.trainer.algorithms.nft_config:DiffusionNFTConfig",
    trainer="flowgrpo.trainer.algorithms.nft_trainer:DiffusionNFTTrainer",
    summary="deterministic rollouts of the old policy, the negative-aware flow-matching loss on the forward process",
    describe=describe_nft,
    refused_settings=FLOW_GRPO_ONLY_SETTINGS,
    eval_guidance_rollouts_refusal=("its implicit positive and negative policies (v+ = nft_beta v_theta + (1 - nft_beta) v_old, v- = (1 + "
                                    "nft_beta) v_old - nft_beta v_theta) split the policy that sampled the rollouts, "
                                    "so the trained and old velocities must use the rollouts' guidance"),
    sequence_parallel=True,  # tested: tests/distributed/test_sequence_parallel.py
)

__all__ = ["FLOW_GRPO_ONLY_SETTINGS", "NFT_SAMPLERS", "SPEC", "DiffusionNFTConfig", "describe_nft",
           "flow_grpo_only_error"]
