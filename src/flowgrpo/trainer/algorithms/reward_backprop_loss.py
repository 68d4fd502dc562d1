r"""The reward-gradient methods' math as pure functions: DRaFT (Clark et al., ICLR 2024), DRaFT-LV, ReFL (ImageReward's
training, THUDM/ImageReward ``ReFL.py``) and AlignProp (Prabhudesai et al.).

Notation: sigma_0 = 1 > sigma_1 > ... > sigma_T = 0 the sampling schedule's noise levels, x_i the state at level
sigma_i, v_theta(x, t) the velocity (after classifier-free guidance when guidance is on), r(image) the weighted sum of
the differentiable rewards of a decoded image, sg the stop-gradient. A deterministic (Euler, ODE) sampler step is

    x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v_theta(x_i, t_i),

and the flow-matching prediction of the clean sample from x_i is its step to sigma = 0,

    x0_hat(x_i) = x_i - sigma_i v_theta(x_i, t_i).

* **DRaFT-K** (``draft``): steps 0 .. T-K-1 without gradient, the last K with gradient; the loss is
  ``-scale * mean r(decode(x_T))``. K = T is full DRaFT.
* **AlignProp** (``alignprop``): DRaFT-K with K drawn for every rollout (`alignprop_backprop_steps`): the official code
  (mihirp1998/AlignProp ``sd_pipeline.py``) draws the first step with gradient b (uniform in an interval, or
  ``int(N(mean, std))`` redrawn until 1 <= b <= T - 1) and detaches every earlier velocity, which is K = T - b.
* **DRaFT-LV** (``draft_lv``): the whole trajectory without gradient to x_T; then n fresh draws eps_k re-noise it to
  the last level, ``x~_k = (1 - sigma_{T-1}) sg(x_T) + sigma_{T-1} eps_k``, and each is denoised by the last step with
  gradient, ``x0_k = x0_hat(x~_k)``; the loss is ``-scale * mean_k mean r(decode(x0_k))`` (`renoised_last_state`).
* **ReFL** (``refl``): m drawn uniformly from ``refl_step_range`` (inclusive; official 30..39 of 40 steps), steps
  0 .. m-1 without gradient, then one step with gradient: ``x0 = x0_hat(x_m)``, decoded and scored; the loss is
  ``scale * mean relu(target - r)`` (``relu``, official target 2 and scale 1e-3) or ``-scale * mean r`` (``linear``)
  (`refl_loss`). Optionally the pretraining (denoising) loss on the dataset's images, ``mean ||v_theta(x_s) - (eps -
  x0)||^2`` at x_s = (1 - s) x0 + s eps, s uniform in (0, 1) (`pretrain_loss`).

Optional KL to the base (``kl_beta``): at each state a step with gradient starts from, ``mean (v_theta - v_base)^2``,
averaged over those steps (`velocity_kl`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...schedulers.flow_matching import flow_matching_error, noised_sample, per_sample

__all__ = ["ALIGNPROP_TRUNCATIONS", "REFL_LOSSES", "REWARD_BACKPROP_MODES", "RewardGradientLoss",
           "alignprop_backprop_steps", "default_refl_step_range", "pretrain_loss", "refl_loss", "refl_step", "renoised_last_state",
           "reward_gradient_loss", "unrolled_euler", "velocity_kl", "x0_prediction"]

REWARD_BACKPROP_MODES = ("draft", "draft_lv", "refl", "alignprop")
REFL_LOSSES = ("relu", "linear")
ALIGNPROP_TRUNCATIONS = ("uniform", "gaussian")


def x0_prediction(state: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """The flow-matching prediction of the clean sample, ``x0_hat = x_t - sigma v`` (``sigma`` a number or one value
    per sample)."""
    return state - per_sample(sigma, state) * velocity


def unrolled_euler(velocity: Callable[[torch.Tensor, int], torch.Tensor], state: torch.Tensor,
                   sigmas: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Euler steps ``start .. end - 1`` of the schedule ``sigmas`` from ``state`` (the state at ``sigmas[start]``):
    ``x <- x + (sigmas[i + 1] - sigmas[i]) velocity(x, i)``; gradients flow through every step (``velocity`` may
    checkpoint its forward)."""
    x = state
    for i in range(start, end):
        x = x + (sigmas[i + 1] - sigmas[i]).to(x.dtype) * velocity(x, i)
    return x


def renoised_last_state(final: torch.Tensor, noise: torch.Tensor, sigma_last: torch.Tensor | float) -> torch.Tensor:
    """DRaFT-LV's state at the last level: ``(1 - sigma_last) sg(x_T) + sigma_last eps``, the final sample re-noised
    by the forward process with a fresh draw."""
    return noised_sample(final.detach(), noise, sigma_last)


def refl_step(step_range: tuple[int, int] | list[int], generator: torch.Generator) -> int:
    """ReFL's step with gradient, uniform over ``step_range = [lo, hi]`` inclusive (the official
    ``random.randint(30, 39)``)."""
    lo, hi = int(step_range[0]), int(step_range[1])
    return int(torch.randint(lo, hi + 1, (1,), generator=generator))


def alignprop_backprop_steps(num_steps: int, truncation: str, backprop_steps: int, std: float,
                             generator: torch.Generator) -> int:
    """AlignProp's steps with gradient K = T - b for one rollout, b the first step with gradient (T =
    ``num_steps``):

    * ``uniform``: b uniform over T - ``backprop_steps`` .. T - 1, so K uniform over 1 .. ``backprop_steps`` (the
      official ``uniform`` {min 30, max 50} of 50 steps is ``backprop_steps`` 20);
    * ``gaussian``: b = int(z), z ~ N(T - ``backprop_steps``, ``std``), drawn again until 1 <= b <= T - 1 (the official
      default, mean 42 and std 5 of 50 steps, is ``backprop_steps`` 8, std 5; ``int`` truncates toward 0, as
      Python's).
    """
    if truncation == "uniform":
        lo = max(1, num_steps - int(backprop_steps))
        return num_steps - int(torch.randint(lo, num_steps, (1,), generator=generator))
    if truncation != "gaussian":
        raise ValueError(f"truncation={truncation!r} is not valid; choose one of {', '.join(ALIGNPROP_TRUNCATIONS)}.")
    mean = float(num_steps - int(backprop_steps))
    for _ in range(10_000):
        b = int(mean + float(std) * float(torch.randn((), generator=generator)))
        if 1 <= b <= num_steps - 1:
            return num_steps - b
    raise ValueError(f"alignprop's gaussian truncation N({mean}, {std}) never fell in 1 .. {num_steps - 1}; lower "
                     "alignprop_truncation_std or bring backprop_steps inside 1 .. num_inference_steps - 1.")


@dataclass
class RewardGradientLoss:
    """A reward-gradient loss: ``loss`` (with gradient) and its parts (detached)."""

    loss: torch.Tensor
    reward_loss: torch.Tensor
    kl: torch.Tensor | None = None


def _valid_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over ``valid`` (a rewardless image carries no gradient path): 0 with the graph kept when
    nothing is valid."""
    if not bool(valid.any()):
        return values.nan_to_num(0.0).sum() * 0.0
    return values[valid].mean()


def reward_gradient_loss(rewards: torch.Tensor, valid: torch.Tensor, scale: float = 1.0,
                         kl: torch.Tensor | None = None, kl_beta: float = 0.0) -> RewardGradientLoss:
    """DRaFT's loss, ``-scale * mean r`` over the images that could be scored, plus ``kl_beta * kl``."""
    reward_loss = -float(scale) * _valid_mean(rewards, valid)
    loss = reward_loss + kl_beta * kl if kl is not None and kl_beta > 0 else reward_loss
    return RewardGradientLoss(loss, reward_loss.detach(), None if kl is None else kl.detach())


def refl_loss(rewards: torch.Tensor, valid: torch.Tensor, kind: str = "relu", target: float = 2.0,
              scale: float = 1e-3, kl: torch.Tensor | None = None, kl_beta: float = 0.0) -> RewardGradientLoss:
    """ReFL's loss: ``scale * mean relu(target - r)`` (``relu``: an image scoring above ``target`` gives no gradient)
    or ``-scale * mean r`` (``linear``), over the images that could be scored, plus ``kl_beta * kl``. Hand check:
    r = (1.5, 2.5), relu, target 2, scale 1e-3 -> 2.5e-4 (the second image's term is 0)."""
    if kind == "relu":
        terms = torch.relu(float(target) - rewards)
    elif kind == "linear":
        terms = -rewards
    else:
        raise ValueError(f"refl_loss={kind!r} is not valid; choose one of {', '.join(map(repr, REFL_LOSSES))}.")
    reward_loss = float(scale) * _valid_mean(terms, valid)
    loss = reward_loss + kl_beta * kl if kl is not None and kl_beta > 0 else reward_loss
    return RewardGradientLoss(loss, reward_loss.detach(), None if kl is None else kl.detach())


def velocity_kl(velocity: torch.Tensor, reference_velocity: torch.Tensor) -> torch.Tensor:
    """The penalty to the base at one state: ``mean (v_theta - v_base)^2`` over every element."""
    return (velocity.float() - reference_velocity.float().detach()).square().mean()


def pretrain_loss(velocity: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """ReFL's pretraining loss, the flow-matching regression ``mean ||v - (eps - x0)||^2`` (the ``velocity`` at
    x_s = (1 - s) x0 + s eps), over the batch."""
    return flow_matching_error(velocity, noise, x0).mean()


def default_refl_step_range(num_steps: int) -> list[int]:
    """The official step range [30, 39] of 40 steps, scaled to ``num_steps``: ``[floor(0.75 T), T - 1]``."""
    return [min(num_steps - 1, math.floor(0.75 * num_steps)), num_steps - 1]
