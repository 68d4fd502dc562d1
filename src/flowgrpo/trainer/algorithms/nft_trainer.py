"""DiffusionNFTTrainer: DiffusionNFT (negative-aware fine-tuning on the forward process) on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout.* As in Flow-GRPO (`OnlineRLTrainer`: groups of G images per prompt, decoded and scored in the
   background, group advantages), but sampled by the *old policy* with the deterministic ``sampler`` (DPM-Solver++
   2M or Euler) at ``guidance_scale`` (1.0: CFG-free). Only each image's final latent x0 is kept, with the rollout's
   noise levels; no trajectory, no log-probability.
2. *Training.* For each micro-batch, each sample draws its own random subset of ``num_trained_timesteps =
   int(num_inference_steps * timestep_fraction)`` of the rollout's noise levels; at each, fresh noise eps gives
   x_t = (1 - sigma) x0 + sigma eps, and one forward of the old policy (no gradient), one forward and backward of the
   policy and, with ``beta > 0``, one forward of the reference give the loss of `nft_loss` (the math is there):

       r = clamp(A / adv_clip_max / 2 + 0.5, 0, 1)
       v+ = nft_beta v_theta + (1 - nft_beta) v_old,    v- = (1 + nft_beta) v_old - nft_beta v_theta
       loss = mean(adv_clip_max (r L+ + (1 - r) L-) / nft_beta) + beta mean((v_theta - v_ref)^2)
                                                                 (divided by num_trained_timesteps * grad_accum)

3. *Old policy.* After each optimizer step k: theta_old <- d theta_old + (1 - d) theta with d = `old_policy_decay`
   (k, ``old_policy_decay_start``, ``old_policy_decay_rate``, ``old_policy_decay_max``). The old policy is a second
   LoRA adapter (``"old"``) or, for full fine-tuning, a frozen copy of the transformer (`old_policy.py`); it is saved
   in every checkpoint, so a resumed run continues exactly. Exports (the diffusers LoRA, the final output folder)
   hold the trained adapter only.

Logged besides Flow-GRPO's reward and timing keys: ``loss``, ``nft/policy_loss``, ``nft/positive_loss``,
``nft/negative_loss``, ``nft/old_policy_deviation`` (mean squared distance of v_theta and v_old),
``nft/old_policy_decay`` (the d applied after the step) and, with ``beta > 0``, ``kl``. Evaluation samples with
``sampler``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...models import PromptEmbeds
from ...models.defaults import generation_card_lines
from ..online_trainer import OnlineRLTrainer, _seed_for
from ..run_state.old_policy import old_policy_decay
from .nft_config import DiffusionNFTConfig
from .nft_loss import nft_loss, noised_sample, reward_weight

__all__ = ["DiffusionNFTTrainer"]


class DiffusionNFTTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching pipeline with DiffusionNFT; the constructor is `FlowGRPOTrainer`'s.

    Args:
        model: a hub id or local folder of a diffusers pipeline, or a loaded ``DiffusionPipeline`` (SD3/SD3.5,
            FLUX.1, Qwen-Image, Wan, FLUX.1 Kontext, Qwen-Image-Edit). Its transformer is trained; everything else
            is frozen.
        reward_funcs: a registry name, a callable ``fn(prompts, images, **columns) -> list[float | None]``, a
            ``"package.module:function"`` path, or a list of those (weighted by ``args.reward_weights``).
        args: a ``DiffusionNFTConfig``.
        train_dataset / eval_dataset: a ``datasets.Dataset`` (or list of dicts / strings) with a ``prompt``
            column; other columns are passed to the rewards (editing families also need an ``image`` column).
        peft_config: a ``peft.LoraConfig`` for LoRA training (the old policy is then a second adapter); ``None``
            fine-tunes the whole transformer (the old policy is then a frozen copy of it).
        callbacks, optimizers: as in ``transformers.Trainer``.
        pipeline_kwargs: extra ``from_pretrained`` arguments (e.g. ``revision``) when ``model`` is a string.
    """

    _tag_names = ["diffusion-nft", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "DiffusionNFT"
    _paper = {
        "title": "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
        "id": "2509.16117",
        "citation": (
            "@article{zheng2025diffusionnft,\n  title={DiffusionNFT: Online Diffusion Reinforcement with Forward "
            "Process},\n  author={Zheng, Kaiwen and Chen, Huayu and Ye, Haotian and Wang, Haoxiang and Zhang, Qinsheng "
            "and Jiang, Kai and Su, Hang and Ermon, Stefano and Zhu, Jun and Liu, Ming-Yu},\n  journal={arXiv "
            "preprint arXiv:2509.16117},\n  year={2025}\n}"
        ),
    }
    _config_class = DiffusionNFTConfig

    def _uses_old_policy(self, args: DiffusionNFTConfig) -> bool:
        return True  # it samples the rollouts and gives v_old in the loss

    # ------------------------------------------------------------------------------------------------
    # rollouts: the old policy, a deterministic solver, the final latent only
    # ------------------------------------------------------------------------------------------------
    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _rollout(self, model, embeds: PromptEmbeds, plan: Any, generator: torch.Generator, progress,
                 group_ids: torch.Tensor, gen_index: int) -> tuple[torch.Tensor, dict]:
        """The old policy samples the micro-batch with ``sampler``; records x0 and the rollout's noise levels."""
        with self.old_policy.forward_model(model) as old:
            return self._final_sample_rollout(old, embeds, generator, progress, self.args.sampler)

    # ------------------------------------------------------------------------------------------------
    # training: the negative-aware loss at random noise levels of each sample
    # ------------------------------------------------------------------------------------------------
    def _train_on_batch(self, model, batch: dict, first_pass: bool) -> torch.Tensor:
        args = self.args
        device = self.accelerator.device
        height, width = args.image_size
        x0, embeds = batch["x0"], batch["embeds"]
        size, levels = batch["sigmas"].shape
        trained = min(args.num_trained_timesteps, levels)
        scale = 1.0 / (trained * self.current_gradient_accumulation_steps)
        # Timesteps and noise are functions of the seed, the micro-step and the process (exact on resume).
        gen = torch.Generator().manual_seed(_seed_for(args.seed, 6007, self._micro_step,
                                                      self.accelerator.process_index))
        order = torch.stack([torch.randperm(levels, generator=gen)[:trained] for _ in range(size)]).to(device)
        rows = torch.arange(size, device=device)
        total = torch.zeros((), device=device)
        m = self._metrics["train"]
        backward_kwargs = self._backward_kwargs()
        for j in range(trained):
            sigma = batch["sigmas"][rows, order[:, j]]
            t = batch["timesteps"][rows, order[:, j]]
            noise = torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device)
            x_t = noised_sample(x0, noise, sigma)
            with self._sync_on_last(model, j, trained):  # one backward per noise level
                tic = self._clock()
                with torch.no_grad(), self.accelerator.autocast(), self.old_policy.forward_model(model) as old:
                    v_old = self._velocity(old, x_t, t, embeds, args.guidance_scale, height, width)
                with self.accelerator.autocast():
                    v = self._velocity(model, x_t, t, embeds, args.guidance_scale, height, width)
                if j == 0:  # the rewards of the last micro-batches were scored while these forwards ran
                    tic = self._await_scoring(tic)
                    weights = reward_weight(batch["advantages"], args.adv_clip_max)
                v_ref = None
                if args.beta > 0:
                    with self.accelerator.autocast():
                        v_ref = self._reference_velocity(model, x_t, t, embeds, height, width)
                out = nft_loss(v, v_old, x0, x_t, sigma, weights, args.nft_beta, adv_clip_max=args.adv_clip_max,
                               v_ref=v_ref, beta=args.beta, kl_gate=batch.get("kl_gate"))
                tac = self._clock()
                self.accelerator.backward(out.loss * scale, **backward_kwargs)
                toc = self._clock()
                m["timing/training_forward"].append(tac - tic)
                m["timing/training_backward"].append(toc - tac)
            total += out.loss.detach() * scale
            with torch.no_grad():
                m["nft/policy_loss"].append(float(out.policy_loss))
                m["nft/positive_loss"].append(float(out.positive_loss.mean()))
                m["nft/negative_loss"].append(float(out.negative_loss.mean()))
                m["nft/old_policy_deviation"].append(float((v.detach() - v_old).square().mean()))
                if out.kl is not None:
                    m["kl"].append(float(out.kl))
        return total

    # ------------------------------------------------------------------------------------------------
    # the old policy after each optimizer step (kept, saved and restored by OnlineRLTrainer)
    # ------------------------------------------------------------------------------------------------
    def _on_optimizer_step_end(self, step: int) -> None:
        args = self.args
        decay = old_policy_decay(step, args.old_policy_decay_start, args.old_policy_decay_rate,
                                 args.old_policy_decay_max)
        self._update_old_policy(decay)
        self._metrics["train"]["nft/old_policy_decay"].append(decay)

    # ------------------------------------------------------------------------------------------------
    # model card
    # ------------------------------------------------------------------------------------------------
    def _card_setup_lines(self) -> list[str]:
        args = self.args
        return [
            f"- algorithm: {self._name} (rollouts by the old policy with {args.sampler}, "
            f"{args.num_trained_timesteps} of {args.num_inference_steps} noise levels trained per image)",
            f"- group size {args.num_generations}, {args.num_inference_steps} sampling steps, guidance "
            f"{args.guidance_scale}, {args.height}x{args.width}"
            + (f", {args.num_frames} frames" if args.num_frames > 1 else ""),
            *generation_card_lines(self),
            f"- nft_beta {args.nft_beta}, velocity penalty beta {args.beta}, advantage clip {args.adv_clip_max}, "
            f"learning rate {args.learning_rate}",
            f"- old policy: decay starts at step {args.old_policy_decay_start}, rises by "
            f"{args.old_policy_decay_rate:g} a step up to {args.old_policy_decay_max:g}",
            f"- rewards: reward_aggregation={args.reward_aggregation}, scale_rewards={args.scale_rewards}",
        ]
