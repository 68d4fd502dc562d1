"""CRDTrainer: CRD, Centered Reward Distillation (arXiv 2603.14128), on ``transformers.Trainer``.

One generation (its micro-batches accumulate into ``steps_per_generation / gradient_accumulation_steps`` optimizer
steps):

1. *Rollout* (`CRDRollout`). Groups of ``num_generations`` images per prompt, sampled CFG-free (``guidance_scale``)
   by the deterministic ``sampler`` from the lagging **sampling copy** of the policy, decoded and scored in the
   background; only each image's clean latent x0 is kept, with the rollout's noise levels and the rows' groups.
2. *Trained steps* (`_prepare_batch`). ``crd_num_timesteps`` stratified draws over the rollout step indices below
   int(``num_inference_steps`` x ``timestep_fraction``) (`crd_step_indices`), shared by the micro-batch, with fresh
   noise eps per draw and sample.
3. *Loss* (`_pass_losses`, ``train_timesteps_per_pass`` draws per forward and backward, their rows stacked; default
   one draw per backward). At x_t = (1 - sigma) x0 + sigma eps: the policy's velocity
   with gradient; without gradient the **old copy**'s (or the base's, ``crd_use_old_policy: false``) and the base's at
   ``kl_guidance_scale``. `crd_loss` gives, with r = clamp(A / (2 C) + 1/2, 0, 1) the reward in [0, 1],

       r_theta = -mean[(v_theta - v*)^2 / w - (v_old - v*)^2 / w_old]             (the adaptive implicit reward)
       R = r - mean(r),  Q = r_theta - sg(mean(r_theta))     (means within each prompt's group, ``crd_centering:
                                                              group``, or over the micro-batch, ``batch``; both over
                                                              the values gathered from every process)
       L = (C / crd_beta) mean (crd_beta Q - R)^2  (or the BCE form)  +  beta mean_i (m + r_i (1 - m)) KL_i

   (math and hand check: ``crd_loss.py``).
4. *Copies*. At the optimizer step that ends a generation, k the optimizer steps done: the old copy moves by
   d_old = ``old_policy_decay(k)`` and the sampling copy by d_s = ``sampling_policy_decay(k)``,
   theta_copy <- d theta_copy + (1 - d) theta (d = 0 copies the policy, 1 freezes the copy). The old copy is the
   policy's old policy (the adapter ``old``, or ``old_policy.safetensors``), the sampling copy the named copy
   ``sampling`` (the adapter ``sampling``, or ``sampling_policy.safetensors``); both are saved in every checkpoint,
   restored on resume and left out of exports.

Logged besides the shared reward and timing keys: ``loss``, ``policy_loss``, ``kl`` (the unweighted mean of
mean((v_theta - v_base)^2), beta > 0), ``crd/kl_loss``, ``crd/implicit_reward`` (mean r_theta),
``crd/centred_implicit_std`` (std of Q), ``crd/old_deviation`` (mean squared distance of v_theta and v_old),
``crd/old_policy_decay`` and ``crd/sampling_policy_decay`` (at the steps that end a generation).
"""

from __future__ import annotations

from collections import ChainMap

import torch

from ...models.defaults import generation_card_lines
from ...schedulers.flow_matching import noised_sample
from ..online_trainer import LossPart, OnlineRLTrainer
from ..rollout.strategies import FinalSampleRollout
from ..seeds import seed_for
from ..timestep_passes import split_rows, stack_embeds, stack_rows
from .crd_config import SAMPLING_COPY, CRDConfig
from .crd_loss import crd_loss, crd_step_indices, reward_weight

__all__ = ["SAMPLING_COPY", "CRDRollout", "CRDTrainer"]

#: the name of CRD's sampling copy among the policy's copies (``policy.copies``)


class CRDRollout(FinalSampleRollout):
    """CRD's rollout: a deterministic trajectory with ``sampler`` by the sampling copy (``policy.copies["sampling"]``)
    that keeps x0, the noise levels and each row's group."""

    def __init__(self, args: CRDConfig):
        super().__init__(args, args.sampler, record_group_ids=True)

    def sampling_model(self, engine, model):
        return engine.policy.copies[SAMPLING_COPY].forward_model(model)


class CRDTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching pipeline with CRD (see `OnlineRLTrainer` for the arguments; ``args``: a
    ``CRDConfig``; with a LoRA the old and sampling copies are two more adapters and the base is the adapter switched
    off, with full fine-tuning all three are frozen copies)."""

    _tag_names = ["crd", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "CRD"
    _paper = {
        "title": "Diffusion Reinforcement Learning via Centered Reward Distillation",
        "id": "2603.14128",
        "citation": (
            "@article{crd2026,\n  title={Diffusion Reinforcement Learning via Centered Reward Distillation},\n"
            "  journal={arXiv preprint arXiv:2603.14128},\n  year={2026}\n}"
        ),
    }
    _config_class = CRDConfig

    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _rollout_strategy(self, args: CRDConfig) -> CRDRollout:
        return CRDRollout(args)

    # ------------------------------------------------------------------------------------------------
    # the trained steps and the noise of a micro-batch
    # ------------------------------------------------------------------------------------------------
    def _prepare_batch(self, record: dict) -> dict:
        """The micro-batch's stratified step draws (the same on every process) and fresh noise per draw and sample:
        functions of the seed, the micro-step and the process (exact on resume)."""
        args = self.args
        device = self.accelerator.device
        micro = self._micro_step - 1
        x0 = record["x0"]
        draw = torch.Generator().manual_seed(seed_for(args.seed, 9001, micro))
        steps = crd_step_indices(args.crd_num_timesteps, record["sigmas"].shape[1], args.timestep_fraction,
                                 generator=draw).tolist()
        gen = torch.Generator().manual_seed(seed_for(args.seed, 9001, micro, self.accelerator.process_index))
        noise = [torch.randn(x0.shape, generator=gen, dtype=torch.float32).to(device) for _ in steps]
        return ChainMap({"crd_steps": steps, "noise": noise, "group_ids": record["group_ids"].to(device)}, record)

    def _loss_parts(self, batch: dict) -> int:
        return len(batch["crd_steps"])

    def _pass_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """The losses of the draws ``parts``: each forward (policy, old copy or base, KL reference) runs once over the
        draws' points stacked (`timestep_passes`); each draw's loss is `crd_loss` of its own rows."""
        args = self.args
        height, width = args.image_size
        policy = self.policy
        x0 = batch["x0"]
        steps = [batch["crd_steps"][part] for part in parts]
        noises = [batch["noise"][part] for part in parts]
        timesteps = [batch["timesteps"][:, j] for j in steps]
        points = [noised_sample(x0, noise, batch["sigmas"][:, j]) for j, noise in zip(steps, noises)]
        x_t, t = stack_rows(points), stack_rows(timesteps)
        embeds = stack_embeds(batch["embeds"], [None] * len(parts))
        with self.accelerator.autocast():
            v = policy.velocity(model, x_t, t, embeds, args.guidance_scale, height, width)
        v_ref = None
        with torch.no_grad(), self.accelerator.autocast():
            if args.crd_use_old_policy:
                with policy.old_policy.forward_model(model) as old:
                    v_old = policy.velocity(old, x_t, t, embeds, args.guidance_scale, height, width)
            else:
                v_old = policy.reference_velocity(model, x_t, t, embeds, height, width,
                                                  guidance_scale=args.guidance_scale)
            if args.beta > 0:
                if not args.crd_use_old_policy and args.kl_guidance_scale == args.guidance_scale:
                    v_ref = v_old
                else:
                    v_ref = policy.reference_velocity(model, x_t, t, embeds, height, width,
                                                      guidance_scale=args.kl_guidance_scale)
        sizes = [len(point) for point in points]
        olds = split_rows(v_old, sizes)
        references = split_rows(v_ref, sizes) if v_ref is not None else [None] * len(parts)
        losses = []
        for i, velocity in enumerate(split_rows(v, sizes)):
            rewards = reward_weight(self._advantages(batch), args.adv_clip_max)  # scored while the forwards ran
            out = crd_loss(velocity, olds[i], noises[i], x0, rewards, crd_beta=args.crd_beta, loss_type=args.loss_type,
                           adv_clip_max=args.adv_clip_max, adaptive=args.crd_adaptive_weights,
                           group_index=batch["group_ids"] if args.crd_centering == "group" else None,
                           gather=self.accelerator.gather if self.accelerator.num_processes > 1 else None,
                           v_ref=references[i], beta_kl=args.beta, reward_adaptive_kl=args.reward_adaptive_kl)
            with torch.no_grad():
                metrics = {"policy_loss": float(out.policy_loss),
                           "crd/implicit_reward": float(out.implicit_reward.mean()),
                           "crd/centred_implicit_std": float(out.centred_implicit.float().std(unbiased=False)),
                           "crd/old_deviation": float((velocity.detach() - olds[i]).square().mean())}
                if out.kl is not None:
                    metrics["kl"] = float(out.kl.mean())
                    metrics["crd/kl_loss"] = float(out.kl_loss)
            losses.append(LossPart(out.loss, metrics))
        return losses

    # ------------------------------------------------------------------------------------------------
    # the copies, once per generation (kept, saved and restored by the policy)
    # ------------------------------------------------------------------------------------------------
    def _ends_generation(self, step: int) -> bool:
        """Whether optimizer step ``step`` (1-based) trained the last micro-batch of a generation (its last pass)."""
        args = self.args
        period = args.steps_per_generation * args.num_iterations
        accumulation = args.gradient_accumulation_steps
        return (step * accumulation) // period > ((step - 1) * accumulation) // period

    def _on_optimizer_step_end(self, step: int) -> None:
        if not self._ends_generation(step) or self.last_step_skipped:  # a skipped step changed no weight
            return
        args = self.args
        m = self.metrics.train
        if self.policy.old_policy is not None:
            decay = args.old_policy_decay(step)
            self.policy.update_old_policy(decay)
            m["crd/old_policy_decay"].append(decay)
        decay = args.sampling_policy_decay(step)
        self.policy.update_copy(SAMPLING_COPY, decay)
        m["crd/sampling_policy_decay"].append(decay)

    # ------------------------------------------------------------------------------------------------
    # model card
    # ------------------------------------------------------------------------------------------------
    def _card_setup_lines(self) -> list[str]:
        args = self.args
        anchor = "the old copy" if args.crd_use_old_policy else "the base"
        return [
            f"- algorithm: {self._name} ({args.crd_num_timesteps} stratified draws of the rollout steps per "
            f"micro-batch; rollouts by the sampling copy with {args.sampler})",
            f"- group size {args.num_generations}, {args.num_inference_steps} sampling steps, guidance "
            f"{args.guidance_scale}, {args.height}x{args.width}"
            + (f", {args.num_frames} frames" if args.num_frames > 1 else ""),
            *generation_card_lines(self),
            f"- crd_beta {args.crd_beta}, {args.loss_type} loss, implicit reward against {anchor} "
            f"({'adaptive' if args.crd_adaptive_weights else 'plain'} weights), centred per {args.crd_centering}",
            f"- KL beta {args.beta} to the base at guidance {args.kl_guidance_scale}"
            f"{', weighted by reward' if args.reward_adaptive_kl else ''}; advantage clip {args.adv_clip_max}, "
            f"learning rate {args.learning_rate}",
            f"- copies, once per generation: old min({args.old_policy_decay_initial:g} + "
            f"{args.old_policy_decay_rate:g} (k - {args.old_policy_decay_start}), {args.old_policy_decay_max:g}); "
            f"sampling {args.sampling_policy_decay_initial:g} before step {args.sampling_policy_decay_start}, then "
            f"min({args.sampling_policy_decay_initial:g} + {args.sampling_policy_decay_rate:g} (k - "
            f"{args.sampling_policy_decay_start}), {args.sampling_policy_decay_max:g})",
            f"- rewards: reward_aggregation={args.reward_aggregation}, scale_rewards={args.scale_rewards}",
        ]
