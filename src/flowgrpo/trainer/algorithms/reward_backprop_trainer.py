"""RewardBackpropTrainer: a differentiable reward backpropagated through the sampler (DRaFT-K, DRaFT-LV, ReFL,
AlignProp) on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Prompts* (`_generate`). A generation batch is only its prompts: each is encoded (or read from the embedding
   cache) and split in micro-batches; nothing is sampled ahead, because the rollout is the loss.
2. *The steps without gradient* (`_prepare_batch`). Each micro-batch draws its initial noise (a function of the seed,
   the micro-step and the process) and, by ``reward_backprop_mode`` (the math: `reward_backprop_loss`), the steps
   trained with gradient: DRaFT-K's last ``backprop_steps``, AlignProp's K drawn for the rollout, ReFL's step drawn
   from ``refl_step_range``, DRaFT-LV's last step. The steps before them are sampled by the rollout engine's sampler
   without gradient (Euler, ``noise_level`` 0), in eval mode, as a rollout is.
3. *The loss* (`_batch_loss`, one backward per part: DRaFT-LV one per re-noising, ReFL one more for its pretraining
   loss). The steps with gradient run with the policy in training mode, each checkpointed when
   ``backprop_checkpointing`` (only its input is kept; its forward is recomputed in the backward pass). The clean
   sample (DRaFT, AlignProp), the x0-prediction x - sigma v (ReFL, DRaFT-LV) is decoded with gradient (the decoder
   checkpointed slice by slice), scored by `RewardSet.score_with_grad` and the loss backpropagated through the
   reward, the decoder and the steps.

Under DDP a checkpointed step's forward runs on the unwrapped model (the backward recomputes it, and DDP must not see a
forward inside its backward): the last step with gradient goes through DDP's own forward, which prepares the gradient
all-reduce for the whole chain (every step's gradient reaches each weight before the one hook that reduces it).

Logged: ``loss``, ``reward``, ``reward_std``, ``rewards/<name>/mean`` and ``/std`` (the differentiable ones from the
tensors, weight-0 ones from the PIL images), ``backprop/steps`` (K of the micro-batch), ``backprop/reward_loss``,
``refl/step``, ``refl/pretrain_loss`` (with ``refl_pretrain_weight``), ``kl`` (``kl_beta > 0``), ``timing/rollout``
(the steps without gradient).
"""

from __future__ import annotations

import time
from collections import ChainMap
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ...models import family_adapter_class
from ...models.defaults import generation_card_lines
from ...rewards import RewardSet
from ...schedulers.flow_matching import noised_sample, sigma_timesteps
from ..data.condition_images import IMAGE_COLUMN, load_condition_image
from ..data.datasets import INDEX_COLUMN
from ..online_trainer import LossPart, OnlineRLTrainer
from ..rollout.images import load_images, to_pil
from ..rollout.sliced_decode import decode_in_slices
from ..rollout.strategies import FinalSampleRollout
from ..seeds import seed_for
from .reward_backprop_config import RewardBackpropConfig
from .reward_backprop_loss import (
    alignprop_backprop_steps,
    pretrain_loss,
    refl_loss,
    refl_step,
    renoised_last_state,
    reward_gradient_loss,
    unrolled_euler,
    velocity_kl,
    x0_prediction,
)

__all__ = ["RewardBackpropTrainer"]

_PAPERS = {
    "draft": {
        "title": "Directly Fine-Tuning Diffusion Models on Differentiable Rewards", "id": "2309.17400",
        "citation": ("@inproceedings{clark2024draft,\n  title={Directly Fine-Tuning Diffusion Models on Differentiable "
                     "Rewards},\n  author={Clark, Kevin and Vicol, Paul and Swersky, Kevin and Fleet, David J},\n  "
                     "booktitle={ICLR},\n  year={2024}\n}"),
    },
    "refl": {
        "title": "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image Generation",
        "id": "2304.05977",
        "citation": ("@inproceedings{xu2023imagereward,\n  title={ImageReward: Learning and Evaluating Human Preferences "
                     "for Text-to-Image Generation},\n  author={Xu, Jiazheng and Liu, Xiao and Wu, Yuchen and Tong, "
                     "Yuxuan and Li, Qinkai and Ding, Ming and Tang, Jie and Dong, Yuxiao},\n  booktitle={NeurIPS},\n"
                     "  year={2023}\n}"),
    },
    "alignprop": {
        "title": "Aligning Text-to-Image Diffusion Models with Reward Backpropagation", "id": "2310.03739",
        "citation": ("@article{prabhudesai2023alignprop,\n  title={Aligning Text-to-Image Diffusion Models with Reward "
                     "Backpropagation},\n  author={Prabhudesai, Mihir and Goyal, Anirudh and Pathak, Deepak and "
                     "Fragkiadaki, Katerina},\n  journal={arXiv preprint arXiv:2310.03739},\n  year={2023}\n}"),
    },
}
_MODE_NAMES = {"draft": "DRaFT-K", "draft_lv": "DRaFT-LV", "refl": "ReFL", "alignprop": "AlignProp"}


class RewardBackpropTrainer(OnlineRLTrainer):
    """A differentiable reward backpropagated through the sampler's last steps (see the module docstring and
    `OnlineRLTrainer` for the arguments; ``args``: a ``RewardBackpropConfig``; ``reward_funcs``: differentiable rewards,
    or weight-0 ones that are only logged)."""

    _tag_names = ["reward-backprop", "draft", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "Reward-Backprop"
    _config_class = RewardBackpropConfig

    @property
    def _paper(self) -> dict[str, str]:
        """The paper of the mode (DRaFT for both DRaFT modes)."""
        return _PAPERS.get(self.args.reward_backprop_mode, _PAPERS["draft"])

    # ------------------------------------------------------------------------------------------------
    # checks before anything is loaded
    # ------------------------------------------------------------------------------------------------
    def _check_rewards(self, args: RewardBackpropConfig, rewards: RewardSet) -> None:
        """Only rewards that give a gradient are trained on: the others (of non-zero weight) are refused by name with
        the reason (`RewardSet.require_differentiable`)."""
        rewards.require_differentiable(f"trainer: reward_backprop ({args.reward_backprop_mode})")
        logged = [(fn, name) for fn, name, weight in zip(rewards.funcs, rewards.names, rewards.weights) if weight == 0]
        #: the weight-0 rewards, scored on the PIL images for the logs only
        self._logged_rewards = RewardSet([fn for fn, _ in logged], [name for _, name in logged],
                                         [0.0] * len(logged)) if logged else None

    def _check_datasets(self, index: dict | None, args: RewardBackpropConfig, datasets: tuple) -> None:
        if index and "_class_name" in index:
            adapter_class = family_adapter_class(index["_class_name"])
            if adapter_class.is_video:
                raise ValueError(f"trainer: reward_backprop scores decoded images with gradient, and "
                                 f"{index['_class_name']} generates videos; train it with a policy-gradient trainer "
                                 "(flow_grpo, diffusion_nft, ...).")
            if args.uses_pretrain_loss and not adapter_class.encodes_images:
                raise ValueError(f"refl_pretrain_weight={args.refl_pretrain_weight} encodes the dataset's images to "
                                 f"training latents, which {index['_class_name']} does not support here (SD3 and "
                                 "FLUX.1 do); set refl_pretrain_weight: 0.")
        if not args.uses_pretrain_loss:
            return
        train = datasets[0]
        column = args.refl_pretrain_column
        if train is None or len(train) == 0 or column not in train[0]:
            columns = [] if train is None or len(train) == 0 else [k for k in train[0] if not k.startswith("_")]
            raise ValueError(f"refl_pretrain_weight={args.refl_pretrain_weight} trains on the images of the train "
                             f"dataset's '{column}' column, which it does not have (columns: {columns}); add it (image "
                             "paths, PIL images or datasets.Image values), set refl_pretrain_column, or set "
                             "refl_pretrain_weight: 0.")
        load_condition_image(train[0][column])

    def _rollout_strategy(self, args: RewardBackpropConfig) -> FinalSampleRollout:
        """The engine's strategy (its scheduler options, the evaluation's sampler): Euler; training rollouts run in the
        loss (`_prepare_batch`, `_batch_loss`)."""
        return FinalSampleRollout(args, "euler")

    # ------------------------------------------------------------------------------------------------
    # a generation batch: its prompts, encoded
    # ------------------------------------------------------------------------------------------------
    def _generate(self, inputs: list[dict]) -> list[dict]:
        """This process's share of a generation batch as records of prompts: their embeddings, the dataset's other
        columns for the rewards and, for ReFL's pretraining loss, the latents of the rows' images."""
        args = self.args
        height, width = args.image_size
        prompts = [row["prompt"] for row in inputs]
        columns = {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", INDEX_COLUMN)}
        if IMAGE_COLUMN in columns:
            columns[IMAGE_COLUMN] = load_images(columns[IMAGE_COLUMN])
        pretrain = columns.pop(args.refl_pretrain_column, None) if args.uses_pretrain_loss else None
        micro = args.per_device_train_batch_size
        tic = time.perf_counter()
        records = []
        with self.policy.generation_context():
            unique, rows = self.rollouts.encode_unique(prompts, columns.get(IMAGE_COLUMN), args.guidance_scale)
            embeds = unique.index_select(rows)
            for start in range(0, len(prompts), micro):
                part = slice(start, start + micro)
                record = {"embeds": embeds[part], "prompts": prompts[part],
                          "columns": {k: v[part] for k, v in columns.items()}}
                if pretrain is not None:
                    images = [load_condition_image(value) for value in pretrain[part]]
                    record["pretrain_x0"] = self.policy.adapter.encode_images(images, height, width,
                                                                              self.accelerator.device)
                records.append(record)
        self.metrics.train["timing/sampling"].append(time.perf_counter() - tic)
        return records

    # ------------------------------------------------------------------------------------------------
    # the steps without gradient, and each micro-batch's draws
    # ------------------------------------------------------------------------------------------------
    def _prepare_batch(self, record: dict) -> dict:
        """The micro-batch's draws (functions of the seed, the micro-step and the process: exact on resume) and the
        state its steps with gradient start from, sampled without gradient: ``start`` (the first step with gradient),
        ``state`` (the state at level ``sigmas[start]``; DRaFT-LV: the final sample) and the schedule."""
        args = self.args
        device = self.accelerator.device
        height, width = args.image_size
        adapter = self.policy.adapter
        steps = int(args.num_inference_steps)
        batch = len(record["prompts"])
        gen = torch.Generator().manual_seed(seed_for(args.seed, 5273, self._micro_step, self.accelerator.process_index))
        scheduler = self.rollouts.scheduler
        adapter.set_timesteps(scheduler, steps, height, width, device)
        sigmas = scheduler.sigmas.to(device=device, dtype=torch.float32)
        timesteps = scheduler.timesteps.to(device)
        mode = args.reward_backprop_mode
        if mode == "draft":
            start = steps - args.backprop_steps
        elif mode == "alignprop":
            start = steps - alignprop_backprop_steps(steps, args.alignprop_truncation, args.backprop_steps,
                                                     args.alignprop_truncation_std, gen)
        elif mode == "refl":
            start = refl_step(args.refl_step_range, gen)
        else:  # draft_lv: the whole trajectory without gradient
            start = steps
        state = adapter.prepare_latents(batch, height, width, gen, device, torch.float32)
        drawn: dict[str, Any] = {"record": record, "start": start, "sigmas": sigmas, "timesteps": timesteps}
        if mode == "draft_lv":
            drawn["lv_noise"] = [torch.randn(state.shape, generator=gen, dtype=torch.float32).to(device)
                                 for _ in range(args.lv_draws)]
        if args.uses_pretrain_loss:
            x0 = record["pretrain_x0"]
            drawn["pretrain_sigma"] = torch.rand(x0.shape[0], generator=gen, dtype=torch.float32).to(device)
            drawn["pretrain_noise"] = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device)
        tic = time.perf_counter()
        if start > 0:
            with self.policy.generation_context() as model:
                state, _ = self.rollouts.sample(model, record["embeds"], steps, args.guidance_scale, 0.0, (0, 0), None,
                                                record=False, steps=(0, start), initial_latents=state)
        self.metrics.train["timing/rollout"].append(time.perf_counter() - tic)
        drawn["state"] = state.detach()
        return ChainMap(drawn, record)

    def _loss_parts(self, batch: dict) -> int:
        """DRaFT-LV: one backward per re-noising; ReFL with its pretraining loss: two; else one."""
        if self.args.reward_backprop_mode == "draft_lv":
            return self.args.lv_draws
        return 1 + int(self.args.uses_pretrain_loss)

    # ------------------------------------------------------------------------------------------------
    # the steps with gradient, the decoder, the reward
    # ------------------------------------------------------------------------------------------------
    def _batch_loss(self, model, batch: dict, part: int, first_pass: bool) -> LossPart:
        args = self.args
        if args.uses_pretrain_loss and part == 1:
            return self._pretrain_part(model, batch)
        mode = args.reward_backprop_mode
        sigmas, timesteps, steps = batch["sigmas"], batch["timesteps"], int(args.num_inference_steps)
        kls: list[torch.Tensor] = []
        if mode in ("draft", "alignprop"):
            start = batch["start"]
            velocity = self._step_velocity(model, batch, last=steps - 1, kls=kls)
            final = self.policy.adapter.final_latents(unrolled_euler(velocity, batch["state"], sigmas, start, steps),
                                                      batch["embeds"])
            trained = steps - start
        elif mode == "refl":
            m = batch["start"]
            v = self._step_velocity(model, batch, last=m, kls=kls)(batch["state"], m)
            final = x0_prediction(batch["state"], v, sigmas[m])
            trained = 1
        else:  # draft_lv: draw ``part`` re-noises the final sample to the last level
            level = steps - 1
            state = renoised_last_state(batch["state"], batch["lv_noise"][part], sigmas[level])
            v = self._step_velocity(model, batch, last=level, kls=kls)(state, level)
            final = x0_prediction(state, v, sigmas[level])
            trained = 1
        images = self._decode(final)
        scores = self.reward_set.score_with_grad(batch["prompts"], images, **batch["columns"])
        kl = torch.stack(kls).mean() if kls else None
        if mode == "refl":
            out = refl_loss(scores.total, scores.valid, args.refl_loss, args.refl_target, args.loss_scale, kl=kl,
                            kl_beta=args.kl_beta)
        else:
            out = reward_gradient_loss(scores.total, scores.valid, args.loss_scale, kl=kl, kl_beta=args.kl_beta)
        metrics = {"backprop/steps": float(trained), "backprop/reward_loss": float(out.reward_loss)}
        if mode == "refl":
            metrics["refl/step"] = float(batch["start"])
        if out.kl is not None:
            metrics["kl"] = float(out.kl)
        self._log_rewards(scores, images, batch)
        # the health guards' KL probe reads the clean sample and the schedule of the generation's first record
        record = batch["record"]
        record.update({"x0": final.detach(), "sigmas": sigmas[:-1].expand(final.shape[0], -1),
                       "timesteps": timesteps.expand(final.shape[0], -1)})
        # a loss of several parts: each part's own weight (the trainer divides by the number of parts)
        weight = self._loss_parts(batch) if args.uses_pretrain_loss else 1
        return LossPart(out.loss * weight, metrics)

    def _step_velocity(self, model, batch: dict, last: int, kls: list[torch.Tensor]):
        """``velocity(x, i)`` of the policy at step ``i`` with gradient (and, with ``kl_beta``, the base's at the same
        state into ``kls``): checkpointed when ``backprop_checkpointing``, on the unwrapped model for every step but
        ``last`` when the model is wrapped (DDP's forward must not run inside its backward; its own forward on the
        last step prepares the all-reduce of the whole chain)."""
        args = self.args
        policy = self.policy
        height, width = args.image_size
        embeds, timesteps = batch["embeds"], batch["timesteps"]
        inner = self.accelerator.unwrap_model(model)

        def forward(net, x: torch.Tensor, i: int) -> torch.Tensor:
            with self.accelerator.autocast():
                return policy.velocity(net, x, timesteps[i].expand(x.shape[0]), embeds, args.guidance_scale, height,
                                       width)

        def velocity(x: torch.Tensor, i: int) -> torch.Tensor:
            if args.kl_beta > 0:
                with self.accelerator.autocast():
                    v_ref = policy.reference_velocity(model, x.detach(), timesteps[i].expand(x.shape[0]), embeds,
                                                      height, width)
            wrapped = inner is not model
            if args.backprop_checkpointing and not (wrapped and i == last):
                v = checkpoint(forward, inner, x, i, use_reentrant=False)
            else:
                v = forward(model, x, i)
            if args.kl_beta > 0:
                kls.append(velocity_kl(v, v_ref))
            return v

        return velocity

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        """The latents decoded with gradient to images ``(N, 3, H, W)`` in [0, 1], in slices of
        ``vae_decode_batch_size``, each checkpointed when ``backprop_checkpointing``."""
        args = self.args
        height, width = args.image_size
        adapter = self.policy.adapter
        dtype = self.policy.dtype

        def decode(z: torch.Tensor, h: int, w: int) -> torch.Tensor:
            with self.accelerator.autocast():
                return adapter.decode(z.to(dtype), h, w).float()

        if args.backprop_checkpointing:
            def sliced(z, h, w):
                return checkpoint(decode, z, h, w, use_reentrant=False)
        else:
            sliced = decode
        return decode_in_slices(sliced, latents, height, width, args.vae_decode_batch_size)

    def _pretrain_part(self, model, batch: dict) -> LossPart:
        """ReFL's pretraining loss on the rows' own images: the flow-matching regression at a noise level drawn
        uniformly per image, with the conditional velocity (no guidance), times ``refl_pretrain_weight``."""
        args = self.args
        height, width = args.image_size
        x0, noise, sigma = batch["pretrain_x0"], batch["pretrain_noise"], batch["pretrain_sigma"]
        x_s = noised_sample(x0, noise, sigma)
        t = sigma_timesteps(sigma, self.rollouts.scheduler.config.num_train_timesteps)
        with self.accelerator.autocast():
            v = self.policy.velocity(model, x_s, t, batch["embeds"], self.policy.adapter.cfg_off_value, height, width)
        loss = pretrain_loss(v, noise, x0)
        return LossPart(loss * args.refl_pretrain_weight * self._loss_parts(batch),
                        {"refl/pretrain_loss": float(loss.detach())})

    def _log_rewards(self, scores, images: torch.Tensor, batch: dict) -> None:
        """The rewards of the micro-batch, gathered from every process: the weighted total and each reward's mean and
        std (the weight-0 rewards scored on the PIL images), and the first images for the image logs."""
        m = self.metrics.train
        gather = self.accelerator.gather
        total = gather(scores.total.detach().float())
        valid = total[torch.isfinite(total)]
        m["reward"].append(float(valid.mean()) if valid.numel() else float("nan"))
        m["reward_std"].append(float(valid.std(unbiased=False)) if valid.numel() else float("nan"))
        per_reward = {name: values.detach().float() for name, values in scores.per_reward.items()}
        pil = to_pil(images.detach())
        if self._logged_rewards is not None:
            result = self._logged_rewards(batch["prompts"], pil, **batch["columns"])
            for name, values in result.per_reward.items():
                per_reward[name] = torch.tensor([float("nan") if v is None else float(v) for v in values],
                                                device=images.device)
        for name, values in per_reward.items():
            gathered = gather(values)
            gathered = gathered[torch.isfinite(gathered)]
            m[f"rewards/{name}/mean"].append(float(gathered.mean()) if gathered.numel() else float("nan"))
            m[f"rewards/{name}/std"].append(float(gathered.std(unbiased=False)) if gathered.numel() else float("nan"))
        shown = self.args.num_log_images
        self.rollouts.last_samples = (pil[:shown], list(batch["prompts"][:shown]),
                                      scores.total.detach().float().cpu().tolist()[:shown])

    def _on_optimizer_step_end(self, step: int) -> None:
        """With ``reward_offload``, the reward models go back to the CPU once their backward pass is done."""
        if self.args.reward_offload:
            self.reward_set.offload_rewards()

    # ------------------------------------------------------------------------------------------------
    # model card
    # ------------------------------------------------------------------------------------------------
    def _card_setup_lines(self) -> list[str]:
        args = self.args
        mode = args.reward_backprop_mode
        what = {
            "draft": f"the last {args.backprop_steps} of {args.num_inference_steps} Euler steps with gradient",
            "draft_lv": f"the last step with gradient, {args.lv_draws} re-noisings of each sample",
            "refl": f"one step with gradient drawn from {args.refl_step_range}, its x0-prediction scored, "
                    f"{args.refl_loss} loss (target {args.refl_target:g})"
                    + (f", pretraining loss x {args.refl_pretrain_weight:g}" if args.uses_pretrain_loss else ""),
            "alignprop": f"K drawn per rollout ({args.alignprop_truncation}, backprop_steps {args.backprop_steps})",
        }[mode]
        return [
            f"- algorithm: {_MODE_NAMES[mode]} (reward_backprop_mode={mode}): {what}; the reward's gradient through "
            f"the decoder and the sampler{', checkpointed step by step' if args.backprop_checkpointing else ''}",
            f"- {args.num_inference_steps} sampling steps, guidance {args.guidance_scale}, {args.height}x{args.width}",
            *generation_card_lines(self),
            f"- loss scale {args.loss_scale:g}, KL to the base kl_beta {args.kl_beta:g}, learning rate "
            f"{args.learning_rate}",
        ]
