r"""The flow-matching quantities the trainers that train on the forward process share (DiffusionNFT, AWM,
Diffusion-DPO), as pure functions.

Notation: x0 a clean sample, eps Gaussian noise, sigma (``t``) a noise level in [0, 1],
x_t = (1 - sigma) x0 + sigma eps its forward-process point, v a velocity prediction at (x_t, sigma), and
v* = eps - x0 the flow-matching target.
"""

from __future__ import annotations

import torch

__all__ = ["flow_matching_error", "noised_sample", "per_sample", "sigma_timesteps"]


def per_sample(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """``sigma`` (a scalar or one value per sample) shaped to broadcast over ``like``'s non-batch dimensions."""
    sigma = torch.as_tensor(sigma, dtype=like.dtype, device=like.device)
    if sigma.dim() == 0:
        sigma = sigma.expand(like.shape[0])
    return sigma.reshape(-1, *([1] * (like.dim() - 1)))


def noised_sample(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
    """The forward-process point x_t = (1 - sigma) x0 + sigma eps (``sigma`` a scalar or one value per sample)."""
    s = per_sample(sigma, x0)
    return (1 - s) * x0 + s * noise


def flow_matching_error(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-sample flow-matching error ``mean((v - (eps - x0))^2)`` over the non-batch dimensions, shape ``(B,)``,
    computed in ``dtype`` (AWM's official code: float64)."""
    err = (v.to(dtype) - (noise.to(dtype) - x0.to(dtype))) ** 2
    return err.mean(dim=tuple(range(1, err.ndim)))


def sigma_timesteps(sigma: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """The model's timestep for noise level ``sigma``: ``sigma * num_train_timesteps`` (as in diffusers'
    ``FlowMatchEulerDiscreteScheduler``, whose ``timesteps`` are ``sigmas * num_train_timesteps``)."""
    return sigma * num_train_timesteps
