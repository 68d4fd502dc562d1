r"""Diffusion-DPO in its flow-matching form (Wallace et al., arXiv 2311.12908), as pure functions.

Notation: a preference pair of clean samples, the preferred x_w and the rejected x_l, of one prompt; one noise
level t and one noise eps shared by the pair; x_t = (1 - t) x0 + t eps for each; v* = eps - x0 the flow-matching
target; e = mean((v(x_t, t) - v*)^2) over the non-batch dimensions, for the policy (e_w, e_l) and the reference, the
frozen base with the LoRA adapter disabled (e_w_ref, e_l_ref, no gradient).

    inside = -beta_dpo / 2 ((e_w - e_w_ref) - (e_l - e_l_ref))
    L      = mean over pairs of -log sigmoid(inside)

Lowering the policy's error on the preferred sample relative to the reference, and raising it on the rejected one,
lowers the loss. The gradient with respect to e_w of pair p is beta_dpo / 2 sigmoid(-inside_p) / P, and the opposite
for e_l; at the start (policy = reference, inside = 0) it is beta_dpo / (4 P). Logged: the implicit accuracy
(share of pairs with inside > 0) and the mean of inside. ``tests/trainer/test_dpo.py`` checks loss and gradient by hand.
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


def dpo_loss(error_w: torch.Tensor, error_l: torch.Tensor, ref_error_w: torch.Tensor, ref_error_l: torch.Tensor,
             beta_dpo: float) -> DPOLoss:
    """The loss from per-pair flow-matching errors ``(P,)`` of the policy and the reference (see the module
    docstring); computed in float32 at least."""
    dtype = torch.promote_types(error_w.dtype, torch.float32)
    model_diff = error_w.to(dtype) - error_l.to(dtype)
    ref_diff = (ref_error_w.to(dtype) - ref_error_l.to(dtype)).detach()
    inside = -0.5 * beta_dpo * (model_diff - ref_diff)
    return DPOLoss(loss=-F.logsigmoid(inside).mean(), inside=inside)
