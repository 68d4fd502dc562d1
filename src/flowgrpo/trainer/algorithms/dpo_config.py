"""DiffusionDPOConfig: the settings of flow-matching Diffusion-DPO, as a `transformers.TrainingArguments` subclass.

The settings every online-RL trainer shares are those of `OnlineRLConfig`; this class adds Diffusion-DPO's own
(Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization", in its flow-matching form): where
the preference pairs come from (``dpo_mode``: a preference dataset, or each group's best and worst rollout),
``beta_dpo``, the noise levels of the loss (``time_shift``) and the deterministic ``sampler`` of the online rollouts
and of evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..online_config import OnlineRLConfig, check_choice

DPO_MODES = ("offline", "online")
DPO_SAMPLERS = ("dpmpp_2m", "euler")
#: the image columns of an offline preference dataset
CHOSEN_COLUMN, REJECTED_COLUMN = "chosen", "rejected"

__all__ = ["CHOSEN_COLUMN", "DPO_MODES", "DPO_SAMPLERS", "REJECTED_COLUMN", "DiffusionDPOConfig"]


@dataclass
class DiffusionDPOConfig(OnlineRLConfig):
    r"""Configuration for [`DiffusionDPOTrainer`]: the shared settings of [`OnlineRLConfig`] plus the preference pairs
    and the DPO loss (the math: ``algorithms/dpo_loss.py``)."""

    dpo_mode: str = field(
        default="online",
        metadata={"help": "'offline': pairs from the train dataset's 'prompt', 'chosen' and 'rejected' columns (image "
                          "paths, PIL images or datasets.Image values, Pick-a-Pic style); no rollouts and no rewards "
                          "during training (rewards score evaluation only). 'online': each group of num_generations "
                          "rollouts gives one pair, its best and its worst image by the rewards (groups whose "
                          "images all score the same give none)."},
    )
    beta_dpo: float = field(
        default=5000.0,
        metadata={"help": "Diffusion-DPO's beta: L = -log sigmoid(-beta_dpo / 2 ((e_w - e_w_ref) - (e_l - e_l_ref))) "
                          "with e the per-pixel mean flow-matching error (Diffusion-DPO: 5000 for SD1.5, 2500 for "
                          "SDXL)."},
    )
    time_shift: float = field(
        default=1.0,
        metadata={"help": "The loss's noise level per pair: t = s u / (1 + (s - 1) u), u ~ U(0, 1) (1.0: uniform, "
                          "as Diffusion-DPO's uniform timesteps; 3.0 favours high noise as SD3's training)."},
    )
    sampler: str = field(
        default="dpmpp_2m",
        metadata={"help": "Deterministic solver of the online rollouts and of evaluation: 'dpmpp_2m' or 'euler'."},
    )
    guidance_scale: float | None = field(
        default=None,
        metadata={"help": "CFG scale of online rollouts and of the trained velocity (1.0: one forward per step). "
                          "Unset: CFG-free (the family's no-guidance value; a guidance embedding keeps the model's "
                          "value)."},
    )
    learning_rate: float = field(default=1e-4, metadata={"help": "AdamW learning rate of the LoRA."})

    _trainer_name = "DiffusionDPOTrainer"
    _cfg_free_rollouts = "DiffusionDPOConfig: CFG-free rollouts"

    def _check_algorithm(self) -> None:
        check_choice("dpo_mode", self.dpo_mode, DPO_MODES)
        check_choice("sampler", self.sampler, DPO_SAMPLERS)
        if not self.beta_dpo > 0:
            raise ValueError(f"beta_dpo={self.beta_dpo} must be > 0 (Diffusion-DPO: 5000 for SD1.5, 2500 for SDXL).")
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
