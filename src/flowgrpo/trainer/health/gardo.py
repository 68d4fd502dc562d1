r"""GARDO (Gated and Adaptive Regularization with Diversity-aware Optimization, arXiv 2512.24138), as published in
its official code (tinnerhrhe/GARDO: ``scripts/train_sd3_grpo_gardo.py``, ``flow_grpo/stat_tracking.py``).

Notation: a gathered generation batch of N images, proxy reward r (the training reward), auxiliary rewards
a^(1..K) (other reward models, weight 0 in training), groups g (the images of one prompt).

1. **Uncertainty** (`reward_uncertainty`). Each reward ranks the batch, rank 1 = highest (ties in batch order):

       u_i = rank_r(i) - (1 / K) sum_k rank_{a^(k)}(i)

   (the official code: ``ranks[main] - (ranks[aesthetic] + ranks[imagereward]) / 2``). With the win rate
   w(i) = (N - rank(i)) / (N - 1) (the fraction of the batch that image i beats) this is
   u_i = (N - 1) (mean_k w_{a^(k)}(i) - w_r(i)): a positive u_i marks an image that the auxiliary rewards place
   above where the proxy places it.
2. **Gate** (`uncertainty_gate`). Among the images with u_i >= 0, those above the (100 - 100 f)-th percentile
   (numpy's linear interpolation) of their u are *gated*: u_i > percentile({u_j : u_j >= 0}, 100 - 100 f).
   Only gated images get the KL penalty (`flow_grpo_loss.gated_mean`): KL = mean over gated images of (mu_theta - mu_ref)^2 / (2 std^2)
   (nothing when none is gated); loss = policy loss + beta KL.
3. **Adaptive gate fraction** (`GateFraction`, the official ``RiskCompensator``): f starts at 0.1; each batch,
   with m = mean({u_j >= 0}) and the buffer B of the last 20 such means: f <- f (1 + 0.1) if m > max(B),
   f <- f (1 - 0.1) if m < min(B), then f is clipped to [0.02, 0.2] and m joins B (on the first batch f = 0.1).
4. **Adaptive reference** (`ReferenceResetSchedule`). After an optimizer step whose mean KL exceeds
   ``gardo_kl_threshold`` (official ``kl_thres``, 3e-4), a reset is due; at the start of generation k the
   reference is set to the current policy (a hard copy) when a reset is due (k > 0) or when more than
   ``gardo_reset_steps`` generations (official ``reset_freq``, 15) passed since the last reset.
5. **Diversity-aware advantages** (`diversity_aware_advantages`). Features f_i are L2-normalised; within group g,
   d_i = min_{j != i} (1 - clip(f_i . f_j, -1, 1)) (the distance to the nearest other image of the group) and

       A_i <- A_i * d_i / mean_{j in g}(d_j)    when r_i >= mean_g(r)   (high quality: amplified if diverse)
       A_i <- A_i                                otherwise

   The official code shapes A_i = r_i - mean_g(r) (no division by a std; ``scale_rewards: none`` here gives
   exactly that) with DINOv3 features; here the features are the within-group diversity feature of the health
   diagnostics (a CLIP embedding when a CLIP-family reward is loaded, else 32x32 grey pixels). A group whose
   images are all identical (mean d = 0) is left unchanged. The shaped advantages are clipped to
   +-``adv_clip_max`` as every advantage is.

Not reproduced: the official loss also weights each sample's policy term by std_t / mean(std_t), which is 1 when
all samples of a micro-batch share the timestep, as they do here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = [
    "GateFraction",
    "ReferenceResetSchedule",
    "descending_ranks",
    "diversity_aware_advantages",
    "reward_uncertainty",
    "uncertainty_gate",
]


def descending_ranks(values: torch.Tensor) -> torch.Tensor:
    """Rank 1 for the highest value, N for the lowest (ties keep batch order; NaN ranks last)."""
    v = torch.as_tensor(values, dtype=torch.float64).clone()
    v[torch.isnan(v)] = -math.inf
    order = torch.sort(v, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(1, len(v) + 1)
    return ranks.double()


def reward_uncertainty(proxy: torch.Tensor, auxiliary: Sequence[torch.Tensor]) -> torch.Tensor:
    """u_i = rank_proxy(i) - mean_k rank_aux_k(i) over the whole batch (see the module docstring)."""
    if not auxiliary:
        raise ValueError("GARDO's uncertainty needs at least one auxiliary reward (gardo_auxiliary_rewards).")
    aux = torch.stack([descending_ranks(a) for a in auxiliary]).mean(0)
    return descending_ranks(proxy) - aux


def uncertainty_gate(uncertainty: torch.Tensor, fraction: float) -> torch.Tensor:
    """Boolean mask of the gated samples: u > percentile(u[u >= 0], 100 - 100 fraction)."""
    u = torch.as_tensor(uncertainty, dtype=torch.float64)
    candidates = u[u >= 0].numpy()
    if candidates.size == 0:
        return torch.zeros_like(u, dtype=torch.bool)
    threshold = float(np.percentile(candidates, 100 - fraction * 100))
    return u > threshold


class GateFraction:
    """The official ``RiskCompensator``: the fraction of gated samples, adapted to the uncertainty's trend."""

    def __init__(self, base: float = 0.1, rate: float = 0.1, minimum: float = 0.02, maximum: float = 0.2,
                 buffer_size: int = 20):
        self.base, self.rate, self.minimum, self.maximum, self.buffer_size = base, rate, minimum, maximum, buffer_size
        self.fraction = base
        self.buffer: list[float] = []

    def update(self, uncertainty: torch.Tensor) -> float:
        """Update f from this batch's non-negative uncertainties; returns the new f."""
        u = torch.as_tensor(uncertainty, dtype=torch.float64)
        u = u[u >= 0]
        m = float(u.mean()) if u.numel() else 0.0
        if not self.buffer:
            self.fraction = self.base
        elif m > max(self.buffer):
            self.fraction *= 1 + self.rate
        elif m < min(self.buffer):
            self.fraction *= 1 - self.rate
        self.fraction = float(np.clip(self.fraction, self.minimum, self.maximum))
        self.buffer = (self.buffer + [m])[-self.buffer_size:]
        return self.fraction

    def state_dict(self) -> dict:
        return {"fraction": self.fraction, "buffer": list(self.buffer)}

    def load_state_dict(self, state: Mapping) -> None:
        self.fraction = float(state.get("fraction", self.base))
        self.buffer = [float(v) for v in state.get("buffer", [])]


class ReferenceResetSchedule:
    """When GARDO resets the reference to the current policy (see the module docstring, item 4)."""

    def __init__(self, kl_threshold: float, reset_steps: int):
        self.kl_threshold = float(kl_threshold)
        self.reset_steps = int(reset_steps)
        self.pending = False
        self.last_reset = 0
        self.resets: list[int] = []

    def observe_kl(self, kl: float) -> None:
        """The mean KL of an optimizer step; above the threshold a reset becomes due."""
        if math.isfinite(kl) and kl > self.kl_threshold:
            self.pending = True

    def should_reset(self, generation: int) -> bool:
        """Whether to reset before training on generation ``generation`` (0-based); records the reset."""
        due = (generation != 0 and self.pending) or (generation - self.last_reset > self.reset_steps)
        if due:
            self.pending = False
            self.last_reset = int(generation)
            self.resets.append(int(generation))
        return due

    def state_dict(self) -> dict:
        return {"pending": self.pending, "last_reset": self.last_reset, "resets": list(self.resets)}

    def load_state_dict(self, state: Mapping) -> None:
        self.pending = bool(state.get("pending", False))
        self.last_reset = int(state.get("last_reset", 0))
        self.resets = [int(v) for v in state.get("resets", [])]


def diversity_aware_advantages(advantages: torch.Tensor, rewards: torch.Tensor, features: torch.Tensor,
                               group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GARDO's shaping (module docstring, item 5): returns (shaped advantages, per-sample factor)."""
    adv = torch.as_tensor(advantages, dtype=torch.float64)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    f = torch.as_tensor(features, dtype=torch.float64)
    f = f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)
    group_ids = torch.as_tensor(group_ids)
    factor = torch.ones_like(adv)
    for g in torch.unique(group_ids):
        idx = torch.nonzero(group_ids == g).flatten()
        if idx.numel() < 2:
            continue
        fg = f[idx]
        dist = 1 - (fg @ fg.T).clamp(-1, 1)
        dist.fill_diagonal_(math.inf)
        nearest = dist.min(dim=1).values
        mean_d = float(nearest.mean())
        rg = r[idx]
        valid = ~torch.isnan(rg)
        if mean_d <= 0 or not bool(valid.any()):
            continue
        mean_r = float(rg[valid].mean())
        high = valid & (rg - mean_r >= 0)
        factor[idx[high]] = nearest[high] / mean_d
    return adv * factor, factor
