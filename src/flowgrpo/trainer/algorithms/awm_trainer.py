"""AWMTrainer: Advantage Weighted Matching (arXiv 2509.25050) on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout.* As in Flow-GRPO (`OnlineRLTrainer`: groups of G images per prompt, decoded and scored in the
   background, advantages), sampled by the current policy, or by the EMA adapter with ``off_policy``, at
   ``guidance_scale`` with ``rollout_solver``: the official stochastic SA-Solver (``rollout_sampler: sa_solver``,
   `sa_solver_rollout`: noise of stochasticity ``sa_solver_tau`` on the steps that end inside
   ``sa_solver_noise_range``, the model called at timestep sigma x 1000 of AWM's own levels) or a deterministic
   solver. Each record keeps the clean latent x0, the ``train_timesteps`` noise levels t of the micro-batch
   (``time_type``, drawn from the scheduler's unmodified levels, as the official code draws them from its
   ``timesteps``) and fresh noise eps for each (level, sample); and, when the micro-batch is trained after an
   optimizer step of the same generation or by an off-policy run, the sampling policy's log-probs.
2. *Training.* One batched forward of the policy on the T x B points x = (1 - t) x0 + t eps gives the weighted
   flow-matching surrogate log-probs; the clipped ratio against the sampling policy's (``loss_type``), plus
   ``beta`` x the velocity KL to the reference and ``ema_beta`` x the one to the EMA adapter (`awm_loss.py`: the
   math); one backward per micro-batch. Every velocity of the loss (policy, reference, EMA adapter, the sampling
   policy's log-probs) is taken at ``train_guidance_scale`` (default 1: the conditional velocity alone, as the
   official ``train.cfg = False``), whatever the rollouts' guidance: the loss reads only x0.
3. *EMA adapter.* After each optimizer step k: theta_ema <- d theta_ema + (1 - d) theta, d = min(``kl_ema_decay``,
   0.001 k) (``linear``) or ``kl_ema_decay``; kept as a second LoRA adapter (or a frozen copy for full fine-tuning),
   saved in every checkpoint and left out of exports (`OnlineRLTrainer`'s old policy).
4. *Evaluation* (deterministic ``sampler``) of the EMA of the weights when ``use_ema`` (``eval_*``) and, with
   ``eval_raw_weights``, of the raw weights too (``eval_raw_*``), as the official code evaluates both.

Logged besides the shared reward and timing keys: ``policy_loss``, ``ratio_mean``, ``clip_frac``,
``awm/flow_matching_error``, ``kl`` and ``awm/ema_kl`` (beta > 0), ``awm/ema_decay`` (with an EMA adapter).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ...models import PromptEmbeds
from ...models.defaults import generation_card_lines
from ...schedulers.flow_matching import noised_sample, sigma_timesteps
from ...schedulers.sa_solver import sa_solver_sample, sa_solver_sigmas
from ..online_trainer import LossPart, OnlineRLTrainer
from ..rollout.strategies import FinalSampleRollout
from .awm_config import AWMConfig
from .awm_loss import awm_log_prob, awm_loss, ema_adapter_decay, sample_train_timesteps

__all__ = ["AWMTrainer", "AWMRollout", "sa_solver_rollout"]


def training_points(record: dict, embeds: PromptEmbeds, train_timesteps: int, num_train_timesteps: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PromptEmbeds]:
    """The level-major rows of a micro-batch: x0 repeated, x = (1 - t) x0 + t eps, the model's timesteps, and the
    prompt embeddings repeated."""
    x0 = record["x0"]
    x0_rows = torch.cat([x0] * train_timesteps)
    x_t = noised_sample(x0_rows, record["noise"], record["t"])
    timesteps = sigma_timesteps(record["t"], num_train_timesteps)
    rows = torch.arange(x0.shape[0]).repeat(train_timesteps)
    return x0_rows, x_t, timesteps, embeds.index_select(rows)


def sa_solver_rollout(engine, model: torch.nn.Module, embeds: PromptEmbeds, generator: torch.Generator, progress,
                      args: AWMConfig) -> tuple[torch.Tensor, dict]:
    """One micro-batch sampled with AWM's official SA-Solver (`flowgrpo.schedulers.sa_solver`) by ``model`` at
    ``guidance_scale``; returns the final latents and ``{"x0", "sigmas", "timesteps"}`` as the engine's
    ``final_sample`` does.

    The scheduler is set to ``num_inference_steps`` as the family's pipeline sets it; SA-Solver runs on AWM's own
    levels (`sa_solver_sigmas`: the first 1 - 1e-3, the second-to-last half the third-to-last) and calls the model
    at timestep sigma x ``num_train_timesteps`` (the official ``t * 1000``), N model calls in all; the initial noise
    and the noise of its steps come from ``generator``. The recorded ``sigmas`` are the scheduler's unmodified levels
    (the trained levels are drawn from them, as the official code draws them from the unmodified ``timesteps``). With
    ``base_model_tail_steps`` the last model calls use the reference's velocity. With ``rollout_cache`` the model
    calls of a training rollout go through the engine's cache (`RolloutEngine.cached_steps`).
    """
    height, width = args.image_size
    device = engine.accelerator.device
    batch = len(embeds)
    scheduler = engine.scheduler
    steps = args.num_inference_steps
    engine.adapter.set_timesteps(scheduler, steps, height, width, device)
    levels = sa_solver_sigmas(scheduler.sigmas.detach().cpu())
    latents = engine.adapter.prepare_latents(batch, height, width, generator, device, torch.float32)
    scale = scheduler.config.num_train_timesteps
    calls = [0]

    def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
        tail = args.base_model_tail_steps and calls[0] >= steps - args.base_model_tail_steps
        calls[0] += 1
        timestep = torch.full((batch,), sigma * scale, device=device, dtype=torch.float32)
        if cache is not None:
            cache.step(float(sigma) * scale, float(sigma))
        with engine.policy.reference_model(model) if tail else nullcontext(model) as sampler:
            v = engine.policy.velocity(sampler, x, timestep, embeds, args.guidance_scale, height, width)
        if progress is not None:
            progress.update(1)
        return v

    with engine.cached_steps(steps, engine.adapter.uses_cfg(args.guidance_scale)) as cache:
        out = sa_solver_sample(velocity, latents, levels, tau=args.sa_solver_tau,
                               noise_range=args.sa_solver_noise_range, predictor_order=args.sa_solver_predictor_order,
                               corrector_order=args.sa_solver_corrector_order, generator=generator)
    final = engine.adapter.final_latents(out.sample, embeds)
    sigmas = scheduler.sigmas[:-1].to(device=device, dtype=torch.float32)
    timesteps = scheduler.timesteps.to(device)
    return final, {"x0": final, "sigmas": sigmas.expand(batch, -1), "timesteps": timesteps.expand(batch, -1)}


class AWMRollout(FinalSampleRollout):
    """AWM's rollout with ``rollout_solver`` (SA-Solver, stochastic, or a deterministic solver) by the policy, or by
    the EMA adapter with ``off_policy``, keeping x0, the micro-batch's ``train_timesteps`` noise levels t
    (``time_type``) and fresh noise eps for each (level, sample), and the sampling policy's surrogate log-probs at
    ``train_guidance_scale`` when it is not the policy trained at the micro-batch's first forward
    (``old_log_probs_at_rollout``)."""

    def __init__(self, args: AWMConfig, old_log_probs_at_rollout: bool):
        super().__init__(args, args.rollout_solver, by_old_policy=args.off_policy)
        self.old_log_probs_at_rollout = old_log_probs_at_rollout

    def for_workers(self, worker_args, max_staleness: int) -> AWMRollout:
        """On a rollout worker with ``max_staleness >= 1`` the sampling weights may not be the ones trained at the
        micro-batch's first forward: record their surrogate log-probs at the rollout."""
        strategy = super().for_workers(worker_args, max_staleness)
        strategy.old_log_probs_at_rollout = self.old_log_probs_at_rollout or max_staleness > 0
        return strategy

    def rollout(self, engine, model, embeds, plan, generator, progress, group_ids, gen_index):
        args = self.args
        with self.sampling_model(engine, model) as policy:
            if self.solver == "sa_solver":
                final, record = sa_solver_rollout(engine, policy, embeds, generator, progress, args)
            else:
                final, record = engine.final_sample(policy, embeds, generator, progress, self.solver)
            batch = final.shape[0]
            record["t"] = sample_train_timesteps(args.time_type, args.train_timesteps, batch, record["sigmas"][0],
                                                 args.timestep_fraction, args.time_shift, generator).to(final.device)
            noise = torch.randn((args.train_timesteps, *final.shape), generator=generator, dtype=torch.float32)
            record["noise"] = noise.reshape(-1, *final.shape[1:]).to(final.device)
            if self.old_log_probs_at_rollout:
                height, width = args.image_size
                x0_rows, x_t, timesteps, rows_embeds = training_points(
                    record, embeds, args.train_timesteps, engine.scheduler.config.num_train_timesteps)
                v = engine.policy.velocity(policy, x_t, timesteps, rows_embeds, args.training_guidance_scale,
                                           height, width)
                log_prob = awm_log_prob(v, record["noise"], x0_rows, record["t"], args.weighting, args.ghuber_power)
                record["old_log_probs"] = log_prob.reshape(args.train_timesteps, batch)
        return final, record


class AWMTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching pipeline with Advantage Weighted Matching (see `OnlineRLTrainer` for the
    arguments; ``args``: an ``AWMConfig``)."""

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

    def _eval_ode_solver(self) -> str:
        return self.args.sampler

    def _eval_raw_weights(self) -> bool:
        return self.args.eval_raw_weights

    def _rollout_strategy(self, args: AWMConfig) -> AWMRollout:
        """The sampling policy's log-probs are computed at the rollout when it is not the policy being trained at the
        micro-batch's first forward: off-policy, or micro-batches trained after an optimizer step of their
        generation (more micro-batches per generation than accumulation steps, or several passes)."""
        at_rollout = args.off_policy or args.steps_per_generation * args.num_iterations > \
            args.gradient_accumulation_steps
        return AWMRollout(args, old_log_probs_at_rollout=at_rollout)

    # ------------------------------------------------------------------------------------------------
    # training: the clipped ratio of the weighted flow-matching surrogate, and the KL terms
    # ------------------------------------------------------------------------------------------------
    def _batch_loss(self, model, batch: dict, part: int, first_pass: bool) -> LossPart:
        args = self.args
        height, width = args.image_size
        policy = self.policy
        x0_rows, x_t, timesteps, rows_embeds = training_points(
            batch, batch["embeds"], args.train_timesteps, self.rollouts.scheduler.config.num_train_timesteps)
        scale = args.training_guidance_scale  # the trained velocities' CFG, not the rollouts'
        with self.accelerator.autocast():
            v = policy.velocity(model, x_t, timesteps, rows_embeds, scale, height, width)
        advantages = self._advantages(batch)  # the last rewards were scored while this forward ran
        v_ref = v_ema = None
        if args.beta > 0:
            with self.accelerator.autocast():
                v_ref = policy.reference_velocity(model, x_t, timesteps, rows_embeds, height, width,
                                                  guidance_scale=scale)
            if args.ema_beta > 0:
                with torch.no_grad(), self.accelerator.autocast(), policy.old_policy.forward_model(model) as ema:
                    v_ema = policy.velocity(ema, x_t, timesteps, rows_embeds, scale, height, width)
        out = awm_loss(v, batch["noise"], x0_rows, batch["t"], advantages, batch.get("old_log_probs"),
                       train_timesteps=args.train_timesteps, weighting=args.weighting, ghuber_power=args.ghuber_power,
                       loss_type=args.loss_type, clip_range=args.clip_range, adv_clip_max=args.adv_clip_max,
                       advantage_max=args.advantage_max, v_ref=v_ref, beta=args.beta, kl_weight=args.kl_weight,
                       v_ema=v_ema, ema_beta=args.ema_beta, kl_ema_weight=args.kl_ema_weight,
                       kl_gate=batch.get("kl_gate"))  # GARDO: the gated samples only
        with torch.no_grad():
            error = (v.detach().float() - (batch["noise"] - x0_rows)).square().mean()
            metrics = {"policy_loss": float(out.policy_loss), "ratio_mean": float(out.ratio.mean()),
                       "clip_frac": float(((out.ratio - 1).abs() > args.clip_range).float().mean()),
                       "awm/flow_matching_error": float(error)}
            if out.kl is not None:
                metrics["kl"] = float(out.kl)
            if out.ema_kl is not None:
                metrics["awm/ema_kl"] = float(out.ema_kl)
        return LossPart(out.loss, metrics)

    def _on_optimizer_step_end(self, step: int) -> None:
        if self.policy.old_policy is None:
            return
        decay = ema_adapter_decay(step, self.args.kl_ema_decay, self.args.kl_ema_decay_type)
        self._update_old_policy(decay)
        self.metrics.train["awm/ema_decay"].append(decay)

    def _rollout_sampler_words(self) -> str:
        args = self.args
        if args.rollout_solver != "sa_solver":
            return args.rollout_solver
        lo, hi = args.sa_solver_noise_range
        return (f"SA-Solver (tau {args.sa_solver_tau:g} on [{lo:g}, {hi:g}], predictor {args.sa_solver_predictor_order}"
                f", corrector {args.sa_solver_corrector_order})")

    def _card_setup_lines(self) -> list[str]:
        args = self.args
        return [
            f"- algorithm: {self._name} ({args.train_timesteps} noise levels per image by {args.time_type}, "
            f"weighting {args.weighting}, {args.loss_type}, clip range {args.clip_range:g}; rollouts with "
            f"{self._rollout_sampler_words()}{', off-policy (EMA adapter)' if args.off_policy else ''})",
            f"- group size {args.num_generations}, {args.num_inference_steps} sampling steps, guidance "
            f"{args.guidance_scale} (trained velocities: {args.training_guidance_scale:g}), {args.height}x{args.width}"
            + (f", {args.num_frames} frames" if args.num_frames > 1 else ""),
            *generation_card_lines(self),
            f"- KL: beta {args.beta} ({args.kl_weight}), EMA adapter {args.ema_beta} ({args.kl_ema_weight}, decay "
            f"{args.kl_ema_decay_type} up to {args.kl_ema_decay:g}); learning rate {args.learning_rate}",
            f"- rewards: reward_aggregation={args.reward_aggregation}, scale_rewards={args.scale_rewards}, "
            f"advantage_max={args.advantage_max}",
        ]
