"""DGPOConfig: the settings of DGPO (Direct Group Preference Optimization), as a `transformers.TrainingArguments`
subclass.

The settings every online-RL trainer shares are those of `OnlineRLConfig`; this class adds DGPO's own (official
``Luo-Yihong/DGPO`` ``scripts/train_sd3_dgpo.py``, ``config/dgpo.py``): deterministic rollouts keeping only x0, the
trained rollout steps (``dgpo_num_timesteps`` drawn per inner epoch from step indices 0 .. ``dgpo_trunc_steps``),
noise shared by each group, the group-level DPO loss (``beta_dpo``), the DSM-ratio trust region (``dgpo_clip``),
the KL to the base (``beta`` at ``kl_guidance_scale``) and the EMA reference (decay min(0.3, 0.001 k), rollouts
sampled by it after ``dgpo_switch_ema_ref`` steps). Defaults are the official SD3.5-Medium OCR settings
(``general_ocr_sd3_4gpu``): 10 steps at CFG 4.5, groups of 16, 4 of the first 7 step indices, beta_dpo 100, clip
1e-2, beta 0.02, switch after 200 steps, global std; GenEval differs in ``dgpo_trunc_steps: 4``,
``dgpo_switch_ema_ref: 500``, ``scale_rewards: group``; PickScore in ``beta_dpo: 10``, ``beta: 0.001``,
``dgpo_clip: 0.05``, 24 images per prompt. The math: ``flowgrpo.trainer.algorithms.dgpo_loss``.
"""

from __future__ import annotations

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
from .train_guidance import TrainGuidanceArguments

DGPO_SAMPLERS = ("dpmpp_2m", "euler")

__all__ = ["DGPO_SAMPLERS", "DGPOConfig", "SPEC", "describe_dgpo"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@document_config
@dataclass
class DGPOConfig(TrainGuidanceArguments, OnlineRLConfig):
    r"""Configuration for [`DGPOTrainer`]: the shared settings of [`OnlineRLConfig`] plus DGPO's ODE rollouts,
    trained steps, group-level preference loss, DSM-ratio trust region, KL term and EMA reference (the math:
    ``flowgrpo.trainer.algorithms.dgpo_loss``)."""

    # ---- rollouts ------------------------------------------------------------------------------------
    sampler: str = field(
        default="dpmpp_2m",
        metadata={"help": "Deterministic solver of the rollouts: 'dpmpp_2m' (DPM-Solver++ 2M on the data "
                          "prediction, as the official code's DPM-Solver with flow shift 3) or 'euler'. Only each "
                          "rollout's clean sample x0 is kept; evaluation samples with the same solver."},
    )
    num_generations: int = field(
        default=16,
        metadata={"help": "Images per prompt K; it also divides each group's score S_g (DGPO SD3.5-M OCR and "
                          "GenEval: 16; PickScore: 24)."},
    )
    guidance_scale: float = field(
        default=4.5,
        metadata={"help": "CFG scale of the rollouts (DGPO: 4.5). The trained velocity is the conditional one "
                          "(train_guidance_scale 1.0), as in the official code; the KL reference may be guided, see "
                          "kl_guidance_scale."},
    )

    # ---- the trained steps ---------------------------------------------------------------------------
    dgpo_num_timesteps: int = field(
        default=4,
        metadata={"help": "Rollout steps M trained per inner epoch, distinct, drawn uniformly from step indices "
                          "0 .. dgpo_trunc_steps and shared by every sample and process (DGPO: 4). Each clean "
                          "sample is re-noised at those steps' noise levels with fresh noise per (group, "
                          "micro-batch, step)."},
    )
    dgpo_trunc_steps: int = field(
        default=6,
        metadata={"help": "The last rollout step index that may be trained: the draw is from 0 .. dgpo_trunc_steps, "
                          "inclusive, as the official code (random.sample(range(trunc_steps + 1), M)); so 6 allows "
                          "the first 7 of 10 steps (DGPO: 6 for OCR and PickScore, 4 for GenEval). Must be at most "
                          "num_inference_steps - 1."},
    )
    dgpo_shared_noise: bool = field(
        default=True,
        metadata={"help": "Re-noise the samples of one group with one shared noise per (micro-batch, step), so that "
                          "their DSM errors are compared on the same eps (the official use_shared_noise). False "
                          "draws noise per sample."},
    )

    # ---- the loss ------------------------------------------------------------------------------------
    beta_dpo: float = field(
        default=100.0,
        metadata={"help": "DGPO's beta in the group score S_g = sum_i A_i beta_dpo (D_i - D_i^ref) / K and its "
                          "weight w_g = sigmoid(S_g) (DGPO: 100 for OCR and GenEval, 10 for PickScore). > 0."},
    )
    dgpo_clip: float = field(
        default=0.01,
        metadata={"help": "Half-width c of the trust region on the DSM ratio rho = exp(D_old - D) against the EMA "
                          "reference: a sample with A > 0 and rho > 1 + c, or A <= 0 and rho < 1 - c, is trained "
                          "without gradient through its DSM (DGPO: 0.01; 0.05 for PickScore; smaller is more stable "
                          "and slower). > 0."},
    )
    dgpo_clip_dsm: bool = field(
        default=True,
        metadata={"help": "Apply the trust region to the DSM term (the official clip_dsm: true). With "
                          "dgpo_clip_dsm and dgpo_clip_kl both false and dgpo_use_ema_reference false no EMA reference "
                          "is kept."},
    )
    dgpo_clip_kl: bool = field(
        default=False,
        metadata={"help": "Also detach the KL term of clipped samples (the official clip_kl: false)."},
    )
    beta: float = field(
        default=0.02,
        metadata={"help": "Weight of the KL to the base: beta * mean((v_theta - v_base)^2), the base with the LoRA "
                          "off (or a frozen copy) at kl_guidance_scale (DGPO: 0.02 for OCR and GenEval, 0.001 for "
                          "PickScore). 0 skips the base's pass unless it is the DGPO reference."},
    )
    kl_guidance_scale: float = field(
        default=1.0,
        metadata={"help": "CFG scale of the base's velocity in the KL term and in the DGPO reference: > 1 guides it "
                          "with the negative prompt (the official kl_cfg); at 1.0 or below the base is called at "
                          "train_guidance_scale, as the trained velocity (default 1.0: the conditional velocity)."},
    )

    # ---- the EMA reference ---------------------------------------------------------------------------
    dgpo_use_ema_reference: bool = field(
        default=False,
        metadata={"help": "Take D^ref of the group score from the EMA reference instead of the base (the official "
                          "use_ema_ref, a dynamic reference as in TDM-R1; default false). The KL term stays to the "
                          "base."},
    )
    dgpo_ema_decay_rate: float = field(
        default=0.001,
        metadata={"help": "The EMA reference follows the policy after each optimizer step k (from 0): theta_ema <- d "
                          "theta_ema + (1 - d) theta with d = min(dgpo_ema_decay_max, dgpo_ema_decay_rate k) "
                          "(DGPO: 0.001)."},
    )
    dgpo_ema_decay_max: float = field(
        default=0.3,
        metadata={"help": "Largest decay of the EMA reference, in [0, 1) (DGPO: 0.3: a fast-moving reference)."},
    )
    dgpo_switch_ema_ref: int = field(
        default=200,
        metadata={"help": "Rollouts are sampled by the EMA reference once more than this many optimizer steps are "
                          "done (the official switch_ema_ref: 200 for OCR and PickScore, 500 for GenEval); before, by "
                          "the current policy."},
    )

    _trainer_name = "DGPOTrainer"

    def _check_algorithm(self) -> None:
        self._check_train_guidance()
        check_choice("sampler", self.sampler, DGPO_SAMPLERS)
        if self.regularizer is not None:
            raise ValueError(f"regularizer={self.regularizer!r} gates a per-sample KL penalty, which DGPOTrainer does "
                             "not take; unset it (DGPO's own KL is beta at kl_guidance_scale).")
        steps = self.num_inference_steps
        trunc = self.dgpo_trunc_steps
        if not _is_int(trunc) or trunc < 0 or (steps is not None and trunc > steps - 1):  # steps: once resolved
            raise ValueError(f"dgpo_trunc_steps={trunc!r} must be an integer in 0 .. num_inference_steps - 1 = "
                             f"{None if steps is None else steps - 1} (the last trainable rollout step index; DGPO: 6 of 10).")
        count = self.dgpo_num_timesteps
        if not _is_int(count) or not 1 <= count <= trunc + 1:
            raise ValueError(f"dgpo_num_timesteps={count!r} must be an integer in 1 .. dgpo_trunc_steps + 1 = "
                             f"{trunc + 1}: the steps are drawn without replacement from indices 0 .. "
                             f"{trunc}. Lower it or raise dgpo_trunc_steps.")
        if not self.beta_dpo > 0:
            raise ValueError(f"beta_dpo={self.beta_dpo} must be > 0 (DGPO: 100; 10 for PickScore).")
        if not self.dgpo_clip > 0:
            raise ValueError(f"dgpo_clip={self.dgpo_clip} must be > 0 (DGPO: 0.01); to train without the trust region "
                             "set dgpo_clip_dsm: false.")
        if not self.kl_guidance_scale > 0:
            raise ValueError(f"kl_guidance_scale={self.kl_guidance_scale} must be > 0 (1.0: no guidance).")
        if self.dgpo_ema_decay_rate < 0:
            raise ValueError(f"dgpo_ema_decay_rate={self.dgpo_ema_decay_rate} must be >= 0 (DGPO: 0.001).")
        if not 0 <= self.dgpo_ema_decay_max < 1:
            raise ValueError(f"dgpo_ema_decay_max={self.dgpo_ema_decay_max} must be in [0, 1) (DGPO: 0.3; 1 would "
                             "freeze the EMA reference).")
        if not _is_int(self.dgpo_switch_ema_ref) or self.dgpo_switch_ema_ref < 0:
            raise ValueError(f"dgpo_switch_ema_ref={self.dgpo_switch_ema_ref!r} must be an integer >= 0 (an optimizer "
                             "step; DGPO: 200).")
        for name in ("dgpo_shared_noise", "dgpo_clip_dsm", "dgpo_clip_kl", "dgpo_use_ema_reference"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false.")

    @property
    def uses_ema_reference(self) -> bool:
        """Whether an EMA reference is kept: for the trust region (dgpo_clip_dsm or dgpo_clip_kl) or as the DGPO
        reference (dgpo_use_ema_reference)."""
        return self.dgpo_clip_dsm or self.dgpo_clip_kl or self.dgpo_use_ema_reference

    @property
    def keeps_ema_reference(self) -> bool:
        """Whether a run keeps the EMA reference: the trust region or the DGPO reference reads it
        (``uses_ema_reference``), or the rollouts switch to it before the run ends (a run without ``max_steps`` may
        always reach the switch)."""
        return self.uses_ema_reference or self.max_steps <= 0 or self.dgpo_switch_ema_ref < self.max_steps

    @property
    def reads_base(self) -> bool:
        """Whether the loss reads the base model (the KL term, or D^ref of the base)."""
        return self.beta > 0 or not self.dgpo_use_ema_reference


# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
def describe_dgpo(args: DGPOConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """DGPO's facts: ODE rollouts keeping x0, by the policy and, after dgpo_switch_ema_ref steps, by the EMA
    reference; dgpo_num_timesteps trained steps per micro-batch, each with the reference forwards the loss reads."""
    ema = args.keeps_ema_reference
    frozen = (("old_policy",) if args.uses_ema_reference else ()) + (("reference",) if args.reads_base else ())
    return AlgorithmFacts(
        copies=(PolicyCopy("old_policy", "EMA reference (samples the rollouts after dgpo_switch_ema_ref steps)",
                           samples_rollouts=True),) if ema else (),
        reads_reference=args.reads_base,
        record=RolloutRecord("final_sample", fields=("x0", "sigmas", "timesteps", "group_ids"),
                             loss_reads_log_probs=False),
        workers=WorkerNeeds(
            sampled_by="old_policy" if ema else "policy", synced=("old_policy",) if ema else (),
            switch_step=int(args.dgpo_switch_ema_ref) if ema else None,
            staleness="a sample k steps old was drawn by the policy (or the EMA reference) of k steps before; the "
                      "loss reads only its clean latent, so staleness shifts which images are compared, not the "
                      "loss's form.",
            whole_groups=False, trainer_replay=""),
        probe=TransitionProbe("noised_sample", noise_level=0.7),
        step=PlannedStep("noised_sample", trained_timesteps=int(args.dgpo_num_timesteps), frozen_forwards=frozen,
                         loss="velocity_mse"),
    )


SPEC = AlgorithmSpec(
    name="dgpo", title="DGPO", config="flowgrpo.trainer.algorithms.dgpo_config:DGPOConfig",
    trainer="flowgrpo.trainer.algorithms.dgpo_trainer:DGPOTrainer",
    summary="Direct Group Preference Optimization: group-level DPO on the denoising error of ODE rollouts",
    describe=describe_dgpo,
    eval_guidance_rollouts_refusal=None,  # its loss reads only the clean samples, at train_guidance_scale
)
