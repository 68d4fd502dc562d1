"""DiffusionDPOTrainer: Diffusion-DPO (flow-matching form) on ``transformers.Trainer``, offline or online.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Pairs.* ``dpo_mode="offline"``: the generation batch is rows of the train dataset, each a prompt with its
   ``chosen`` and ``rejected`` images (paths, PIL images or ``datasets.Image`` values, read by the source-image loader
   of ``data/condition_images.py``), encoded by the VAE to clean latents; no rollout, no reward. ``dpo_mode="online"``:
   groups of G rollouts per prompt as in Flow-GRPO, sampled with the deterministic ``sampler`` and scored in the
   background (`OnlineRLTrainer`); each group gives one pair, its best and its worst image by the advantages (the
   reward order within a group), none when all its images score the same.
2. *Loss.* Each pair shares one noise level t (``time_shift``) and one noise eps; one batched forward of the policy
   and one of the reference (the frozen base: LoRA disabled, or a frozen copy for full fine-tuning) on the pair's two
   points give the flow-matching errors, and `dpo_loss` the loss (the math is there); one backward per micro-batch.

Logged besides the shared keys: ``dpo/accuracy`` (pairs preferred the right way relative to the reference),
``dpo/inside`` (the mean preference logit), ``dpo/error_w``, ``dpo/error_l`` (the policy's flow-matching errors),
``dpo/pairs`` (pairs in the micro-batch).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from ...models import PromptEmbeds, family_adapter_class
from ...models.defaults import generation_card_lines
from ..data.condition_images import load_condition_image
from ..data.sampler import RepeatSampler
from ..online_trainer import OnlineRLTrainer, _seed_for
from .dpo_config import CHOSEN_COLUMN, REJECTED_COLUMN, DiffusionDPOConfig
from .dpo_loss import dpo_loss
from .flow_matching import flow_matching_error, noised_sample, sigma_timesteps

__all__ = ["DiffusionDPOTrainer"]


def _load_column(rows: list[dict], column: str) -> list:
    images = []
    for row in rows:
        try:
            images.append(load_condition_image(row[column]))
        except (TypeError, ValueError) as err:
            raise type(err)(f"column '{column}' of the preference dataset: {err}") from None
    return images


class DiffusionDPOTrainer(OnlineRLTrainer):
    """Diffusion-DPO of a flow-matching pipeline, on preference pairs or on each group's best and worst rollout; the
    constructor is `FlowGRPOTrainer`'s (``args``: a ``DiffusionDPOConfig``; offline, ``reward_funcs`` score the
    evaluation only)."""

    _tag_names = ["diffusion-dpo", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "Diffusion-DPO"
    _paper = {
        "title": "Diffusion Model Alignment Using Direct Preference Optimization",
        "id": "2311.12908",
        "citation": (
            "@article{wallace2023diffusiondpo,\n  title={Diffusion Model Alignment Using Direct Preference "
            "Optimization},\n  author={Wallace, Bram and Dang, Meihua and Rafailov, Rafael and Zhou, Linqi and Lou, "
            "Aaron and Purushwalkam, Senthil and Ermon, Stefano and Xiong, Caiming and Joty, Shafiq and Naik, "
            "Nikhil},\n  journal={arXiv preprint arXiv:2311.12908},\n  year={2023}\n}"
        ),
    }
    _config_class = DiffusionDPOConfig

    # ------------------------------------------------------------------------------------------------
    # set-up: the offline dataset's columns and the family's image encoder, checked before loading
    # ------------------------------------------------------------------------------------------------
    def _check_family_settings(self, index: dict | None, args: DiffusionDPOConfig, peft_config: Any,
                               datasets: tuple) -> None:
        super()._check_family_settings(index, args, peft_config, datasets)
        if args.dpo_mode != "offline":
            return
        train = datasets[0]
        if train is None:
            raise ValueError("dpo_mode='offline' trains on a preference dataset: pass a train_dataset with 'prompt', "
                             f"'{CHOSEN_COLUMN}' and '{REJECTED_COLUMN}' columns.")
        first = train[0]
        missing = [c for c in (CHOSEN_COLUMN, REJECTED_COLUMN) if c not in first]
        if missing:
            raise ValueError(f"dpo_mode='offline' needs '{CHOSEN_COLUMN}' and '{REJECTED_COLUMN}' image columns in "
                             f"train_dataset; it has no {missing} (columns: "
                             f"{[k for k in first if not k.startswith('_')]}). Add them (image paths, PIL images or "
                             "datasets.Image values), or use dpo_mode='online'.")
        load_condition_image(first[CHOSEN_COLUMN])
        if index and "_class_name" in index and not family_adapter_class(index["_class_name"]).encodes_images:
            raise ValueError(f"dpo_mode='offline' encodes the preference images to training latents, which "
                             f"{index['_class_name']} does not support here (SD3 and FLUX.1 do); use "
                             "dpo_mode='online'.")

    def _needs_reference(self, args: DiffusionDPOConfig) -> bool:
        return True  # the loss compares the policy's errors with the reference's

    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _get_train_sampler(self, train_dataset=None):
        if self.args.dpo_mode == "online":
            return super()._get_train_sampler(train_dataset)
        args = self.args  # offline: each pair once per generation batch
        return RepeatSampler(train_dataset if train_dataset is not None else self.train_dataset, num_generations=1,
                             prompts_per_generation=args.generation_batch_size,
                             repeat_count=args.num_iterations * args.steps_per_generation, shuffle=True,
                             seed=args.seed)

    # ------------------------------------------------------------------------------------------------
    # the pairs: read from the dataset (offline) or sampled and scored (online)
    # ------------------------------------------------------------------------------------------------
    def _generate_and_score(self, inputs: list[dict]) -> list[dict]:
        if self.args.dpo_mode == "online":
            return super()._generate_and_score(inputs)
        args = self.args
        device = self.accelerator.device
        height, width = args.image_size
        prompts = [row["prompt"] for row in inputs]
        micro = args.per_device_train_batch_size
        tic = time.perf_counter()
        records = []
        with self._generation_context():
            unique, rows = self._encode_unique(prompts, device)
            embeds = unique.index_select(rows)
            for start in range(0, len(prompts), micro):
                chunk = inputs[start:start + micro]
                records.append({
                    "embeds": embeds[start:start + micro],
                    "x0_w": self.adapter.encode_images(_load_column(chunk, CHOSEN_COLUMN), height, width, device),
                    "x0_l": self.adapter.encode_images(_load_column(chunk, REJECTED_COLUMN), height, width, device),
                })
        self._metrics["train"]["timing/sampling"].append(time.perf_counter() - tic)
        return records

    def _rollout(self, model, embeds: PromptEmbeds, plan: Any, generator: torch.Generator, progress,
                 group_ids: torch.Tensor, gen_index: int) -> tuple[torch.Tensor, dict]:
        final, record = self._final_sample_rollout(model, embeds, generator, progress, self.args.sampler)
        record["group_ids"] = group_ids
        return final, record

    @staticmethod
    def _best_and_worst(group_ids: torch.Tensor, advantages: torch.Tensor) -> tuple[list[int], list[int]]:
        """Per group of the micro-batch (in order of first appearance): the rows of its best and worst sample, by
        advantage (the first on ties); groups whose samples all score the same give no pair."""
        rows_of: dict[int, list[int]] = defaultdict(list)
        for row, group in enumerate(group_ids.tolist()):
            rows_of[group].append(row)
        best, worst = [], []
        adv = advantages.detach().cpu()
        for rows in rows_of.values():
            values = adv[rows]
            if len(rows) < 2 or not bool(values.max() > values.min()):
                continue
            best.append(rows[int(values.argmax())])
            worst.append(rows[int(values.argmin())])
        return best, worst

    # ------------------------------------------------------------------------------------------------
    # training: the DPO loss on the pairs' flow-matching errors
    # ------------------------------------------------------------------------------------------------
    def _train_on_batch(self, model, batch: dict, first_pass: bool) -> torch.Tensor:
        args = self.args
        device = self.accelerator.device
        height, width = args.image_size
        m = self._metrics["train"]
        tic = self._clock()
        embeds: PromptEmbeds = batch["embeds"]
        weight = 1.0
        if "x0_w" in batch:  # offline
            x_w, x_l = batch["x0_w"], batch["x0_l"]
            pair_embeds = PromptEmbeds.cat([embeds, embeds])
        else:  # online: rewards are needed to pick the pairs
            tic = self._await_scoring(tic)
            best, worst = self._best_and_worst(batch["group_ids"], batch["advantages"])
            if not best:  # no group with a preference: a zero-weight pass keeps every process's backward in step
                best, worst, weight = [0], [0], 0.0
            x_w, x_l = batch["x0"][best], batch["x0"][worst]
            pair_embeds = embeds.index_select(torch.tensor(best + worst, dtype=torch.long))
        pairs = x_w.shape[0]
        # One noise level and one noise per pair, shared by its two samples: functions of the seed, the micro-step
        # and the process (exact on resume).
        gen = torch.Generator().manual_seed(_seed_for(args.seed, 4099, self._micro_step,
                                                      self.accelerator.process_index))
        u = torch.rand(pairs, generator=gen, dtype=torch.float32)
        t = (args.time_shift * u / (1 + (args.time_shift - 1) * u)).to(device)
        noise = torch.randn(x_w.shape, generator=gen, dtype=torch.float32).to(device)
        x0 = torch.cat([x_w, x_l]).float()
        eps = torch.cat([noise, noise])
        levels = torch.cat([t, t])
        x_t = noised_sample(x0, eps, levels)
        timesteps = sigma_timesteps(levels, self.sde_scheduler.config.num_train_timesteps)
        with self.accelerator.autocast():
            v = self._velocity(model, x_t, timesteps, pair_embeds, args.guidance_scale, height, width)
            v_ref = self._reference_velocity(model, x_t, timesteps, pair_embeds, height, width)
        errors = flow_matching_error(v, eps, x0)
        ref_errors = flow_matching_error(v_ref, eps, x0)
        out = dpo_loss(errors[:pairs], errors[pairs:], ref_errors[:pairs], ref_errors[pairs:], args.beta_dpo)
        loss = out.loss * weight
        scale = 1.0 / self.current_gradient_accumulation_steps
        tac = self._clock()
        self.accelerator.backward(loss * scale, **self._backward_kwargs())
        toc = self._clock()
        m["timing/training_forward"].append(tac - tic)
        m["timing/training_backward"].append(toc - tac)
        if weight > 0:
            m["dpo/accuracy"].append(float(out.accuracy))
            m["dpo/inside"].append(float(out.inside.detach().mean()))
            m["dpo/error_w"].append(float(errors[:pairs].detach().mean()))
            m["dpo/error_l"].append(float(errors[pairs:].detach().mean()))
        m["dpo/pairs"].append(float(pairs if weight > 0 else 0))
        return loss.detach() * scale

    def _card_setup_lines(self) -> list[str]:
        args = self.args
        source = ("offline preference pairs (prompt, chosen, rejected)" if args.dpo_mode == "offline" else
                  f"online pairs: the best and worst of each group of {args.num_generations} rollouts "
                  f"({args.sampler}, {args.num_inference_steps} steps)")
        return [
            f"- algorithm: {self._name} ({source}), beta_dpo {args.beta_dpo:g}, noise-level shift "
            f"{args.time_shift:g}",
            f"- guidance {args.guidance_scale}, {args.height}x{args.width}, learning rate {args.learning_rate}",
            *generation_card_lines(self),
        ]
