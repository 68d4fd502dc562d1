"""Real values for the small tensors of a fake-tensor step: masks, token layouts, index lists.

Some transformers lay out their token sequence from the values of masks (Qwen-Image 2.1 expands image slots with
``repeat_interleave(img_mask)`` and places latents with ``nonzero``; HunyuanVideo 1.5 branches on
``torch.all(image_embeds == 0)`` and reorders each sample's text tokens by boolean indexing). Fake tensors hold no
values, so such a step stops at the first of these operations. :class:`RealValuedMasks`, active inside the fake mode,
keeps the values that are cheap to keep:

* an operator whose tensor inputs are all real runs on the real tensors (its output is real), unless its output has
  more than ``SMALL_NUMEL`` elements (HunyuanVideo 1.5's L x L attention mask of a long video): that one is fake;
* a tensor made without reading data (``zeros``, ``ones``, ``full``, ``arange``, ``new_zeros``, ``zeros_like``, ...)
  is real when it has at most ``SMALL_NUMEL`` elements;
* an index operation (``index``, ``index_put``) on a fake tensor with a real boolean mask uses the mask's real
  ``nonzero`` positions, so its output size is known.

Everything else (weights, activations, latents) stays fake. The real tensors are small (at most ``SMALL_NUMEL``
elements each), so the memory they take on the CPU, and their share of the counted bytes, are negligible.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from .tracking import operator_tensors

#: Largest tensor (elements) made real when its values do not depend on data: HunyuanVideo 1.5's all-zero image
#: embeddings (729 x 1152 a row, on which its transformer branches) for up to 9 rows (CFG x stacked timesteps)
SMALL_NUMEL = 1 << 23

_aten = torch.ops.aten
#: Operators whose output values do not depend on the input's data (only on its shape / dtype): -> fill value.
_LIKE = {_aten.new_zeros.default: 0, _aten.new_ones.default: 1, _aten.zeros_like.default: 0,
         _aten.ones_like.default: 1, _aten.new_empty.default: 0, _aten.empty_like.default: 0}
_INDEX = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._unsafe_index_put.default}


def _real_indices(indices: list[Any]) -> list[Any]:
    """Real boolean masks among ``indices`` replaced by their real ``nonzero`` positions (one long tensor per mask
    dimension), as advanced indexing defines them."""
    out: list[Any] = []
    for index in indices:
        if (isinstance(index, torch.Tensor) and not isinstance(index, FakeTensor) and not index.is_meta
                and index.dtype == torch.bool):
            with unset_fake_temporarily():
                out.extend(index.nonzero().unbind(1))
        else:
            out.append(index)
    return out


class RealValuedMasks(TorchDispatchMode):
    """Keep small data-independent tensors and everything computed only from them real (module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = operator_tensors(args, kwargs)
        if tensors and not any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
            try:  # the output's shape first, on fake tensors: a large output stays fake (e.g. an L x L mask)
                probe = func(*args, **kwargs)
            except Exception:  # an output whose size depends on the values (nonzero): small, computed for real
                probe = None
            if probe is None or all(t.numel() <= SMALL_NUMEL for t in operator_tensors(probe)):
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            return probe
        if func in _INDEX and isinstance(args[1], (list, tuple)):
            args = (args[0], _real_indices(list(args[1])), *args[2:])
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, FakeTensor) and out.numel() <= SMALL_NUMEL:
            if not tensors and torch.Tag.nondeterministic_seeded not in func.tags:
                with unset_fake_temporarily():  # a factory (zeros, ones, full, arange): the same call on real tensors
                    return func(*args, **kwargs)
            if func in _LIKE:
                with unset_fake_temporarily():
                    return torch.full(tuple(out.shape), _LIKE[func], dtype=out.dtype)
        return out


__all__ = ["RealValuedMasks", "SMALL_NUMEL"]
