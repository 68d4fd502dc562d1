"""CRDConfig: the settings of CRD (Centered Reward Distillation), as a `transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares are those of `OnlineRLConfig`; this class adds CRD's own (arXiv
2603.14128; defaults from Flow-Factory's port, ``trainers/crd.py`` and ``examples/crd/lora/sd3_5/default.yaml``, the
paper's OCR table): CFG-free deterministic rollouts of 10 steps from a lagging *sampling* copy, 20 stratified
re-noised steps per micro-batch, the adaptive implicit reward against a lagging *old* copy, centring within each
prompt's group (``crd_centering``), ``crd_beta`` 1, ``loss_type`` mse, the reward-weighted KL to the base at CFG
4.5 (``beta`` 0.1, ``kl_guidance_scale`` 4.5), groups of 24, global std, and the two copies' decay schedules (old:
min(0.25 + 0.005 k, 0.999); sampling: the policy until step 75, then min(0.0075 (k - 75), 0.999)). The math:
``flowgrpo.trainer.algorithms.crd_loss``.
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
from .crd_loss import CENTERINGS, CRD_LOSS_TYPES, crd_copy_decay

CRD_SAMPLERS = ("euler", "dpmpp_2m")

__all__ = ["CENTERINGS", "CRD_LOSS_TYPES", "CRD_SAMPLERS", "CRDConfig", "SAMPLING_COPY", "SPEC", "describe_crd"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@document_config
@dataclass
class CRDConfig(OnlineRLConfig):
    r"""Configuration for [`CRDTrainer`]: the shared settings of [`OnlineRLConfig`] plus CRD's deterministic
    rollouts from a sampling copy, re-noised training steps, centred implicit-reward matching, reward-weighted KL and
    the old and sampling copies (the math: ``flowgrpo.trainer.algorithms.crd_loss``)."""

    # ---- rollouts ------------------------------------------------------------------------------------
    sampler: str = field(
        default="euler",
        metadata={"help": "Deterministic solver of the rollouts: 'euler' (the port's ODE sampler) or 'dpmpp_2m'. Only "
                          "each rollout's clean sample is kept; evaluation samples with the same solver."},
    )
    guidance_scale: float = field(
        default=1.0,
        metadata={"help": "CFG scale of the rollouts and of the trained velocity (CRD: 1.0, CFG-free). The KL "
                          "reference has its own scale, kl_guidance_scale."},
    )
    num_generations: int = field(default=24, metadata={"help": "Images per prompt (CRD OCR: 24)."})

    # ---- the trained steps ---------------------------------------------------------------------------
    crd_num_timesteps: int = field(
        default=20,
        metadata={"help": "Re-noised steps trained per micro-batch: stratified draws over the rollout step indices "
                          "0 .. int(num_inference_steps x timestep_fraction) (one per stratum, shared by the "
                          "micro-batch), each with fresh noise per sample (CRD: 20 over 10 steps, so steps repeat). "
                          "Each costs a forward and backward of the policy and forwards of the old copy and, with "
                          "beta > 0, of the base."},
    )
    timestep_fraction: float = field(
        default=0.99,
        metadata={"help": "The draws cover step indices below int(num_inference_steps x timestep_fraction) (CRD: "
                          "0.99, i.e. 0 .. 8 of 10). In (0, 1]."},
    )

    # ---- the loss ------------------------------------------------------------------------------------
    crd_beta: float = field(
        default=1.0,
        metadata={"help": "CRD's beta: the implicit reward beta Q is matched to the centred reward R, and the loss "
                          "is scaled by adv_clip_max / beta (CRD: 1.0). > 0."},
    )
    loss_type: str = field(
        default="mse",
        metadata={"help": "'mse': mean (beta Q - R)^2; 'bce': binary cross-entropy of sigmoid(beta Q) against the "
                          "soft target sigmoid(R) (the port's). Both scaled by adv_clip_max / crd_beta."},
    )
    crd_centering: str = field(
        default="group",
        metadata={"help": "Where rewards and implicit rewards are centred: 'group' (within each prompt's group, the "
                          "paper) or 'batch' (over the whole micro-batch gathered from every process, Flow-Factory's "
                          "port). They agree when a micro-batch holds one prompt; with several, 'batch' compares "
                          "samples of different prompts."},
    )
    crd_adaptive_weights: bool = field(
        default=True,
        metadata={"help": "Divide each squared error of the implicit reward by its sample's mean absolute error "
                          "(no gradient, floored at 1e-5; the port's adaptive_logp: true)."},
    )
    crd_use_old_policy: bool = field(
        default=True,
        metadata={"help": "Measure the implicit reward against the old copy (true, the port's use_old_for_loss) or "
                          "against the base (false)."},
    )
    beta: float = field(
        default=0.1,
        metadata={"help": "Weight beta_kl of the KL to the base, mean((v_theta - v_base)^2) per sample, weighted by "
                          "reward when reward_adaptive_kl (CRD: 0.1). 0 skips the base's pass."},
    )
    kl_guidance_scale: float = field(
        default=4.5,
        metadata={"help": "CFG scale of the base's velocity in the KL term (CRD: 4.5, so the CFG-free student is "
                          "held near the guided base). 1.0 uses the conditional velocity."},
    )
    reward_adaptive_kl: bool = field(
        default=True,
        metadata={"help": "Weight each sample's KL by m + r (1 - m), r in [0, 1] its reward weight and m = 1e-4 / "
                          "beta: the best samples are held near the base, the worst barely (CRD: true). False "
                          "weights all by 1."},
    )

    # ---- the copies ----------------------------------------------------------------------------------
    old_policy_decay_start: int = field(
        default=0,
        metadata={"help": "The old copy (the implicit reward's anchor) moves toward the policy after each generation: "
                          "theta_old <- d theta_old + (1 - d) theta, d = old_policy_decay_initial before this "
                          "optimizer step and min(old_policy_decay_initial + old_policy_decay_rate (k - start), "
                          "old_policy_decay_max) after (CRD: start 0, initial 0.25, rate 0.005, max 0.999)."},
    )
    old_policy_decay_initial: float = field(default=0.25, metadata={"help": "The old copy's decay at its start (CRD: "
                                                                            "0.25). In [0, 1]."})
    old_policy_decay_rate: float = field(default=0.005, metadata={"help": "The old copy's decay growth per optimizer "
                                                                          "step (CRD: 0.005). >= 0."})
    old_policy_decay_max: float = field(default=0.999, metadata={"help": "The old copy's largest decay (CRD: 0.999). "
                                                                         "In [0, 1]."})
    sampling_policy_decay_start: int = field(
        default=75,
        metadata={"help": "The sampling copy (which samples the rollouts) follows the same rule with its own "
                          "numbers: decay sampling_policy_decay_initial before this optimizer step (0: a copy of the "
                          "policy), then min(initial + rate (k - start), max) (CRD: start 75, initial 0, rate "
                          "0.0075, max 0.999)."},
    )
    sampling_policy_decay_initial: float = field(default=0.0, metadata={"help": "The sampling copy's decay before its "
                                                                                "start (CRD: 0.0). In [0, 1]."})
    sampling_policy_decay_rate: float = field(default=0.0075, metadata={"help": "The sampling copy's decay growth per "
                                                                                "optimizer step (CRD: 0.0075). >= 0."})
    sampling_policy_decay_max: float = field(default=0.999, metadata={"help": "The sampling copy's largest decay (CRD: "
                                                                              "0.999). In [0, 1]."})

    _trainer_name = "CRDTrainer"

    def _check_algorithm(self) -> None:
        check_choice("sampler", self.sampler, CRD_SAMPLERS)
        if self.regularizer is not None:
            raise ValueError(f"regularizer={self.regularizer!r} gates a per-sample KL penalty, which CRDTrainer does "
                             "not take; unset it (CRD's own KL is beta at kl_guidance_scale, weighted by reward).")
        check_choice("loss_type", self.loss_type, CRD_LOSS_TYPES)
        check_choice("crd_centering", self.crd_centering, CENTERINGS)
        if not _is_int(self.crd_num_timesteps) or self.crd_num_timesteps < 1:
            raise ValueError(f"crd_num_timesteps={self.crd_num_timesteps!r} must be an integer >= 1 (CRD: 20).")
        fraction = self.timestep_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"timestep_fraction={fraction!r} must be in (0, 1] (CRD: 0.99).")
        if self.num_inference_steps is not None and int(self.num_inference_steps * fraction) < 1:
            raise ValueError(f"timestep_fraction={fraction} of num_inference_steps={self.num_inference_steps} leaves "
                             f"int({self.num_inference_steps} x {fraction}) = 0 steps to draw from; raise "
                             "timestep_fraction.")
        if not self.crd_beta > 0:
            raise ValueError(f"crd_beta={self.crd_beta} must be > 0 (CRD: 1.0).")
        if not self.kl_guidance_scale > 0:
            raise ValueError(f"kl_guidance_scale={self.kl_guidance_scale} must be > 0 (1.0: no guidance; CRD: 4.5).")
        for name in ("crd_adaptive_weights", "crd_use_old_policy", "reward_adaptive_kl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false.")
        for copy in ("old_policy", "sampling_policy"):
            start = getattr(self, f"{copy}_decay_start")
            if not _is_int(start) or start < 0:
                raise ValueError(f"{copy}_decay_start={start!r} must be an integer >= 0 (an optimizer step).")
            if getattr(self, f"{copy}_decay_rate") < 0:
                raise ValueError(f"{copy}_decay_rate={getattr(self, f'{copy}_decay_rate')} must be >= 0.")
            for part in ("initial", "max"):
                value = getattr(self, f"{copy}_decay_{part}")
                if not 0 <= value <= 1:
                    raise ValueError(f"{copy}_decay_{part}={value} must be in [0, 1] (0 copies the policy, 1 "
                                     "freezes the copy).")

    def old_policy_decay(self, step: int) -> float:
        """The old copy's decay after ``step`` optimizer steps."""
        return crd_copy_decay(step, self.old_policy_decay_start, self.old_policy_decay_initial,
                              self.old_policy_decay_rate, self.old_policy_decay_max)

    def sampling_policy_decay(self, step: int) -> float:
        """The sampling copy's decay after ``step`` optimizer steps."""
        return crd_copy_decay(step, self.sampling_policy_decay_start, self.sampling_policy_decay_initial,
                              self.sampling_policy_decay_rate, self.sampling_policy_decay_max)


# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
#: the name of CRD's sampling copy (``policy.copies``)
SAMPLING_COPY = "sampling"


def describe_crd(args: CRDConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """CRD's facts: ODE rollouts by a lagging sampling copy, keeping x0; crd_num_timesteps trained steps per
    micro-batch, each with the anchor's forward (the old copy or the base) and the KL reference's."""
    copies = ((PolicyCopy("old_policy", "old copy (the implicit reward's anchor)"),) if args.crd_use_old_policy
              else ()) + (PolicyCopy(SAMPLING_COPY, "sampling copy (samples the rollouts)", samples_rollouts=True),)
    separate_kl = args.beta > 0 and (args.crd_use_old_policy or args.kl_guidance_scale != args.guidance_scale)
    frozen = (("old_policy",) if args.crd_use_old_policy else ("reference",)) + (("reference",) if separate_kl
                                                                                 else ())
    return AlgorithmFacts(
        copies=copies,
        reads_reference=args.beta > 0 or not args.crd_use_old_policy,
        record=RolloutRecord("final_sample", fields=("x0", "sigmas", "timesteps", "group_ids"),
                             loss_reads_log_probs=False),
        workers=WorkerNeeds(
            sampled_by=SAMPLING_COPY, synced=(SAMPLING_COPY,),
            staleness="the sampling copy samples; a sample k steps old was drawn by the sampling copy of k steps "
                      "before (it lags the policy by design, moving once per generation); the old copy, which only "
                      "the loss reads, stays on the trainer.",
            whole_groups=False, trainer_replay=""),
        probe=TransitionProbe("noised_sample", noise_level=0.7),
        step=PlannedStep("noised_sample", trained_timesteps=int(args.crd_num_timesteps), frozen_forwards=frozen,
                         loss="velocity_mse"),
    )


SPEC = AlgorithmSpec(
    name="crd", title="CRD", config="flowgrpo.trainer.algorithms.crd_config:CRDConfig",
    trainer="flowgrpo.trainer.algorithms.crd_trainer:CRDTrainer",
    summary="centered reward distillation: the implicit reward of a lagging copy regressed on centred rewards",
    describe=describe_crd,
    eval_guidance_rollouts_refusal=("its implicit reward compares the trained and old copies' velocities at "
                                    "guidance_scale, the sampling copy's scale, and it has no separate training scale "
                                    "here: rollouts at another scale would change the trained velocity's too"),
)
