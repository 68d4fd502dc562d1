r"""Diffusion-DPO in its flow-matching form (Wallace et al., arXiv 2311.12908), as pure functions.

Notation: a preference pair of clean samples, the preferred x_w and the rejected x_l, of one prompt; one noise
level t and one noise eps shared by the pair; x_t = (1 - t) x0 + t eps for each; v* = eps - x0 the flow-matching
target; e = mean((v(x_t, t) - v*)^2) over the non-batch dimensions, for the policy (e_w, e_l) and the reference, the
frozen base with the LoRA adapter disabled (e_w_ref, e_l_ref, no gradient).

    inside = -beta_dpo / 2 ((e_w - e_w_ref) - (e_l - e_l_ref))
    L      = mean over pairs of -log sigmoid(inside)

Lowering the policy's error on the preferred sample relative to the reference, and raising it on the rejected one,
lowers the loss. The gradient with respect to e_w of pair p is beta_dpo / 2 sigmoid(-inside_p) / P, and the opposite
for e_l; at the start (policy = reference, inside = 0) it is beta_dpo / (4 P). So sigmoid(-inside_p), 1/2 at the
start, is the weight of pair p's gradient: near 0 for a pair already ordered with a large margin, near 1 for one
ordered the wrong way. With a large beta_dpo, |inside| grows to several units within a few steps and the weights
collapse to 0 or 1, decided by each draw's noise more than by the pair.

With K (t, eps) draws per pair (``dpo_num_noise_draws``), the loss is the mean over the K P terms: `dpo_loss` on the
draws' errors stacked (or K backward passes of each draw's loss / K, the same gradient).

Logged (`DPOLoss.metrics`): the implicit accuracy (share of pairs with inside > 0), the mean of inside, the mean of
|inside| and the mean gradient weight sigmoid(-inside) (the signed mean hides both: +8 and -8 average to 0).
``tests/trainer/algorithms/test_dpo.py`` checks loss, gradient and diagnostics by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["DPOLoss", "dpo_loss"]


@dataclass
class DPOLoss:
    """What `dpo_loss` returns: the scalar ``loss`` and, per pair, ``inside`` (the logit of the preference)."""

    loss: torch.Tensor
    inside: torch.Tensor

    @property
    def accuracy(self) -> torch.Tensor:
        """Share of pairs the policy prefers the right way, relative to the reference (inside > 0)."""
        return (self.inside.detach() > 0).float().mean()

    @property
    def abs_inside(self) -> torch.Tensor:
        """Mean |inside|: how far the logits are from 0 (the start), whatever their sign."""
        return self.inside.detach().abs().mean()

    @property
    def gradient_weight(self) -> torch.Tensor:
        """Mean sigmoid(-inside): the pairs' gradient weights, 1/2 at the start; near 0 or 1 when saturated."""
        return torch.sigmoid(-self.inside.detach()).mean()

    def metrics(self) -> dict[str, float]:
        """The values to log: ``dpo/accuracy``, ``dpo/inside`` (signed mean), ``dpo/abs_inside``,
        ``dpo/gradient_weight``."""
        return {"dpo/accuracy": float(self.accuracy), "dpo/inside": float(self.inside.detach().mean()),
                "dpo/abs_inside": float(self.abs_inside), "dpo/gradient_weight": float(self.gradient_weight)}


def dpo_loss(error_w: torch.Tensor, error_l: torch.Tensor, ref_error_w: torch.Tensor, ref_error_l: torch.Tensor,
             beta_dpo: float) -> DPOLoss:
    """The loss from per-pair flow-matching errors ``(P,)`` of the policy and the reference (see the module
    docstring); computed in float32 at least."""
    dtype = torch.promote_types(error_w.dtype, torch.float32)
    model_diff = error_w.to(dtype) - error_l.to(dtype)
    ref_diff = (ref_error_w.to(dtype) - ref_error_l.to(dtype)).detach()
    inside = -0.5 * beta_dpo * (model_diff - ref_diff)
    return DPOLoss(loss=-F.logsigmoid(inside).mean(), inside=inside)
