"""DiffusionDPOTrainer: Diffusion-DPO (flow-matching form) on ``transformers.Trainer``, offline or online.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Pairs.* ``dpo_mode="offline"``: the generation batch is rows of the train dataset, each a prompt with its
   ``chosen`` and ``rejected`` images (paths, PIL images or ``datasets.Image`` values, read by the source-image loader
   of ``data/condition_images.py``), encoded by the VAE to clean latents; no rollout, no reward. ``dpo_mode="online"``:
   groups of G rollouts per prompt as in Flow-GRPO, sampled at ``guidance_scale`` with the deterministic ``sampler``
   by the policy (or, with ``dpo_rollout_policy: reference``, by the reference, as flow_grpo's DPO samples) and
   scored in the background (`OnlineRLTrainer`); each group gives one pair, its best and its worst image by the
   advantages (the reward order within a group), none when all its images score the same.
2. *Loss.* ``dpo_num_noise_draws`` = K draws per pair, each one noise level t (``dpo_timestep_distribution``:
   logit-normal through the scheduler's shift, as the references, or uniform with ``time_shift``;
   `dpo_timesteps.py`) and one noise eps shared by the pair's two samples. Each draw is one part of the micro-batch
   (`_loss_parts`): one batched forward of the policy and one of the reference (the frozen base: LoRA disabled, or a
   frozen copy for full fine-tuning, or the refreshed copy with ``sync_ref_model``) on the pairs' 2P points, both at
   ``train_guidance_scale`` (default 1: the conditional velocity, as flow_grpo trains while it samples at CFG 4.5),
   give the flow-matching errors and `dpo_loss` the loss (the math is there); one backward per draw, each scaled by
   1 / K, so the gradient is that of the mean over the K P terms (accumulated, as flow_grpo accumulates its 39).
   With ``train_timesteps_per_pass`` > 1 that many draws share one forward of each model and one backward, their
   points stacked (`timestep_passes`); each draw's loss is unchanged.

Logged besides the shared keys (means over the draws): ``dpo/accuracy`` (pairs preferred the right way relative to
the reference), ``dpo/inside`` (the mean preference logit), ``dpo/abs_inside`` (its mean magnitude),
``dpo/gradient_weight`` (the mean sigmoid(-inside), each pair's gradient weight; 1/2 at the start, near 0 or 1 when
saturated), ``dpo/error_w``, ``dpo/error_l`` (the policy's flow-matching errors), ``dpo/pairs`` (pairs in the
micro-batch).
"""

from __future__ import annotations

import time
from collections import ChainMap, defaultdict
from typing import Any

import torch

from ...models import PromptEmbeds, family_adapter_class
from ...models.defaults import generation_card_lines
from ...schedulers.flow_matching import flow_matching_error, noised_sample, sigma_timesteps
from ..data.condition_images import load_condition_image
from ..data.sampler import RepeatSampler
from ..online_trainer import LossPart, OnlineRLTrainer
from ..rollout.strategies import FinalSampleRollout
from ..seeds import seed_for
from ..timestep_passes import split_rows, stack_embeds, stack_rows
from .dpo_config import CHOSEN_COLUMN, REJECTED_COLUMN, DiffusionDPOConfig
from .dpo_loss import dpo_loss
from .dpo_timesteps import sample_dpo_sigmas, scheduler_training_shift

__all__ = ["DPORollout", "DiffusionDPOTrainer"]


def _load_column(rows: list[dict], column: str) -> list:
    images = []
    for row in rows:
        try:
            images.append(load_condition_image(row[column]))
        except (TypeError, ValueError) as err:
            raise type(err)(f"column '{column}' of the preference dataset: {err}") from None
    return images


def best_and_worst(group_ids: torch.Tensor, advantages: torch.Tensor) -> tuple[list[int], list[int]]:
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


class DPORollout(FinalSampleRollout):
    """Online Diffusion-DPO's rollout: a deterministic trajectory keeping x0 and each row's group (the pairs are
    picked within groups), sampled by the policy or, with ``dpo_rollout_policy: reference``, by the reference (the
    frozen base, or the copy ``sync_ref_model`` refreshes: flow_grpo's DPO and OnlineDPO)."""

    def __init__(self, args: DiffusionDPOConfig):
        super().__init__(args, args.sampler, record_group_ids=True)
        self.by_reference = args.dpo_rollout_policy == "reference"

    def sampling_model(self, engine: Any, model: torch.nn.Module):
        return engine.policy.reference_model(model) if self.by_reference else super().sampling_model(engine, model)


class DiffusionDPOTrainer(OnlineRLTrainer):
    """Diffusion-DPO of a flow-matching pipeline, on preference pairs or on each group's best and worst rollout (see
    `OnlineRLTrainer` for the arguments; ``args``: a ``DiffusionDPOConfig``; offline, ``reward_funcs`` score the
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
    def _check_datasets(self, index: dict | None, args: DiffusionDPOConfig, datasets: tuple) -> None:
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

    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _rollout_strategy(self, args: DiffusionDPOConfig) -> DPORollout:
        """Online: a deterministic rollout keeping x0 and each row's group, by the policy or the reference."""
        return DPORollout(args)

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
    def _generate(self, inputs: list[dict]) -> list[dict]:
        if self.args.dpo_mode == "online":
            return super()._generate(inputs)
        args = self.args
        device = self.accelerator.device
        height, width = args.image_size
        adapter = self.policy.adapter
        prompts = [row["prompt"] for row in inputs]
        micro = args.per_device_train_batch_size
        tic = time.perf_counter()
        records = []
        with self.policy.generation_context():
            unique, rows = self.rollouts.encode_unique(prompts)
            embeds = unique.index_select(rows)
            for start in range(0, len(prompts), micro):
                chunk = inputs[start:start + micro]
                records.append({
                    "embeds": embeds[start:start + micro],
                    "x0_w": adapter.encode_images(_load_column(chunk, CHOSEN_COLUMN), height, width, device),
                    "x0_l": adapter.encode_images(_load_column(chunk, REJECTED_COLUMN), height, width, device),
                })
        self.metrics.train["timing/sampling"].append(time.perf_counter() - tic)
        return records

    # ------------------------------------------------------------------------------------------------
    # training: the DPO loss on the pairs' flow-matching errors
    # ------------------------------------------------------------------------------------------------
    def _prepare_batch(self, record: dict) -> dict:
        """The pairs (offline: the record's; online: each group's best and worst rollout, once the rewards are in)
        and K = ``dpo_num_noise_draws`` draws of one noise level and one noise per pair, shared by its two samples:
        functions of the seed, the micro-step and the process (exact on resume)."""
        args = self.args
        device = self.accelerator.device
        embeds: PromptEmbeds = record["embeds"]
        weight = 1.0
        if "x0_w" in record:  # offline
            x_w, x_l = record["x0_w"], record["x0_l"]
            pair_embeds = PromptEmbeds.cat([embeds, embeds])
        else:  # online: rewards are needed to pick the pairs
            best, worst = best_and_worst(record["group_ids"], self._advantages(record))
            if not best:  # no group with a preference: a zero-weight pass keeps every process's backward in step
                best, worst, weight = [0], [0], 0.0
            x_w, x_l = record["x0"][best], record["x0"][worst]
            pair_embeds = embeds.index_select(torch.tensor(best + worst, dtype=torch.long))
        pairs, draws = x_w.shape[0], args.dpo_num_noise_draws
        gen = torch.Generator().manual_seed(seed_for(args.seed, 4099, self._micro_step, self.accelerator.process_index))
        t = self._draw_levels(draws * pairs, gen).reshape(draws, pairs).to(device)
        noise = torch.randn((draws, *x_w.shape), generator=gen, dtype=torch.float32).to(device)
        return ChainMap({"x0_pairs": torch.cat([x_w, x_l]).float(), "eps": torch.cat([noise, noise], dim=1),
                         "levels": torch.cat([t, t], dim=1), "pair_embeds": pair_embeds, "pairs": pairs,
                         "weight": weight}, record)

    def _draw_levels(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` noise levels by ``dpo_timestep_distribution``: logit-normal through the scheduler's own shift
        (SD3.5-M: 3; dynamic shifting: none), or uniform shifted by ``time_shift``."""
        args = self.args
        config = self.rollouts.scheduler.config
        logit_normal = args.dpo_timestep_distribution == "logit_normal"
        shift = scheduler_training_shift(config) if logit_normal else args.time_shift
        return sample_dpo_sigmas(args.dpo_timestep_distribution, count, shift, generator,
                                 config.num_train_timesteps)

    def _loss_parts(self, batch: dict) -> int:
        """One backward per (t, eps) draw: ``dpo_num_noise_draws``."""
        return self.args.dpo_num_noise_draws

    def _pass_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """The losses of the draws ``parts``: the policy's and the reference's forwards each run once over the draws'
        2P points stacked (`timestep_passes`); each draw's loss is `dpo_loss` of its own rows."""
        args = self.args
        height, width = args.image_size
        policy = self.policy
        pairs, weight = batch["pairs"], batch["weight"]
        x0, pair_embeds = batch["x0_pairs"], batch["pair_embeds"]
        noises = [batch["eps"][part] for part in parts]  # draw number ``part``
        levels = [batch["levels"][part] for part in parts]
        points = [noised_sample(x0, eps, level) for eps, level in zip(noises, levels)]
        num_train_timesteps = self.rollouts.scheduler.config.num_train_timesteps
        timesteps = [sigma_timesteps(level, num_train_timesteps) for level in levels]
        x_t, t = stack_rows(points), stack_rows(timesteps)
        embeds = stack_embeds(pair_embeds, [None] * len(parts))
        scale = args.training_guidance_scale  # the trained velocities' CFG, not the rollouts'
        with self.accelerator.autocast():
            v = policy.velocity(model, x_t, t, embeds, scale, height, width)
            v_ref = policy.reference_velocity(model, x_t, t, embeds, height, width, guidance_scale=scale)
        sizes = [len(point) for point in points]
        losses = []
        for velocity, reference, eps in zip(split_rows(v, sizes), split_rows(v_ref, sizes), noises):
            errors = flow_matching_error(velocity, eps, x0)
            ref_errors = flow_matching_error(reference, eps, x0)
            out = dpo_loss(errors[:pairs], errors[pairs:], ref_errors[:pairs], ref_errors[pairs:], args.beta_dpo)
            metrics: dict[str, Any] = {"dpo/pairs": float(pairs if weight > 0 else 0)}
            if weight > 0:
                metrics.update(out.metrics())
                metrics.update({"dpo/error_w": float(errors[:pairs].detach().mean()),
                                "dpo/error_l": float(errors[pairs:].detach().mean())})
            losses.append(LossPart(out.loss * weight, metrics))
        return losses

    def _card_setup_lines(self) -> list[str]:
        args = self.args
        source = ("offline preference pairs (prompt, chosen, rejected)" if args.dpo_mode == "offline" else
                  f"online pairs: the best and worst of each group of {args.num_generations} rollouts "
                  f"({args.sampler}, {args.num_inference_steps} steps, by the {args.dpo_rollout_policy})")
        levels = ("logit-normal through the scheduler's shift" if args.dpo_timestep_distribution == "logit_normal"
                  else f"uniform, shift {args.time_shift:g}")
        refresh = (f", reference refreshed every {args.ref_model_sync_steps} steps (alpha "
                   f"{args.ref_model_mixup_alpha:g})" if args.sync_ref_model else "")
        return [
            f"- algorithm: {self._name} ({source}), beta_dpo {args.beta_dpo:g}, {args.dpo_num_noise_draws} (t, eps) "
            f"draws per pair per step, noise levels {levels}{refresh}",
            f"- guidance {args.guidance_scale} (trained velocities: {args.training_guidance_scale:g}), "
            f"{args.height}x{args.width}, learning rate {args.learning_rate}",
            *generation_card_lines(self),
        ]
