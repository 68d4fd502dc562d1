r"""Truncated importance weights for stale SDE-window rollouts (``truncated_importance_cap``): Flow-GRPO's correction
of samples drawn by older weights on the Ray backend, which calls it through the trainer
(`FlowGRPOTrainer._stale_generation_replay`) when a stale generation arrives.

A worker records the behaviour log-probs log mu(x_{j+1} | x_j) of the weights that sampled (version v). With
``max_staleness >= 1`` the trainer's weights at the start of the step (the proximal policy pi_prox, version s(g)) may
differ. Without this option the clipped ratio is taken against mu directly (PPO with stale samples; the clip bounds
the step). With it, as in decoupled PPO, each generation is replayed by pi_prox when it arrives:

    log pi_prox(x_{j+1} | x_j)            one no-grad forward per recorded step and sample
    r_theta = exp(log pi_theta - log pi_prox)                     the clipped ratio of the loss, unchanged
    w = min(exp(sum_j [log pi_prox - log mu]), C)                 per sample, over its recorded window
    A <- w A                                                      the advantage the loss sees

so the clipped ratio measures the update's own step while w corrects (truncated at C, bounding the variance) for the
samples having come from mu. The window's transitions are one action per sample, hence one weight per sample
(trajectory-level truncation). GRPO-Guard's transition means are replaced by pi_prox's as well.

Cost: the replay is one forward without gradient per recorded step and sample (twice with classifier-free guidance),
against a forward and a backward per step in training: about a third of a training step's compute (measured on the toy
world: docs/distributed.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ...schedulers import sde_transition

__all__ = ["apply_truncated_importance_weights"]


@torch.no_grad()
def apply_truncated_importance_weights(policy: Any, engine: Any, records: list[dict], args: Any) -> torch.Tensor:
    """Replay every record's window with the trainer's current weights; each record then holds ``log_probs`` (and
    ``means``) of pi_prox, ``behaviour_log_probs`` (the worker's) and ``importance_weights`` (w, one per sample).
    Returns every sample's w."""
    height, width = args.image_size
    sde = engine.sde_settings()
    weights = []
    with policy.generation_context() as model:
        for record in records:
            steps = record["latents"].shape[1]
            log_probs, means = [], []
            for j in range(steps):
                x, x_next = record["latents"][:, j], record["next_latents"][:, j]
                v = policy.velocity(model, x, record["timesteps"][:, j], record["embeds"], args.guidance_scale, height,
                                    width)
                out = sde_transition(v, x, record["sigmas"][:, j], record["sigmas_next"][:, j], sde,
                                     next_state=x_next)
                log_probs.append(out.log_prob.float())
                means.append(out.prev_sample_mean.float())
            proximal = torch.stack(log_probs, dim=1)
            behaviour = record["log_probs"]
            record["behaviour_log_probs"] = behaviour
            record["log_probs"] = proximal
            if "means" in record:
                record["means"] = torch.stack(means, dim=1)
            w = torch.exp((proximal - behaviour).sum(dim=1)).clamp(max=float(args.truncated_importance_cap))
            record["importance_weights"] = w
            weights.append(w)
    return torch.cat(weights)
