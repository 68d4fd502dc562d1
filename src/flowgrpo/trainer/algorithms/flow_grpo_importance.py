r"""Stale SDE-window rollouts replayed by the trainer's weights: Flow-GRPO's corrections of samples drawn by older
weights on the Ray backend, which calls them through the trainer (`FlowGRPOTrainer._stale_generation_replay`) when a
stale generation arrives.

A worker records the behaviour log-probs log mu(x_{j+1} | x_j) (and, for GRPO-Guard, Flow-DPPO and trees, the
transition means) of the weights that sampled (version v). With ``max_staleness >= 1`` the trainer's weights at the
start of the step (the proximal policy pi_prox, version s(g)) may differ. `replay_proximal` recomputes, without
gradient, what pi_prox gives each recorded transition: one forward per recorded step and sample (twice with
classifier-free guidance), against a forward and a backward per step in training, about a third of a training step's
compute (measured on the toy world: docs/distributed.md). A BranchGRPO tree's edges get their split-aware log-probs
(`branch_grpo.edge_log_prob`), as when they were drawn.

**Truncated importance weights** (``truncated_importance_cap: C``), as in decoupled PPO:

    log pi_prox(x_{j+1} | x_j)            replayed
    r_theta = exp(log pi_theta - log pi_prox)                     the clipped ratio of the loss, unchanged
    w = min(exp(sum_j [log pi_prox - log mu]), C)                 per sample, over its recorded window
    A <- w A                                                      the advantage the loss sees

so the clipped ratio measures the update's own step while w corrects (truncated at C, bounding the variance) for the
samples having come from mu. The window's transitions are one action per sample, hence one weight per sample
(trajectory-level truncation). GRPO-Guard's transition means are replaced by pi_prox's as well.

**Flow-DPPO's anchor** (``policy_loss: dppo`` without a cap): the trust region is meant around the weights being
updated, mu_old = the transition mean of the weights that sampled the batch, which on the local backend are the
weights at the start of the step. For a stale sample the anchor is replayed: each record's means and log-probs become
pi_prox's (`apply_proximal_anchor`), so the first pass over it has D = 0 and rho = 1, as with a fresh sample; the
stale sampler only chose which states are visited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...schedulers import sde_transition
from .branch_grpo import edge_log_prob
from .branch_grpo_rollout import is_tree_record

__all__ = ["apply_proximal_anchor", "apply_truncated_importance_weights", "replay_proximal",
           "stale_generation_replay"]


@torch.no_grad()
def replay_proximal(policy: Any, model: torch.nn.Module, engine: Any, record: dict,
                    args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_prox's log-prob and transition mean of every recorded step of ``record`` (``(batch, steps)`` and
    ``(batch, steps, ...)``), ``model`` being the trainer's (inside ``policy.generation_context()``)."""
    height, width = args.image_size
    sde = engine.sde_settings()
    tree = is_tree_record(record)
    log_probs, means = [], []
    for j in range(record["latents"].shape[1]):
        x, x_next = record["latents"][:, j], record["next_latents"][:, j]
        v = policy.velocity(model, x, record["timesteps"][:, j], record["embeds"], args.guidance_scale, height, width)
        out = sde_transition(v, x, record["sigmas"][:, j], record["sigmas_next"][:, j], sde, next_state=x_next)
        log_prob = out.log_prob
        if tree:  # the edge's log-prob as drawn: the split-scaled std on split edges (branch_split_log_prob)
            log_prob = edge_log_prob(x_next, out.prev_sample_mean, out.std, bool(record["tree_split"][j]),
                                     args.branch_noise_scale, split_log_prob=args.branch_split_log_prob)
        log_probs.append(log_prob.float())
        means.append(out.prev_sample_mean.float())
    return torch.stack(log_probs, dim=1), torch.stack(means, dim=1)


@torch.no_grad()
def apply_truncated_importance_weights(policy: Any, engine: Any, records: list[dict], args: Any) -> torch.Tensor:
    """Replay every record's window with the trainer's current weights; each record then holds ``log_probs`` (and
    ``means``) of pi_prox, ``behaviour_log_probs`` (the worker's) and ``importance_weights`` (w, one per sample).
    Returns every sample's w."""
    weights = []
    with policy.generation_context() as model:
        for record in records:
            proximal, means = replay_proximal(policy, model, engine, record, args)
            behaviour = record["log_probs"]
            record["behaviour_log_probs"] = behaviour
            record["log_probs"] = proximal
            if "means" in record:
                record["means"] = means
            w = torch.exp((proximal - behaviour).sum(dim=1)).clamp(max=float(args.truncated_importance_cap))
            record["importance_weights"] = w
            weights.append(w)
    return torch.cat(weights)


@torch.no_grad()
def apply_proximal_anchor(policy: Any, engine: Any, records: list[dict], args: Any) -> float:
    """Flow-DPPO's anchor of stale records: each record's ``means`` and ``log_probs`` become pi_prox's (the worker's
    log-probs are kept as ``behaviour_log_probs``). Returns the mean over samples of the behaviour-to-proximal
    log-ratio summed over the recorded steps (how far the sampler was from the anchor)."""
    shifts = []
    with policy.generation_context() as model:
        for record in records:
            proximal, means = replay_proximal(policy, model, engine, record, args)
            shifts.append((proximal - record["log_probs"]).sum(dim=1))
            record["behaviour_log_probs"] = record["log_probs"]
            record["log_probs"] = proximal
            record["means"] = means
    return float(torch.cat(shifts).mean())


def stale_generation_replay(policy: Any, engine: Any, args: Any) -> Callable[[list[dict]], dict[str, float]] | None:
    """What the Ray backend calls on each generation sampled by older weights (``records -> metrics to log``):
    truncated importance weights when ``truncated_importance_cap`` is set, else Flow-DPPO's anchor replay with
    ``policy_loss: dppo``; None when stale samples are trained as they are."""
    cap = args.truncated_importance_cap
    if cap is not None:
        def importance(records: list[dict]) -> dict[str, float]:
            weights = apply_truncated_importance_weights(policy, engine, records, args)
            return {"rollout/importance_weight_mean": float(weights.mean()),
                    "rollout/importance_weight_truncated": float((weights >= cap).float().mean())}

        return importance
    if args.policy_loss == "dppo":
        def anchor(records: list[dict]) -> dict[str, float]:
            return {"dppo/anchor_log_ratio": apply_proximal_anchor(policy, engine, records, args)}

        return anchor
    return None
