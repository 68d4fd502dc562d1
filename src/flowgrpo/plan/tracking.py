"""Memory counting for planned steps: a light ``TorchDispatchMode`` that counts the bytes of live storages, and an
attention operator whose memory is flash attention's.

:class:`LiveBytes` sees every storage an operator allocates while it is active (fake or real tensors alike) and
releases it when Python frees the storage, so ``peak`` is the largest sum of live allocation bytes: what
``torch.cuda.max_memory_allocated`` measures on a GPU, minus the allocator's rounding (the plan's overhead term) and
minus what existed before the mode started (weights, optimizer states: counted separately, exactly). It costs one
dictionary update per output tensor, unlike ``torch.distributed._tools.mem_tracker.MemTracker``, whose per-module
bookkeeping made a full-size SD3.5-M step take 452 s instead of 11.5 s.

:func:`flash_attention` replaces ``torch.nn.functional.scaled_dot_product_attention`` while planning
(:func:`flash_attention_patched`): a custom operator whose fake implementation returns what GPU flash attention keeps,
the output (B, H, L, D) and the float32 log-sum-exp (B, H, L); its backward returns dQ, dK, dV. CPU SDPA under fake
tensors would take the math path and materialise the B x H x L^2 probabilities, which flash attention never holds.
The real implementation (used when the same step runs on real tensors, for the fidelity checks) computes attention
inside the operator, so its transient matrix is invisible to :class:`LiveBytes`, exactly as on a GPU.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_ORIGINAL_SDPA = F.scaled_dot_product_attention


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages allocated while active that are still alive; ``peak`` is the largest count.

    ``mark(name)`` records the current and the peak-so-far under a name (phase boundaries).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}
        self.marks: dict[str, tuple[int, int]] = {}

    def _release(self, key: int) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            try:
                storage = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                continue
            key = id(storage)
            if key in self._seen:
                continue
            size = storage.nbytes()
            self._seen[key] = size
            self.live += size
            weakref.finalize(storage, self._release, key)
        self.peak = max(self.peak, self.live)
        return out

    def reset_peak(self) -> None:
        self.peak = self.live

    def mark(self, name: str) -> None:
        self.marks[name] = (self.live, self.peak)


@torch.library.custom_op("flowgrpo_plan::flash_attention", mutates_args=())
def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    out = _ORIGINAL_SDPA(q, k, v, scale=scale)
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
    return out, lse


@_flash_attention.register_fake
def _(q, k, v, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flowgrpo_plan::flash_attention_backward", mutates_args=())
def _flash_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with torch.enable_grad():
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        out = _ORIGINAL_SDPA(qq, kk, vv, scale=scale)
        dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad)
    return dq, dk, dv


@_flash_attention_backward.register_fake
def _(grad, q, k, v, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # what flash attention keeps for its backward
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, _out, _lse = ctx.saved_tensors
    dq, dk, dv = _flash_attention_backward(grad_out.contiguous(), q, k, v, ctx.scale)
    return dq, dk, dv, None


_flash_attention.register_autograd(_backward, setup_context=_setup_context)


def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` with flash attention's memory (mask-free, dropout-free calls; any other call
    goes to torch's own function)."""
    if attn_mask is not None or dropout_p or is_causal or enable_gqa or query.shape[:-2] != key.shape[:-2]:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    return _flash_attention(query, key, value, scale)[0]


@contextlib.contextmanager
def flash_attention_patched() -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` (what diffusers' attention calls) through
    :func:`flash_attention` while active."""
    F.scaled_dot_product_attention = flash_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA


__all__ = ["LiveBytes", "flash_attention", "flash_attention_patched"]
