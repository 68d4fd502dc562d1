"""DiffusionDPOConfig: the settings of flow-matching Diffusion-DPO, as a `transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares are those of `OnlineRLConfig`; this class adds Diffusion-DPO's own
(Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization", in its flow-matching form): where
the preference pairs come from (``dpo_mode``: a preference dataset, or each group's best and worst rollout, sampled by
the policy or by the reference: ``dpo_rollout_policy``), ``beta_dpo``, the (t, eps) draws of the loss
(``dpo_num_noise_draws``, ``dpo_timestep_distribution``, ``time_shift``), the CFG scale of the trained velocities
(``train_guidance_scale``) and the deterministic ``sampler`` of the online rollouts and of evaluation. Defaults follow
the flow-matching references on SD3.5-M (flow_grpo's ``config/dpo.py`` and ``scripts/train_sd3_dpo.py``): beta_dpo
100, logit-normal levels through the scheduler's shift, the loss on the conditional velocity; flow_grpo's 39 draws
per pair per update and its reference refresh every 40 steps (OnlineDPO: ``sync_ref_model``,
``ref_model_sync_steps: 40``, ``ref_model_mixup_alpha: 1.0``) are settings to give.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..algorithm_spec import (
    AlgorithmFacts,
    AlgorithmSpec,
    PlannedStep,
    RolloutRecord,
    TransitionProbe,
    WorkerNeeds,
)
from ..config_docs import document_config
from ..online_config import OnlineRLConfig, check_choice
from .dpo_timesteps import DPO_TIMESTEP_DISTRIBUTIONS
from .train_guidance import TrainGuidanceArguments

DPO_MODES = ("offline", "online")
#: who samples the online rollouts: the trained policy, or the reference (flow_grpo's DPO)
DPO_ROLLOUT_POLICIES = ("policy", "reference")
DPO_SAMPLERS = ("dpmpp_2m", "euler")
#: the image columns of an offline preference dataset
CHOSEN_COLUMN, REJECTED_COLUMN = "chosen", "rejected"

__all__ = ["CHOSEN_COLUMN", "DPO_MODES", "DPO_ROLLOUT_POLICIES", "DPO_SAMPLERS", "REJECTED_COLUMN",
           "DiffusionDPOConfig", "SPEC", "describe_dpo"]


@document_config
@dataclass
class DiffusionDPOConfig(TrainGuidanceArguments, OnlineRLConfig):
    r"""Configuration for [`DiffusionDPOTrainer`]: the shared settings of [`OnlineRLConfig`] plus the preference pairs
    and the DPO loss (the math: ``algorithms/dpo_loss.py``)."""

    # ---- the preference pairs ------------------------------------------------------------------------
    dpo_mode: str = field(
        default="online",
        metadata={"help": "'offline': pairs from the train dataset's 'prompt', 'chosen' and 'rejected' columns (image "
                          "paths, PIL images or datasets.Image values, Pick-a-Pic style); no rollouts and no rewards "
                          "during training (rewards score evaluation only). 'online': each group of num_generations "
                          "rollouts gives one pair, its best and its worst image by the rewards (groups whose "
                          "images all score the same give none)."},
    )
    dpo_rollout_policy: str = field(
        default="policy",
        metadata={"help": "Who samples the online rollouts: 'policy' (the trained weights: on-policy pairs) or "
                          "'reference' (the frozen base, or with sync_ref_model the copy refreshed every "
                          "ref_model_sync_steps: flow_grpo's DPO samples with its reference adapter, refreshed every "
                          "40 steps in its OnlineDPO)."},
    )

    # ---- the loss ------------------------------------------------------------------------------------
    beta_dpo: float = field(
        default=100.0,
        metadata={"help": "Diffusion-DPO's beta: L = -log sigmoid(-beta_dpo / 2 ((e_w - e_w_ref) - (e_l - e_l_ref))) "
                          "with e the per-pixel mean flow-matching error. 100 as the flow-matching references on "
                          "SD3.5-M (flow_grpo's GenEval and PickScore DPO, Flow-Factory's example); 5000 is "
                          "Diffusion-DPO's epsilon-prediction value (its SD1.5 and SDXL launchers both use 5000)."},
    )
    dpo_num_noise_draws: int = field(
        default=1,
        metadata={"help": "K: fresh (t, eps) draws per pair per optimizer step, their losses averaged (accumulated). "
                          "flow_grpo accumulates int(40 steps x 0.99) = 39 draws per update; Flow-Factory's example "
                          "uses 1."},
    )
    dpo_timestep_distribution: str = field(
        default="logit_normal",
        metadata={"help": "The noise level t of each draw, shared by the pair: 'logit_normal' (the references: u = "
                          "sigmoid(z), z ~ N(0, 1), the scheduler's training level at index floor(1000 u), i.e. through "
                          "the scheduler's own shift; flowgrpo.trainer.algorithms.dpo_timesteps) or 'uniform' (t = s u / "
                          "(1 + (s - 1) u), u ~ U(0, 1), s = time_shift)."},
    )
    time_shift: float = field(
        default=1.0,
        metadata={"help": "The shift s of 'uniform' noise levels: t = s u / (1 + (s - 1) u), u ~ U(0, 1) (1.0: "
                          "uniform, as Diffusion-DPO's uniform timesteps; 3.0 favours high noise as SD3's training). "
                          "'logit_normal' levels go through the scheduler's shift instead, as the references draw "
                          "them."},
    )

    # ---- online rollouts and evaluation ----------------------------------------------------------------
    sampler: str = field(
        default="dpmpp_2m",
        metadata={"help": "Deterministic solver of the online rollouts and of evaluation: 'dpmpp_2m' or 'euler'."},
    )
    guidance_scale: float | None = field(
        default=None,
        metadata={"help": "CFG scale of the online rollouts (1.0: one forward per step; flow_grpo samples at 4.5); "
                          "the trained and reference velocities use train_guidance_scale. Unset: CFG-free (the "
                          "family's no-guidance value; a guidance embedding keeps the model's value)."},
    )

    # ---- optimisation --------------------------------------------------------------------------------
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate of the LoRA."})

    _trainer_name = "DiffusionDPOTrainer"
    _cfg_free_rollouts = "DiffusionDPOConfig: CFG-free rollouts"

    def _check_algorithm(self) -> None:
        check_choice("dpo_mode", self.dpo_mode, DPO_MODES)
        check_choice("dpo_rollout_policy", self.dpo_rollout_policy, DPO_ROLLOUT_POLICIES)
        check_choice("sampler", self.sampler, DPO_SAMPLERS)
        check_choice("dpo_timestep_distribution", self.dpo_timestep_distribution, DPO_TIMESTEP_DISTRIBUTIONS)
        self._check_train_guidance()
        if not self.beta_dpo > 0:
            raise ValueError(f"beta_dpo={self.beta_dpo} must be > 0 (the flow-matching references: 100; "
                             "Diffusion-DPO's epsilon-prediction runs: 5000).")
        draws = self.dpo_num_noise_draws
        if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
            raise ValueError(f"dpo_num_noise_draws={draws!r} must be an integer >= 1 (fresh (t, eps) draws per pair "
                             "per step; flow_grpo: 39).")
        if not self.time_shift > 0:
            raise ValueError(f"time_shift={self.time_shift} must be > 0 (1.0: uniform noise levels).")
        if self.regularizer == "gardo":
            raise ValueError("regularizer='gardo' gates a KL penalty to the reference, and Diffusion-DPO's loss has "
                             "none (its reference enters the preference margin); leave regularizer unset, or use "
                             "GARDO with flow_grpo, diffusion_nft or awm.")

    def _derive_generation_batch(self) -> None:
        if self.dpo_mode == "offline":
            # Offline, a generation batch holds preference pairs, each once: the group size does not apply.
            groups = self.num_generations
            self.num_generations = 1
            try:
                super()._derive_generation_batch()
            finally:
                self.num_generations = groups
            return
        super()._derive_generation_batch()
        if self.per_device_train_batch_size % self.num_generations:
            raise ValueError(f"dpo_mode='online' pairs each group's best and worst image within a micro-batch: "
                             f"per_device_train_batch_size={self.per_device_train_batch_size} must be a multiple of "
                             f"num_generations={self.num_generations}.")


# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
def describe_dpo(args: DiffusionDPOConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """Diffusion-DPO's facts: preference pairs from data (offline) or from each group's best and worst rollout,
    kept as clean latents; dpo_num_noise_draws trained draws per micro-batch, each with the reference's forward."""
    offline = args.dpo_mode != "online"
    return AlgorithmFacts(
        copies=(),
        reads_reference=True,
        record=RolloutRecord("pairs" if offline else "final_sample", fields=("x0", "group_ids"),
                             loss_reads_log_probs=False),
        workers=WorkerNeeds(
            refusal=(f"dpo_mode={args.dpo_mode!r}: offline Diffusion-DPO reads its pairs and samples nothing."
                     if offline else None),
            sampled_by="reference" if args.dpo_rollout_policy == "reference" else "policy",
            staleness="a pair k steps old was sampled by the weights of k steps before; the loss compares the "
                      "policy's and the reference's errors on it, whoever sampled it.",
            switch_step=None, whole_groups=False, trainer_replay=""),
        probe=TransitionProbe("noised_sample", noise_level=0.7),
        step=PlannedStep("noised_sample", trained_timesteps=int(args.dpo_num_noise_draws),
                         frozen_forwards=("reference",), loss="velocity_mse"),
    )


SPEC = AlgorithmSpec(
    name="diffusion_dpo", title="Diffusion-DPO", config="flowgrpo.trainer.algorithms.dpo_config:DiffusionDPOConfig",
    trainer="flowgrpo.trainer.algorithms.dpo_trainer:DiffusionDPOTrainer",
    summary="Diffusion-DPO on preference pairs, offline from data or online from each group's best and worst image",
    describe=describe_dpo,
    eval_guidance_rollouts_refusal=None,  # its loss reads only the clean samples, at train_guidance_scale
)
