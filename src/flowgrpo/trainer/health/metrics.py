r"""Training-health diagnostics computed from one rollout batch (all cheap; logged under ``health/...``).

**Within-group diversity** (``health/diversity/<feature>``). For the images of group g with features f_1..f_G,

    D_g = 2 / (G (G - 1)) * sum_{i < j} ||f_i - f_j||_2,        diversity = mean over groups with G >= 2 of D_g.

The feature is named in the key: ``clip`` (the L2-normalised CLIP image embedding of a CLIP-family reward that
is loaded, so ||f_i - f_j|| = sqrt(2 - 2 cos) lies in [0, 2]) or ``grey32`` (the image resized to 32x32, grey
levels in [0, 1], divided by 32 so that ||f_i - f_j|| is the root-mean-square pixel difference, in [0, 1]).
A group collapsing onto one image drives D_g to 0.

**Zero-std groups** (``health/zero_std_groups``): the fraction of groups whose valid rewards are all equal
(population std <= 1e-12); they get advantage 0 everywhere and carry no learning signal.

**Reward correlations** (``health/reward_correlation/<a>__<b>``): Pearson's r between reward components a and
b over the images both scored, r = cov(a, b) / (std(a) std(b)); NaN when fewer than 2 pairs or a constant.

**KL to the reference** (``health/kl_to_reference``): the analytic KL between the policy's and the reference's
Gaussian transitions of one SDE step, KL = mean((mu_theta - mu_ref)^2) / (2 std^2) (mean over elements and
samples; `kl_between_transitions`), the same quantity as Flow-GRPO's penalty.

**Update ratio** (``health/lora_update_ratio``): for LoRA layers with down A (r x in), up B (out x r) and scale s,
the update is dW = s B A; the ratio is sqrt(sum_l ||dW_l||_F^2) / sqrt(sum_l ||W_l||_F^2) over the LoRA layers l
(W_l: the frozen base weight). ||B A||_F^2 = sum((B^T B) * (A A^T)) needs only r x r products. For full
fine-tuning (``health/weight_update_ratio``): ||theta - theta_0|| / ||theta_0|| over the trained tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "GREY_FEATURE_SIZE",
    "grey_features",
    "kl_between_transitions",
    "lora_update_ratio",
    "reward_correlations",
    "weight_update_ratio",
    "within_group_diversity",
    "zero_std_group_fraction",
]

GREY_FEATURE_SIZE = 32


def grey_features(images: Sequence[Any], size: int = GREY_FEATURE_SIZE) -> torch.Tensor:
    """``(n, size * size)`` features: each image (PIL, or a list of PIL frames: its first frame) as grey levels in
    [0, 1] at ``size x size`` (bilinear), divided by ``size`` (so distances are RMS pixel differences)."""
    from PIL import Image

    rows = []
    for image in images:
        if isinstance(image, (list, tuple)):
            image = image[0]
        if not isinstance(image, Image.Image):
            image = Image.fromarray(np.asarray(image))
        grey = image.convert("L").resize((size, size), Image.BILINEAR)
        rows.append(torch.from_numpy(np.asarray(grey, dtype=np.float32) / 255.0).reshape(-1) / size)
    if not rows:
        return torch.zeros(0, size * size)
    return torch.stack(rows)


def within_group_diversity(features: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Mean over groups (of at least 2 images) of the mean pairwise Euclidean distance of ``features`` (n, d)
    within the group; NaN when no group has 2 images."""
    features = features.double()
    group_ids = torch.as_tensor(group_ids)
    if features.shape[0] != group_ids.shape[0]:
        raise ValueError(f"{features.shape[0]} feature rows but {group_ids.shape[0]} group ids")
    per_group = []
    for g in torch.unique(group_ids):
        f = features[group_ids == g]
        n = f.shape[0]
        if n < 2:
            continue
        d = torch.cdist(f, f)
        per_group.append(float(d.sum() / (n * (n - 1))))
    return float(np.mean(per_group)) if per_group else math.nan


def zero_std_group_fraction(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of groups (with at least one valid reward) whose valid rewards (NaN excluded) have zero std."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    group_ids = torch.as_tensor(group_ids)
    groups = zero = 0
    for g in torch.unique(group_ids):
        r = rewards[group_ids == g]
        r = r[~torch.isnan(r)]
        if r.numel() == 0:
            continue
        groups += 1
        zero += int(float(r.std(unbiased=False)) <= 1e-12)
    return zero / groups if groups else math.nan


def reward_correlations(per_reward: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{"<a>__<b>": Pearson r}`` for every pair a < b (in the given order) of reward components."""
    names = list(per_reward)
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x = torch.as_tensor(per_reward[a], dtype=torch.float64)
            y = torch.as_tensor(per_reward[b], dtype=torch.float64)
            ok = ~(torch.isnan(x) | torch.isnan(y))
            x, y = x[ok], y[ok]
            r = math.nan
            if x.numel() >= 2:
                xc, yc = x - x.mean(), y - y.mean()
                denom = float(xc.norm() * yc.norm())
                if denom > 0:
                    r = float((xc * yc).sum()) / denom
            out[f"{a}__{b}"] = r
    return out


def kl_between_transitions(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> float:
    """mean over samples and elements of (mean - ref_mean)^2 / (2 std^2); ``std`` broadcasts (per sample)."""
    std = torch.as_tensor(std, dtype=torch.float64, device=mean.device)
    while std.dim() < mean.dim():
        std = std.unsqueeze(-1)
    return float(((mean.double() - ref_mean.double()) ** 2 / (2 * std**2)).mean())


def lora_update_ratio(model: torch.nn.Module, adapter_name: str = "default",
                      base_norms: dict[str, float] | None = None) -> float:
    """sqrt(sum ||s B A||_F^2) / sqrt(sum ||W||_F^2) over the peft LoRA layers of ``model`` for ``adapter_name``.

    ``base_norms`` caches the frozen weights' squared norms by layer name (filled on first use)."""
    from peft.tuners.lora import LoraLayer

    update_sq = base_sq = 0.0
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer) or adapter_name not in getattr(layer, "lora_A", {}):
            continue
        a = layer.lora_A[adapter_name].weight.detach().double()
        b = layer.lora_B[adapter_name].weight.detach().double()
        a, b = _full(a), _full(b)
        a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
        scale = float(layer.scaling[adapter_name])
        update_sq += scale**2 * float(((b.T @ b) * (a @ a.T)).sum())
        if base_norms is not None and name in base_norms:
            base_sq += base_norms[name]
        else:
            value = float(_full(layer.get_base_layer().weight.detach()).double().pow(2).sum())
            base_sq += value
            if base_norms is not None:
                base_norms[name] = value
    if base_sq == 0:
        return math.nan
    return math.sqrt(update_sq) / math.sqrt(base_sq)


def weight_update_ratio(trained: Iterable[torch.Tensor], initial: Iterable[torch.Tensor]) -> float:
    """||theta - theta_0|| / ||theta_0|| over paired tensors (full fine-tuning)."""
    diff_sq = base_sq = 0.0
    for theta, theta0 in zip(trained, initial, strict=True):
        t, t0 = _full(theta.detach()).double(), _full(theta0.detach()).double().to(theta.device)
        diff_sq += float((t - t0).pow(2).sum())
        base_sq += float(t0.pow(2).sum())
    return math.sqrt(diff_sq) / math.sqrt(base_sq) if base_sq > 0 else math.nan


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP2 DTensor) tensor gathered whole; other tensors as they are."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
