"""DGPOTrainer: DGPO, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425), on
``transformers.Trainer``.

One generation (with the default ``steps_per_generation = gradient_accumulation_steps``: one optimizer step):

1. *Rollout* (`DGPORollout`). Groups of ``num_generations`` images per prompt, sampled by the deterministic
   ``sampler`` (DPM-Solver++ 2M as the official code, or Euler) at ``guidance_scale``, decoded and scored in the
   background; only each image's clean latent x0 is kept, with the rollout's noise levels and the rows' groups. Once
   more than ``dgpo_switch_ema_ref`` optimizer steps are done, the EMA reference samples instead of the policy.
2. *Trained steps* (`_prepare_batch`). Per pass over the generation (an inner epoch), ``dgpo_num_timesteps`` distinct
   rollout step indices from 0 .. ``dgpo_trunc_steps`` (`dgpo_step_indices`, the same on every process); per
   micro-batch and trained step one noise eps per group (`group_shared_noise`, keyed by the prompt, so a group split
   over processes gets one eps) or per sample.
3. *Loss* (`_pass_losses`, ``train_timesteps_per_pass`` trained steps per forward and backward, their rows stacked;
   default one step per backward). At x_t = (1 - sigma) x0 + sigma eps: the policy's
   conditional velocity (``train_guidance_scale``) with gradient; without gradient the base's (LoRA off, at
   ``kl_guidance_scale`` when > 1) and the EMA reference's. `dgpo_loss` gives

       S_g = sum_{i in g} A_i beta_dpo (sg(D_i) - D_i^ref) / K   (an all-reduce over every process: each one takes
                                                                 part in every trained step)
       L = mean_i sg(sigmoid(S_g)) A_i D_i' + beta mean_i mean((v_theta - v_base)^2)

   with D the DSM error mean((v - (eps - x0))^2), D_i' detached outside the DSM-ratio trust region ``dgpo_clip``
   against the EMA reference (math and hand check: ``dgpo_loss.py``). The group index is dense over the micro-batch's
   groups gathered from every process, so every process numbers the groups alike.
4. *EMA reference* (`_on_optimizer_step_end`). After optimizer step k (from 0): theta_ema <- d theta_ema + (1 - d)
   theta with d = min(``dgpo_ema_decay_max``, ``dgpo_ema_decay_rate`` k); kept as the policy's old copy (a second
   LoRA adapter, or a frozen copy for full fine-tuning), saved in every checkpoint and left out of exports. It is kept
   when the trust region or ``dgpo_use_ema_reference`` reads it, or when the rollouts switch to it within the run.

The official code steps the optimizer every two (micro-batch, trained step) passes; here the trained steps of a
micro-batch are accumulated into the micro-batch's optimizer step (docs/algorithms.md, "DGPO": what the recipes do
about it).

Logged besides the shared reward and timing keys: ``loss``, ``policy_loss``, ``kl`` (beta > 0), ``clip_frac`` (with
the trust region), ``dgpo/dsm`` and ``dgpo/ref_dsm`` (mean D and D^ref), ``dgpo/group_score`` (mean S_g),
``dgpo/group_weight`` (mean sigmoid(S_g) over samples), ``dgpo/ema_decay`` and ``dgpo/rollouts_by_ema_reference``
(1 when the generation trained on was sampled by the EMA reference).
"""

from __future__ import annotations

from collections import ChainMap
from contextlib import nullcontext

import torch

from ...models.defaults import generation_card_lines
from ...schedulers.flow_matching import noised_sample
from ..online_trainer import LossPart, OnlineRLTrainer
from ..rollout.strategies import FinalSampleRollout
from ..seeds import seed_for
from ..timestep_passes import split_rows, stack_embeds, stack_rows
from .dgpo_config import DGPOConfig
from .dgpo_loss import (
    dense_group_index,
    dgpo_loss,
    dgpo_reference_decay,
    dgpo_rollouts_use_ema_reference,
    dgpo_step_indices,
    group_shared_noise,
)

__all__ = ["DGPORollout", "DGPOTrainer"]


class DGPORollout(FinalSampleRollout):
    """DGPO's rollout: a deterministic trajectory with ``sampler`` that keeps x0, the noise levels and each row's group,
    sampled by the policy, or by the EMA reference (the policy's old copy) once more than ``dgpo_switch_ema_ref``
    optimizer steps are done (``plan``: whether it does, a function of the step)."""

    def __init__(self, args: DGPOConfig, keeps_ema_reference: bool):
        super().__init__(args, args.sampler, record_group_ids=True)
        self.keeps_ema_reference = keeps_ema_reference

    def plan(self, gen_index: int, step: int) -> bool:
        return self.keeps_ema_reference and dgpo_rollouts_use_ema_reference(step, self.args.dgpo_switch_ema_ref)

    def rollout(self, engine, model, embeds, plan, generator, progress, group_ids, gen_index):
        context = engine.policy.old_policy.forward_model(model) if plan else nullcontext(model)
        with context as sampler:
            final, record = engine.final_sample(sampler, embeds, generator, progress, self.solver)
        record["group_ids"] = group_ids
        record["by_ema_reference"] = bool(plan)
        return final, record


class DGPOTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching pipeline with DGPO (see `OnlineRLTrainer` for the arguments; ``args``: a
    ``DGPOConfig``; with a LoRA the EMA reference is a second adapter and the base is the adapter switched off, with
    full fine-tuning both are frozen copies)."""

    _tag_names = ["dgpo", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "DGPO"
    _paper = {
        "title": "Reinforcing Diffusion Models by Direct Group Preference Optimization",
        "id": "2510.08425",
        "citation": (
            "@inproceedings{luo2026dgpo,\n  title={Reinforcing Diffusion Models by Direct Group Preference "
            "Optimization},\n  author={Luo, Yihong and Hu, Tianyang and Tang, Jing},\n  booktitle={The Fourteenth "
            "International Conference on Learning Representations},\n  year={2026}\n}"
        ),
    }
    _config_class = DGPOConfig

    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _rollout_strategy(self, args: DGPOConfig) -> DGPORollout:
        return DGPORollout(args, args.keeps_ema_reference)

    # ------------------------------------------------------------------------------------------------
    # the trained steps, the noise and the groups of a micro-batch
    # ------------------------------------------------------------------------------------------------
    def _prepare_batch(self, record: dict) -> dict:
        """The pass's trained step indices, the noise at each and the micro-batch's dense group index: functions of
        the seed and where the micro-batch sits in the run (exact on resume, equal on every process where they
        must be)."""
        args = self.args
        device = self.accelerator.device
        spg = args.steps_per_generation
        period = spg * args.num_iterations
        micro = self._micro_step - 1  # this micro-batch (training_step counted it already)
        gen_index, position = divmod(micro, period)
        inner_epoch, micro_batch = divmod(position, spg)
        pass_start = (gen_index * period + inner_epoch * spg) // args.gradient_accumulation_steps
        steps = dgpo_step_indices(args.seed, pass_start, inner_epoch, args.dgpo_num_timesteps,
                                  args.dgpo_trunc_steps)
        x0 = record["x0"]
        group_ids = record["group_ids"].to(device)
        if args.dgpo_shared_noise:
            noise = [group_shared_noise(x0.float(), group_ids, args.seed, gen_index, inner_epoch, micro_batch, part)
                     for part in range(len(steps))]
        else:
            gen = torch.Generator().manual_seed(seed_for(args.seed, 8111, micro, self.accelerator.process_index))
            noise = [torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device) for _ in steps]
        gathered = self.accelerator.gather(group_ids) if self.accelerator.num_processes > 1 else group_ids
        dense, num_groups = dense_group_index(gathered)
        rank = self.accelerator.process_index if self.accelerator.num_processes > 1 else 0
        local = dense[rank * len(group_ids):(rank + 1) * len(group_ids)]
        return ChainMap({"dgpo_steps": steps, "noise": noise, "group_index": local, "num_groups": num_groups},
                        record)

    def _loss_parts(self, batch: dict) -> int:
        return len(batch["dgpo_steps"])

    def _reduce_group_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """S_g summed over every process (an all-reduce every process takes part in)."""
        return self.accelerator.reduce(sums, reduction="sum")

    def _pass_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """The losses of the trained steps ``parts``: each forward (policy, base, EMA reference) runs once over the
        steps' points stacked (`timestep_passes`); each step's loss is `dgpo_loss` of its own rows (its group sums
        reduced over every process as alone)."""
        args = self.args
        height, width = args.image_size
        policy = self.policy
        x0 = batch["x0"]
        steps = [batch["dgpo_steps"][part] for part in parts]
        noises = [batch["noise"][part] for part in parts]
        timesteps = [batch["timesteps"][:, j] for j in steps]
        points = [noised_sample(x0, noise, batch["sigmas"][:, j]) for j, noise in zip(steps, noises)]
        x_t, t = stack_rows(points), stack_rows(timesteps)
        embeds = stack_embeds(batch["embeds"], [None] * len(parts))
        scale = args.training_guidance_scale
        with self.accelerator.autocast():
            v = policy.velocity(model, x_t, t, embeds, scale, height, width)
        v_base = v_ema = None
        with torch.no_grad(), self.accelerator.autocast():
            if args.reads_base:
                kl_scale = args.kl_guidance_scale if args.kl_guidance_scale > 1 else scale
                v_base = policy.reference_velocity(model, x_t, t, embeds, height, width, guidance_scale=kl_scale)
            if args.uses_ema_reference:
                with policy.old_policy.forward_model(model) as ema:
                    v_ema = policy.velocity(ema, x_t, t, embeds, scale, height, width)
        sizes = [len(point) for point in points]
        nothing = [None] * len(parts)
        bases = split_rows(v_base, sizes) if v_base is not None else nothing
        emas = split_rows(v_ema, sizes) if v_ema is not None else nothing
        multi = self.accelerator.num_processes > 1
        losses = []
        for i, velocity in enumerate(split_rows(v, sizes)):
            advantages = self._advantages(batch)  # the last rewards were scored while the forwards ran
            out = dgpo_loss(velocity, noises[i], x0, advantages, batch["group_index"], batch["num_groups"],
                            v_dgpo_ref=emas[i] if args.dgpo_use_ema_reference else bases[i], beta_dpo=args.beta_dpo,
                            group_size=args.num_generations, adv_clip_max=args.adv_clip_max,
                            v_old=emas[i] if (args.dgpo_clip_dsm or args.dgpo_clip_kl) else None, clip=args.dgpo_clip,
                            clip_dsm=args.dgpo_clip_dsm, clip_kl=args.dgpo_clip_kl,
                            v_kl_ref=bases[i] if args.beta > 0 else None, beta=args.beta,
                            reduce_group_sums=self._reduce_group_sums if multi else None)
            with torch.no_grad():
                metrics = {"policy_loss": float(out.policy_loss), "dgpo/dsm": float(out.dsm.mean()),
                           "dgpo/ref_dsm": float(out.ref_dsm.mean()),
                           "dgpo/group_score": float(out.group_scores.mean()),
                           "dgpo/group_weight": float(out.sample_weights.mean()),
                           "dgpo/rollouts_by_ema_reference": float(batch.get("by_ema_reference", False))}
                if out.clip_frac is not None:
                    metrics["clip_frac"] = float(out.clip_frac)
                if out.kl is not None:
                    metrics["kl"] = float(out.kl)
            losses.append(LossPart(out.loss, metrics))
        return losses

    # ------------------------------------------------------------------------------------------------
    # the EMA reference after each optimizer step (kept, saved and restored by the policy)
    # ------------------------------------------------------------------------------------------------
    def _on_optimizer_step_end(self, step: int) -> None:
        if self.policy.old_policy is None:
            return
        args = self.args
        decay = dgpo_reference_decay(step - 1, args.dgpo_ema_decay_rate, args.dgpo_ema_decay_max)
        self._update_old_policy(decay)
        self.metrics.train["dgpo/ema_decay"].append(decay)

    # ------------------------------------------------------------------------------------------------
    # model card
    # ------------------------------------------------------------------------------------------------
    def _card_setup_lines(self) -> list[str]:
        args = self.args
        reference = "the EMA reference" if args.dgpo_use_ema_reference else "the base"
        region = f"DSM-ratio trust region {args.dgpo_clip:g}" if args.dgpo_clip_dsm or args.dgpo_clip_kl else \
            "no trust region"
        return [
            f"- algorithm: {self._name} ({args.dgpo_num_timesteps} of rollout steps 0..{args.dgpo_trunc_steps} "
            f"trained per pass, {'noise shared by each group' if args.dgpo_shared_noise else 'noise per sample'}; "
            f"rollouts with {args.sampler})",
            f"- group size {args.num_generations}, {args.num_inference_steps} sampling steps, guidance "
            f"{args.guidance_scale} (trained at {args.training_guidance_scale}), {args.height}x{args.width}"
            + (f", {args.num_frames} frames" if args.num_frames > 1 else ""),
            *generation_card_lines(self),
            f"- beta_dpo {args.beta_dpo} against {reference}, {region}, KL beta {args.beta} at guidance "
            f"{args.kl_guidance_scale}, advantage clip {args.adv_clip_max}, learning rate {args.learning_rate}",
            f"- EMA reference: decay min({args.dgpo_ema_decay_max:g}, {args.dgpo_ema_decay_rate:g} k); rollouts by it "
            f"after {args.dgpo_switch_ema_ref} steps" if self.policy.old_policy is not None else "- no EMA reference",
            f"- rewards: reward_aggregation={args.reward_aggregation}, scale_rewards={args.scale_rewards}",
        ]
