r"""Several trained timesteps of a micro-batch in one forward and one backward: ``train_timesteps_per_pass``.

A micro-batch of B samples is trained in T *parts*, the algorithm's `_loss_parts` (Flow-GRPO and on-policy
distillation: the recorded SDE steps; DiffusionNFT, DGPO, CRD: noise levels; Diffusion-DPO: (t, eps) draws;
BranchGRPO: the SDE steps with trained edges). With K = ``train_timesteps_per_pass`` the parts go through the model
in ceil(T / K) *passes*: parts ``[0, K)``, ``[K, 2K)``, ... (the last pass holds the rest). A pass stacks the rows of
its parts into one batch (K x B rows, part-major: the rows of its first part, then of its second, ...), runs each
forward the loss needs once over that batch (the trained policy's with gradient; the reference's, the old policy's,
a teacher's without), splits every output back into the parts' rows and computes each part's loss from its own rows
exactly as it would alone. The pass's backward is that of the sum of its parts' losses, so the trained objective is,
whatever K,

    L = 1 / (T x accumulation steps) x sum over the T parts of loss_part,

each ``loss_part`` with its own clipping, KL, weights and mean over its rows. K changes the order in which
floating-point gradients are summed (within one backward instead of across several), nothing else; on-policy the
first pass's ratio is still exactly 1 where the model's kernels give each row the same result whatever the batch
(checked on CPU float32 for the SD3 transformers here: docs/benchmarks.md, "The cost of a step").

What K buys: one forward and one backward per pass instead of per part, so fewer, larger kernel launches and, under
FSDP2, ceil(T / K) weight all-gathers per micro-batch instead of T (each forward of a sharded model gathers its
weights once); what it costs: a pass's activations grow with its rows (``flowgrpo plan`` plans them and names the
largest K that fits). ``1`` (the default) trains part by part as before; ``all`` trains a micro-batch in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..models import PromptEmbeds

__all__ = ["ALL_TIMESTEPS", "even_timesteps_per_pass", "parse_timesteps_per_pass", "passes_of",
           "resolved_timesteps_per_pass", "split_rows", "stack_embeds", "stack_rows"]

#: ``train_timesteps_per_pass: all``: every part of a micro-batch in one pass
ALL_TIMESTEPS = "all"


def parse_timesteps_per_pass(value: object, name: str = "train_timesteps_per_pass") -> int | str:
    """A ``train_timesteps_per_pass`` setting as an int >= 1 or ``"all"`` (also from a string: ``"4"``, ``"ALL"``);
    anything else raises a ValueError naming the value and the fix."""
    fix = (f"set {name} to a whole number >= 1 (the trained timesteps of a micro-batch stacked into one forward and "
           f"one backward; 1 trains them one at a time) or to '{ALL_TIMESTEPS}' (every trained timestep of a "
           "micro-batch in one pass).")
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name}={value!r} is not valid; {fix}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    else:
        text = str(value).strip().lower()
        if text == ALL_TIMESTEPS:
            return ALL_TIMESTEPS
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"{name}={value!r} is not valid; {fix}") from None
    if number < 1:
        raise ValueError(f"{name}={value!r} must be >= 1; {fix}")
    return number


def resolved_timesteps_per_pass(setting: int | str, parts: int) -> int:
    """K for a micro-batch of ``parts`` parts: ``min(setting, parts)``, ``parts`` for ``"all"`` (at least 1)."""
    parts = max(1, int(parts))
    return parts if setting == ALL_TIMESTEPS else max(1, min(int(setting), parts))


def even_timesteps_per_pass(parts: int, per_pass: int) -> int:
    """The smallest K that trains ``parts`` parts in as few passes as K = ``per_pass`` does: ceil(parts / passes)
    with passes = ceil(parts / per_pass) (9 parts at K = 6 take 2 passes, as at K = 5, whose larger pass is smaller)."""
    parts, per_pass = max(1, int(parts)), max(1, int(per_pass))
    passes = -(-parts // per_pass)
    return -(-parts // passes)


def passes_of(parts: int, setting: int | str) -> list[list[int]]:
    """The parts ``0 .. parts - 1`` grouped into passes of K = `resolved_timesteps_per_pass` consecutive parts (the
    last pass holds the rest): ``ceil(parts / K)`` passes."""
    per_pass = resolved_timesteps_per_pass(setting, parts)
    return [list(range(start, min(start + per_pass, parts))) for start in range(0, parts, per_pass)]


def stack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parts' rows as one batch (concatenated along dim 0, part-major); one part's tensor is returned as it is."""
    if len(tensors) == 1:
        return tensors[0]
    import torch

    return torch.cat(list(tensors))


def split_rows(tensor: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """A pass's output back into its parts' rows (``sizes``: rows per part, in the order `stack_rows` stacked them);
    one part's tensor is returned as it is."""
    if len(sizes) == 1:
        return [tensor]
    if sum(sizes) != tensor.shape[0]:
        raise ValueError(f"A pass of {tensor.shape[0]} rows cannot be split into parts of {list(sizes)} rows.")
    return list(tensor.split(list(sizes)))


def stack_embeds(embeds: PromptEmbeds, rows: Sequence[torch.Tensor | None]) -> PromptEmbeds:
    """The prompt embeddings of a pass: for each part, the micro-batch's rows ``rows[i]`` (None: all of them), stacked
    as `stack_rows` stacks the parts' inputs. One part of all rows gets ``embeds`` itself."""
    if len(rows) == 1 and rows[0] is None:
        return embeds
    import torch

    size = len(embeds)
    index = [torch.arange(size) if r is None else r.detach().to("cpu", torch.long) for r in rows]
    return embeds.index_select(torch.cat(index))
