"""FlowGRPOTrainer: Flow-GRPO (and its Fast / CPS variants) on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout.* The generation batch holds ``generation_batch_size / G`` prompts, each G times. Each unique prompt
   is encoded once. Images are sampled in micro-batches with ``FlowMatchSDEScheduler`` steps: SDE inside the
   rollout's window, ODE outside. For the window's steps we store x_j, x_{j+1}, log p_old(x_{j+1} | x_j), t_j.
2. *Reward.* Each micro-batch is decoded once, in a background thread, and scored by the reward pool while the
   next micro-batch is sampled. The last micro-batch's rewards are still being scored while the first training
   forward runs; then rewards are gathered from all processes and turned into group advantages as in
   ``advantages.py``.
3. *Training.* For each micro-batch and each stored step j (one backward per step, so activation memory is
   bounded by one step), recompute log p_theta(x_{j+1} | x_j) with the same guidance and negative embeddings:

       ratio = exp(logp_theta - logp_old)        (ratio_normalization="grpo_guard": exp(mean(eps (mu_theta - mu_old))))
       policy_loss = mean(max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)))
       kl = mean((mu_theta - mu_ref)^2) / (2 std^2)          (std: the transition's std; only when beta > 0;
                                                              kl_estimator picks k1, k3 or a velocity penalty)
       loss = (policy_loss + beta kl) / (num_steps * grad_accum)

   On the first pass the ratio is exactly 1 (same inputs, dtype and batch composition as sampling).

Variants (``FlowGRPOConfig``): the window's start follows ``sde_window_strategy`` (random, MixGRPO's progressive
schedule, fixed); the deterministic steps use ``ode_solver`` (Euler or DPM-Solver++ 2M, with the steps after the
window compressed by ``ode_compression_ratio``); ``same_noise_per_group`` shares x_1 within a group;
``reward_aggregation`` combines several rewards (``advantages.py``). DanceGRPO is ``sde_type="dance"`` with
``same_noise_per_group`` and ``timestep_fraction < 1`` (each sample trains a random subset of its steps).

Everything but the rollout's recording and the loss (prompts, rewards, advantages, evaluation, logging, saving,
LoRA export, model card, Hub push, crash safety) is `online_trainer.OnlineRLTrainer`'s, shared with
`DiffusionNFTTrainer`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...models import PromptEmbeds
from ...models.defaults import generation_card_lines
from ...schedulers import grpo_guard_log_ratio, kl_estimate, scheduled_sde_window, sde_step_from_sigmas
from ..health.gardo import gated_mean
from ..online_trainer import OnlineRLTrainer, _seed_for
from ..outputs.lora_export import LORA_WEIGHTS_NAME
from .flow_grpo_config import FlowGRPOConfig


class FlowGRPOTrainer(OnlineRLTrainer):
    """Online RL of a flow-matching text-to-image pipeline with Flow-GRPO.

    Args:
        model: a hub id or local folder of a diffusers pipeline, or a loaded ``DiffusionPipeline``
            (SD3/SD3.5, FLUX.1, Qwen-Image, Wan, FLUX.1 Kontext, Qwen-Image-Edit). Its transformer is trained;
            everything else is frozen.
        reward_funcs: a registry name, a callable ``fn(prompts, images, **columns) -> list[float | None]``, a
            ``"package.module:function"`` path, or a list of those (weighted by ``args.reward_weights``).
        args: a ``FlowGRPOConfig``.
        train_dataset / eval_dataset: a ``datasets.Dataset`` (or list of dicts / strings) with a ``prompt``
            column; other columns are passed to the rewards. Editing families (FLUX.1 Kontext, Qwen-Image-Edit)
            also need an ``image`` column (a path, a PIL image or a ``datasets.Image`` feature): each sample's
            source image, encoded at the working resolution and given to the rewards as PIL images.
        peft_config: a ``peft.LoraConfig`` for LoRA training; ``None`` fine-tunes the whole transformer. A config
            without ``target_modules`` gets the family's default targets (``adapter.default_lora_target_modules``;
            Wan 2.2 A14B: a LoRA on each of its two experts).
        callbacks, optimizers: as in ``transformers.Trainer``.
        pipeline_kwargs: extra ``from_pretrained`` arguments (e.g. ``revision``) when ``model`` is a string.
    """

    _tag_names = ["flow-grpo", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "Flow-GRPO"
    _paper = {
        "title": "Flow-GRPO: Training Flow Matching Models via Online RL",
        "id": "2505.05470",
        "citation": (
            "@article{liu2025flowgrpo,\n  title={Flow-GRPO: Training Flow Matching Models via Online RL},\n"
            "  author={Liu, Jie and others},\n  journal={arXiv preprint arXiv:2505.05470},\n  year={2025}\n}"
        ),
    }
    _config_class = FlowGRPOConfig
    #: set once the first-pass ratio has drifted beyond ``on_policy_tolerance`` (one warning per trainer)
    _warned_off_policy = False

    # ------------------------------------------------------------------------------------------------
    # rollouts: SDE steps in a window, the window's transitions recorded
    # ------------------------------------------------------------------------------------------------
    def _scheduler_options(self, args: FlowGRPOConfig) -> dict[str, Any]:
        return {"noise_level": args.noise_level, "sde_type": args.sde_type}

    def _sde_type(self) -> str:
        return self.args.sde_type

    def _rollout_plan(self, gen_index: int) -> tuple[int, int]:
        """The generation's SDE window: a function of the optimizer step and the seed only (resuming continues the
        schedule exactly)."""
        args = self.args
        window_gen = torch.Generator().manual_seed(_seed_for(args.seed, gen_index))
        return scheduled_sde_window(
            args.sde_window_strategy, self.state.global_step, args.num_inference_steps, args.sde_window_size,
            args.sde_window_range, args.sde_window_shift_interval, args.sde_window_stride, args.sde_window_roll_back,
            generator=window_gen,
        )

    def _rollout(self, model, embeds: PromptEmbeds, plan: tuple[int, int], generator: torch.Generator, progress,
                 group_ids: torch.Tensor, gen_index: int) -> tuple[torch.Tensor, dict]:
        """SDE inside the window ``plan``, ``ode_solver`` outside; records the window's transitions (x_j, x_{j+1},
        log p_old, t_j, sigmas; the transition means for GRPO-Guard) and the window."""
        args = self.args
        initial = self._group_initial_latents(group_ids, gen_index) if args.same_noise_per_group else None
        final, traj = self._sample(model, embeds, args.num_inference_steps, args.guidance_scale, args.noise_level,
                                   plan, generator, record=True, progress=progress, ode_solver=args.ode_solver,
                                   ode_compression_ratio=args.ode_compression_ratio, initial_latents=initial,
                                   record_means=args.ratio_normalization == "grpo_guard")
        traj["window"] = plan
        return final, traj

    def _group_initial_latents(self, group_ids: torch.Tensor, gen_index: int) -> torch.Tensor:
        """Initial noise shared by the members of each group (``same_noise_per_group``).

        Sample ``i`` draws x_1 from a generator seeded by (seed, generation index, ``group_ids[i]``), so every member
        of a group gets the same x_1 wherever it is sampled (any micro-batch, any process).
        """
        height, width = self.args.image_size
        gens = [torch.Generator().manual_seed(_seed_for(self.args.seed, 104729, gen_index, int(g)))
                for g in group_ids.tolist()]
        return self.adapter.prepare_latents(len(gens), height, width, gens, torch.device("cpu"), torch.float32)

    # ------------------------------------------------------------------------------------------------
    # training: the clipped likelihood ratio of each recorded transition
    # ------------------------------------------------------------------------------------------------
    def _reference_mean(self, model, x, t, embeds, sigma, sigma_next, height, width, v_ref=None):
        """Transition mean under the reference policy (LoRA disabled, or the frozen copy)."""
        with torch.no_grad():
            if v_ref is None:
                v_ref = self._reference_velocity(model, x, t, embeds, height, width)
            return sde_step_from_sigmas(v_ref, x, sigma, sigma_next, noise_level=self.args.noise_level,
                                        sde_type=self.args.sde_type).prev_sample_mean

    #: the per-step tensors of a recorded micro-batch (``(batch, steps, ...)``), reindexed by `_trained_steps`
    _STEP_KEYS = ("latents", "next_latents", "log_probs", "timesteps", "sigmas", "sigmas_next", "means")

    def _trained_steps(self, batch: dict) -> dict:
        """With ``timestep_fraction < 1`` (DanceGRPO), each sample keeps a random ``max(1, int(n * fraction))`` of
        its ``n`` recorded steps, in random order (a permutation per sample, as in the official code); drawn from
        the seed, the micro-step and the process, so that a resumed run draws the same."""
        fraction = self.args.timestep_fraction
        num_steps = batch["latents"].shape[1]
        if fraction >= 1:
            return batch
        keep = max(1, int(num_steps * fraction))
        size = batch["latents"].shape[0]
        gen = torch.Generator().manual_seed(_seed_for(self.args.seed, 7331, self._micro_step,
                                                      self.accelerator.process_index))
        order = torch.stack([torch.randperm(num_steps, generator=gen)[:keep] for _ in range(size)])
        rows = torch.arange(size)[:, None]
        selected = dict(batch)
        for key in self._STEP_KEYS:
            if key in batch:
                device = batch[key].device
                selected[key] = batch[key][rows.to(device), order.to(device)]
        return selected

    def _train_on_batch(self, model, record: dict, first_pass: bool) -> torch.Tensor:
        args = self.args
        batch = self._trained_steps(record)  # the record itself receives the advantages (_resolve_scoring)
        height, width = args.image_size
        num_steps = batch["latents"].shape[1]
        scale = 1.0 / (num_steps * self.current_gradient_accumulation_steps)
        embeds = batch["embeds"]
        total = torch.zeros((), device=self.accelerator.device)
        m = self._metrics["train"]
        backward_kwargs = self._backward_kwargs()
        sigma_max_fallback = float(self.sde_scheduler.sigmas[1])
        for j in range(num_steps):
            x, x_next = batch["latents"][:, j], batch["next_latents"][:, j]
            t, sigma, sigma_next = batch["timesteps"][:, j], batch["sigmas"][:, j], batch["sigmas_next"][:, j]
            old_logp = batch["log_probs"][:, j]
            with self._sync_on_last(model, j, num_steps):  # one backward per step
                tic = self._clock()
                with self.accelerator.autocast():
                    v = self._velocity(model, x, t, embeds, args.guidance_scale, height, width)
                out = sde_step_from_sigmas(v, x, sigma, sigma_next, prev_sample=x_next, noise_level=args.noise_level,
                                           sde_type=args.sde_type, sigma_max_fallback=sigma_max_fallback)
                if j == 0:  # the rewards of the last micro-batches were scored while this forward ran
                    tic = self._await_scoring(tic)
                    adv = record["advantages"]
                if args.ratio_normalization == "grpo_guard":
                    log_ratio = grpo_guard_log_ratio(out.prev_sample_mean, batch["means"][:, j], x_next, out.std)
                else:
                    log_ratio = out.log_prob - old_logp
                ratio = torch.exp(log_ratio)
                unclipped = -adv * ratio
                clipped = -adv * torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon)
                policy_loss = torch.maximum(unclipped, clipped).mean()
                loss = policy_loss
                if args.beta > 0:
                    with self.accelerator.autocast():
                        v_ref = self._reference_velocity(model, x, t, embeds, height, width)
                    ref_mean = None
                    if args.kl_estimator != "velocity":
                        ref_mean = self._reference_mean(model, x, t, embeds, sigma, sigma_next, height, width,
                                                        v_ref=v_ref)
                    kl = gated_mean(kl_estimate(args.kl_estimator, out.prev_sample_mean, ref_mean, out.std,
                                                prev_sample=x_next, velocity=v, ref_velocity=v_ref),
                                    batch.get("kl_gate"))  # GARDO: the gated samples only
                    loss = loss + args.beta * kl
                    m["kl"].append(float(kl.detach()))
                tac = self._clock()
                self.accelerator.backward(loss * scale, **backward_kwargs)
                toc = self._clock()
                m["timing/training_forward"].append(tac - tic)
                m["timing/training_backward"].append(toc - tac)
            total += loss.detach() * scale
            with torch.no_grad():
                m["policy_loss"].append(float(policy_loss))
                m["approx_kl"].append(float(0.5 * (log_ratio**2).mean()))
                m["clip_frac"].append(float(((ratio - 1).abs() > args.epsilon).float().mean()))
                m["ratio_mean"].append(float(ratio.mean()))
                m["sde_window_start"].append(float(batch["window"][0]))
                if first_pass:
                    drift = float((ratio - 1).abs().max())
                    m["on_policy_ratio_max_dev"].append(drift)
                    if drift > args.on_policy_tolerance and not self._warned_off_policy:
                        self._warned_off_policy = True
                        warnings.warn(
                            f"On the first pass over a fresh batch the likelihood ratio should be exactly 1, but "
                            f"max |ratio - 1| = {drift:.3g} > on_policy_tolerance={args.on_policy_tolerance}. Likely "
                            "causes: dropout (e.g. lora_dropout > 0), a different dtype/autocast between sampling and "
                            "training, micro-batches whose composition differs from sampling, or non-deterministic "
                            "kernels.", stacklevel=2,
                        )
        return total

    def _card_setup_lines(self) -> list[str]:
        args = self.args
        return [
            f"- algorithm: {self._name} ({args.sde_type}, noise level {args.noise_level}, "
            f"{'window ' + str(args.sde_window_size) if args.sde_window_size else 'all steps'})",
            f"- group size {args.num_generations}, {args.num_inference_steps} sampling steps, guidance "
            f"{args.guidance_scale}, {args.height}x{args.width}"
            + (f", {args.num_frames} frames" if args.num_frames > 1 else ""),
            *generation_card_lines(self),
            f"- beta (KL) {args.beta}, clip range {args.epsilon}, learning rate {args.learning_rate}",
            f"- SDE window: sde_window_strategy={args.sde_window_strategy}, sde_window_range={args.sde_window_range}, "
            f"sde_window_shift_interval={args.sde_window_shift_interval}, sde_window_stride={args.sde_window_stride}, "
            f"sde_window_roll_back={args.sde_window_roll_back}",
            f"- deterministic steps: ode_solver={args.ode_solver}, ode_compression_ratio={args.ode_compression_ratio:g}",
            f"- objective: ratio_normalization={args.ratio_normalization}, kl_estimator={args.kl_estimator}, "
            f"reward_aggregation={args.reward_aggregation}, scale_rewards={args.scale_rewards}, "
            f"same_noise_per_group={args.same_noise_per_group}, timestep_fraction={args.timestep_fraction:g}",
        ]


__all__ = ["FlowGRPOTrainer", "LORA_WEIGHTS_NAME"]
