"""AWMTrainer: Advantage Weighted Matching (arXiv 2509.25050) on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout.* As in Flow-GRPO (`OnlineRLTrainer`: groups of G images per prompt, decoded and scored in the
   background, advantages), sampled with the deterministic ``sampler`` by the current policy, or by the EMA adapter
   with ``off_policy``. Each record keeps the clean latent x0, the ``train_timesteps`` noise levels t of the
   micro-batch (``time_type``) and fresh noise eps for each (level, sample); and, when the micro-batch is trained
   after an optimizer step of the same generation or by an off-policy run, the sampling policy's log-probs.
2. *Training.* One batched forward of the policy on the T x B points x = (1 - t) x0 + t eps gives the weighted
   flow-matching surrogate log-probs; the clipped ratio against the sampling policy's (``loss_type``), plus
   ``beta`` x the velocity KL to the reference and ``ema_beta`` x the one to the EMA adapter (`awm_loss.py`: the
   math); one backward per micro-batch.
3. *EMA adapter.* After each optimizer step k: theta_ema <- d theta_ema + (1 - d) theta, d = min(``kl_ema_decay``,
   0.001 k) (``linear``) or ``kl_ema_decay``; kept as a second LoRA adapter (or a frozen copy for full fine-tuning),
   saved in every checkpoint and left out of exports (`OnlineRLTrainer`'s old policy).

Logged besides the shared reward and timing keys: ``policy_loss``, ``ratio_mean``, ``clip_frac``,
``awm/flow_matching_error``, ``kl`` and ``awm/ema_kl`` (beta > 0), ``awm/ema_decay`` (with an EMA adapter).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from ...models import PromptEmbeds
from ...models.defaults import generation_card_lines
from ..online_trainer import OnlineRLTrainer
from .awm_config import AWMConfig
from .awm_loss import awm_log_prob, awm_loss, ema_adapter_decay, sample_train_timesteps
from .flow_matching import noised_sample, sigma_timesteps

__all__ = ["AWMTrainer"]


class AWMTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching pipeline with Advantage Weighted Matching; the constructor is
    `FlowGRPOTrainer`'s (``args``: an ``AWMConfig``)."""

    _tag_names = ["awm", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "AWM"
    _paper = {
        "title": "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models",
        "id": "2509.25050",
        "citation": (
            "@article{xue2025awm,\n  title={Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion "
            "Models},\n  author={Xue, Shuchen and others},\n  journal={arXiv preprint arXiv:2509.25050},\n"
            "  year={2025}\n}"
        ),
    }
    _config_class = AWMConfig

    def _uses_old_policy(self, args: AWMConfig) -> bool:
        return args.uses_ema_adapter  # the EMA adapter

    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _old_log_probs_at_rollout(self) -> bool:
        """The sampling policy's log-probs are computed at the rollout when it is not the policy being trained at the
        micro-batch's first forward: off-policy, or micro-batches trained after an optimizer step of their
        generation (more micro-batches per generation than accumulation steps, or several passes)."""
        args = self.args
        return args.off_policy or args.steps_per_generation * args.num_iterations > args.gradient_accumulation_steps

    # ------------------------------------------------------------------------------------------------
    # rollouts: the clean latent, the trained levels and their noise
    # ------------------------------------------------------------------------------------------------
    def _rollout(self, model, embeds: PromptEmbeds, plan: Any, generator: torch.Generator, progress,
                 group_ids: torch.Tensor, gen_index: int) -> tuple[torch.Tensor, dict]:
        args = self.args
        sampling = self.old_policy.forward_model(model) if args.off_policy else nullcontext(model)
        with sampling as policy:
            final, record = self._final_sample_rollout(policy, embeds, generator, progress, args.sampler)
            batch = final.shape[0]
            record["t"] = sample_train_timesteps(args.time_type, args.train_timesteps, batch, record["sigmas"][0],
                                                 args.timestep_fraction, args.time_shift, generator).to(final.device)
            noise = torch.randn((args.train_timesteps, *final.shape), generator=generator, dtype=torch.float32)
            record["noise"] = noise.reshape(-1, *final.shape[1:]).to(final.device)
            if self._old_log_probs_at_rollout():
                log_prob, _ = self._surrogate(policy, record, embeds)
                record["old_log_probs"] = log_prob.reshape(args.train_timesteps, batch)
        return final, record

    def _points(self, record: dict, embeds: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                    PromptEmbeds]:
        """The level-major rows of a micro-batch: x0 repeated, x = (1 - t) x0 + t eps, the model's timesteps, and
        the prompt embeddings repeated."""
        x0 = record["x0"]
        repeats = self.args.train_timesteps
        x0_rows = torch.cat([x0] * repeats)
        x_t = noised_sample(x0_rows, record["noise"], record["t"])
        timesteps = sigma_timesteps(record["t"], self.sde_scheduler.config.num_train_timesteps)
        rows = torch.arange(x0.shape[0]).repeat(repeats)
        return x0_rows, x_t, timesteps, embeds.index_select(rows)

    def _surrogate(self, model, record: dict, embeds: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted surrogate log-probs ``(T * B,)`` of ``model`` and its velocities."""
        args = self.args
        height, width = args.image_size
        x0_rows, x_t, timesteps, rows_embeds = self._points(record, embeds)
        v = self._velocity(model, x_t, timesteps, rows_embeds, args.guidance_scale, height, width)
        return awm_log_prob(v, record["noise"], x0_rows, record["t"], args.weighting, args.ghuber_power), v

    # ------------------------------------------------------------------------------------------------
    # training: the clipped ratio of the weighted flow-matching surrogate, and the KL terms
    # ------------------------------------------------------------------------------------------------
    def _train_on_batch(self, model, batch: dict, first_pass: bool) -> torch.Tensor:
        args = self.args
        height, width = args.image_size
        scale = 1.0 / self.current_gradient_accumulation_steps
        m = self._metrics["train"]
        x0_rows, x_t, timesteps, rows_embeds = self._points(batch, batch["embeds"])
        tic = self._clock()
        with self.accelerator.autocast():
            v = self._velocity(model, x_t, timesteps, rows_embeds, args.guidance_scale, height, width)
        tic = self._await_scoring(tic)  # the rewards of the last micro-batches were scored while this forward ran
        v_ref = v_ema = None
        if args.beta > 0:
            with self.accelerator.autocast():
                v_ref = self._reference_velocity(model, x_t, timesteps, rows_embeds, height, width)
            if args.ema_beta > 0:
                with torch.no_grad(), self.accelerator.autocast(), self.old_policy.forward_model(model) as ema:
                    v_ema = self._velocity(ema, x_t, timesteps, rows_embeds, args.guidance_scale, height, width)
        out = awm_loss(v, batch["noise"], x0_rows, batch["t"], batch["advantages"], batch.get("old_log_probs"),
                       train_timesteps=args.train_timesteps, weighting=args.weighting, ghuber_power=args.ghuber_power,
                       loss_type=args.loss_type, clip_range=args.clip_range, adv_clip_max=args.adv_clip_max,
                       advantage_max=args.advantage_max, v_ref=v_ref, beta=args.beta, kl_weight=args.kl_weight,
                       v_ema=v_ema, ema_beta=args.ema_beta, kl_ema_weight=args.kl_ema_weight,
                       kl_gate=batch.get("kl_gate"))  # GARDO: the gated samples only
        tac = self._clock()
        self.accelerator.backward(out.loss * scale, **self._backward_kwargs())
        toc = self._clock()
        m["timing/training_forward"].append(tac - tic)
        m["timing/training_backward"].append(toc - tac)
        with torch.no_grad():
            m["policy_loss"].append(float(out.policy_loss))
            m["ratio_mean"].append(float(out.ratio.mean()))
            m["clip_frac"].append(float(((out.ratio - 1).abs() > args.clip_range).float().mean()))
            error = (v.detach().float() - (batch["noise"] - x0_rows)).square().mean()
            m["awm/flow_matching_error"].append(float(error))
            if out.kl is not None:
                m["kl"].append(float(out.kl))
            if out.ema_kl is not None:
                m["awm/ema_kl"].append(float(out.ema_kl))
        return (out.loss.detach() * scale).float()

    def _on_optimizer_step_end(self, step: int) -> None:
        if self.old_policy is None:
            return
        decay = ema_adapter_decay(step, self.args.kl_ema_decay, self.args.kl_ema_decay_type)
        self._update_old_policy(decay)
        self._metrics["train"]["awm/ema_decay"].append(decay)

    def _card_setup_lines(self) -> list[str]:
        args = self.args
        return [
            f"- algorithm: {self._name} ({args.train_timesteps} noise levels per image by {args.time_type}, "
            f"weighting {args.weighting}, {args.loss_type}, clip range {args.clip_range:g}; rollouts with "
            f"{args.sampler}{', off-policy (EMA adapter)' if args.off_policy else ''})",
            f"- group size {args.num_generations}, {args.num_inference_steps} sampling steps, guidance "
            f"{args.guidance_scale}, {args.height}x{args.width}"
            + (f", {args.num_frames} frames" if args.num_frames > 1 else ""),
            *generation_card_lines(self),
            f"- KL: beta {args.beta} ({args.kl_weight}), EMA adapter {args.ema_beta} ({args.kl_ema_weight}, decay "
            f"{args.kl_ema_decay_type} up to {args.kl_ema_decay:g}); learning rate {args.learning_rate}",
            f"- rewards: reward_aggregation={args.reward_aggregation}, scale_rewards={args.scale_rewards}, "
            f"advantage_max={args.advantage_max}",
        ]
