"""DiffusionNFTTrainer: DiffusionNFT (negative-aware fine-tuning on the forward process) on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout.* As in Flow-GRPO (`OnlineRLTrainer`: groups of G images per prompt, decoded and scored in the
   background, group advantages), but sampled by the *old policy* with the deterministic ``sampler`` (DPM-Solver++
   2M or Euler) at ``guidance_scale`` (1.0: CFG-free). Only each image's final latent x0 is kept, with the rollout's
   noise levels; no trajectory, no log-probability.
2. *Training.* For each micro-batch, each sample draws its own random subset of ``num_trained_timesteps =
   int(num_inference_steps * timestep_fraction)`` of the rollout's noise levels; at each, fresh noise eps gives
   x_t = (1 - sigma) x0 + sigma eps, and one forward of the old policy (no gradient), one forward and backward of the
   policy and, with ``beta > 0``, one forward of the reference give the loss of `nft_loss` (the math is there;
   ``train_timesteps_per_pass`` levels share each forward and the backward, their rows stacked, `timestep_passes`):

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

from collections import ChainMap

import torch

from ...models.defaults import generation_card_lines
from ...schedulers.flow_matching import noised_sample
from ..online_trainer import LossPart, OnlineRLTrainer
from ..policy.old_policy import old_policy_decay
from ..rollout.strategies import FinalSampleRollout
from ..seeds import seed_for
from ..timestep_passes import split_rows, stack_embeds, stack_rows
from .nft_config import DiffusionNFTConfig
from .nft_loss import nft_loss, reward_weight

__all__ = ["DiffusionNFTTrainer"]


class DiffusionNFTTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching pipeline with DiffusionNFT (see `OnlineRLTrainer` for the arguments; ``args``: a
    ``DiffusionNFTConfig``; with a LoRA the old policy is a second adapter, with full fine-tuning a frozen copy)."""

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

    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _rollout_strategy(self, args: DiffusionNFTConfig) -> FinalSampleRollout:
        """The old policy samples each micro-batch with ``sampler``; the record keeps x0 and the noise levels."""
        return FinalSampleRollout(args, args.sampler, by_old_policy=True)

    # ------------------------------------------------------------------------------------------------
    # training: the negative-aware loss at random noise levels of each sample
    # ------------------------------------------------------------------------------------------------
    def _prepare_batch(self, record: dict) -> dict:
        """Each sample's trained noise levels (a random subset of the rollout's) and fresh noise for each: functions
        of the seed, the micro-step and the process (exact on resume)."""
        args = self.args
        device = self.accelerator.device
        x0 = record["x0"]
        size, levels = record["sigmas"].shape
        trained = min(args.num_trained_timesteps, levels)
        gen = torch.Generator().manual_seed(seed_for(args.seed, 6007, self._micro_step, self.data_parallel.process_index))
        order = torch.stack([torch.randperm(levels, generator=gen)[:trained] for _ in range(size)]).to(device)
        noise = [torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device) for _ in range(trained)]
        return ChainMap({"order": order, "noise": noise}, record)

    def _loss_parts(self, batch: dict) -> int:
        return len(batch["noise"])

    def _pass_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """The losses of the trained noise levels ``parts``: each forward (old policy, policy, reference) runs once over
        the levels' points stacked (`timestep_passes`); each level's loss is `nft_loss` of its own rows."""
        args = self.args
        height, width = args.image_size
        policy = self.policy
        x0, order = batch["x0"], batch["order"]
        rows = torch.arange(x0.shape[0], device=x0.device)
        sigmas = [batch["sigmas"][rows, order[:, j]] for j in parts]
        timesteps = [batch["timesteps"][rows, order[:, j]] for j in parts]
        points = [noised_sample(x0, batch["noise"][j], sigma) for j, sigma in zip(parts, sigmas)]
        x_t, t = stack_rows(points), stack_rows(timesteps)
        embeds = stack_embeds(batch["embeds"], [None] * len(parts))
        with torch.no_grad(), self.accelerator.autocast(), policy.old_policy.forward_model(model) as old:
            v_old = policy.velocity(old, x_t, t, embeds, args.guidance_scale, height, width)
        with self.accelerator.autocast():
            v = policy.velocity(model, x_t, t, embeds, args.guidance_scale, height, width)
        v_ref = None
        sizes = [len(point) for point in points]
        references = [None] * len(parts)
        if args.beta > 0:
            with self.accelerator.autocast():
                v_ref = policy.reference_velocity(model, x_t, t, embeds, height, width)
            references = split_rows(v_ref, sizes)
        losses = []
        for i, (velocity, old_velocity) in enumerate(zip(split_rows(v, sizes), split_rows(v_old, sizes))):
            weights = reward_weight(self._advantages(batch), args.adv_clip_max)  # scored while these forwards ran
            out = nft_loss(velocity, old_velocity, x0, points[i], sigmas[i], weights, args.nft_beta,
                           adv_clip_max=args.adv_clip_max, v_ref=references[i], beta=args.beta,
                           kl_gate=batch.get("kl_gate"))
            with torch.no_grad():
                metrics = {"nft/policy_loss": float(out.policy_loss),
                           "nft/positive_loss": float(out.positive_loss.mean()),
                           "nft/negative_loss": float(out.negative_loss.mean()),
                           "nft/old_policy_deviation": float((velocity.detach() - old_velocity).square().mean())}
                if out.kl is not None:
                    metrics["kl"] = float(out.kl)
            losses.append(LossPart(out.loss, metrics))
        return losses

    # ------------------------------------------------------------------------------------------------
    # the old policy after each optimizer step (kept, saved and restored by the policy)
    # ------------------------------------------------------------------------------------------------
    def _on_optimizer_step_end(self, step: int) -> None:
        args = self.args
        decay = old_policy_decay(step, args.old_policy_decay_start, args.old_policy_decay_rate,
                                 args.old_policy_decay_max)
        self._update_old_policy(decay)
        self.metrics.train["nft/old_policy_decay"].append(decay)

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
