"""A thin TRL-shaped base class over ``transformers.Trainer`` for diffusion pipelines.

TRL's private base trainer reads ``model.config.model_type`` for telemetry and writes a text-generation model
card; neither fits diffusers models. This class keeps TRL's shape (``_tag_names``, ``_name``, ``_paper``,
``create_model_card``) with a model card for diffusers LoRAs, and makes the Hub uploads of ``Trainer``
(``push_to_hub()`` and ``hub_strategy="every_save"``) carry the diffusers LoRA, the card and its sample images.
Every trainer built on it is crash-safe (`crash_safety.CrashSafeTrainerMixin`): atomic checkpoints, resume from
the newest complete one, preemption signals, the non-finite step guard.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import Trainer
from transformers.trainer_utils import HubStrategy

from .run_state.crash_safety import CrashSafeTrainerMixin


class FlowBaseTrainer(CrashSafeTrainerMixin, Trainer):
    _tag_names: list[str] = []
    _name: str = ""
    _paper: dict[str, str] = {}

    #: filled by subclasses: the base model id, the reward names, the last evaluation's scores and images
    _card_base_model: str | None = None
    _card_rewards: list[str] = []
    _last_eval: dict | None = None
    #: the Hub task of the card, and the second expert's LoRA file of a two-expert pipeline
    _card_pipeline_tag: str = "text-to-image"
    _card_second_expert_lora: str | None = None

    def _card_extra_sections(self) -> str:
        """Subclasses add the training setup and evaluation scores here (markdown)."""
        return ""

    def _card_repo_id(self) -> str:
        """Where the card's snippet loads from: the Hub repo when there is one, else the output folder."""
        return getattr(self, "hub_model_id", None) or self.args.hub_model_id or str(self.args.output_dir)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, license: str | None = None, **kwargs) -> None:
        """Write ``README.md`` (and ``images/``) in ``output_dir``: a diffusers model card with a
        ``load_lora_weights`` snippet, the rewards, the training setup, and the last evaluation's scores and
        samples. ``model_name`` and other keyword arguments of ``Trainer.create_model_card`` are accepted."""
        if not self.is_world_process_zero():
            return
        from .outputs.hub import write_card_images
        from .outputs.model_card import card_tag, render_model_card

        output_dir = self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        is_lora = bool(getattr(self, "is_peft", True))
        extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
        tag_list = [t for t in self._tag_names if is_lora or t != "lora"]
        tag_list += [card_tag(r) for r in self._card_rewards] + extra_tags
        last_eval = self._last_eval
        samples, sheet = write_card_images(output_dir, last_eval)
        card = render_model_card(
            repo_id=self._card_repo_id(), base_model=self._card_base_model, rewards=list(self._card_rewards),
            tags=tag_list, trainer_name=self._name or "Flow-GRPO", paper=self._paper, dataset_name=dataset_name,
            extra_sections=self._card_extra_sections(), samples=samples, contact_sheet=sheet,
            metrics=(last_eval or {}).get("metrics"), is_lora=is_lora, license=license,
            pipeline_tag=self._card_pipeline_tag, second_expert_lora=self._card_second_expert_lora,
        )
        Path(output_dir, "README.md").write_text(card, encoding="utf-8")

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """``hub_strategy`` pushes after each save: also bring the diffusers export and a fresh model card into
        ``output_dir``, which ``Trainer`` then uploads (its own copy list only knows transformers/peft files)."""
        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        in_progress = getattr(self, "push_in_progress", None)
        if not self.args.hub_always_push and in_progress is not None and not in_progress.is_done():
            return  # Trainer skips this push too; do not touch files an upload may be reading
        from .outputs.hub import copy_checkpoint_exports

        copy_checkpoint_exports(checkpoint_folder, self.args.output_dir)
        self.create_model_card()
        super()._push_from_checkpoint(checkpoint_folder)
