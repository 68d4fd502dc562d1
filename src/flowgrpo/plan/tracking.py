"""Memory counting for planned steps: a light ``TorchDispatchMode`` that counts the bytes of live storages, and an
attention operator whose memory is flash attention's.

:class:`LiveBytes` sees every storage an operator allocates while it is active (fake or real tensors alike) and
releases it when Python frees the storage, so ``peak`` is the largest sum of live allocation bytes: what
``torch.cuda.max_memory_allocated`` measures on a GPU, minus the allocator's rounding (the plan's overhead term) and
minus what existed before the mode started (weights, optimizer states: counted separately, exactly). It costs one
dictionary update per output tensor, unlike ``torch.distributed._tools.mem_tracker.MemTracker``, whose per-module
bookkeeping made a full-size SD3.5-M step take 452 s instead of 11.5 s, and which cannot enter a module with
frozen parameters (it hooks every parameter's gradient), so not a LoRA model. On full fine-tuning steps the two
agree: ``tests/tooling/test_plan.py`` enters ``MemTracker`` beside this mode (``run_step(..., also_track=...)``).

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
from torch.utils.flop_counter import flop_registry as _FLOP_FORMULAS

_ORIGINAL_SDPA = F.scaled_dot_product_attention


def operator_tensors(*trees) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or outputs (tensors, possibly in nested lists, tuples and dicts; any
    other value is a leaf without tensors): what ``torch.utils._pytree.tree_flatten`` finds there, without its
    per-node bookkeeping, which cost more than the rest of a dispatch mode's work on every operator."""
    out: list[torch.Tensor] = []
    _collect(trees, out)
    return out


def _collect(items, out: list[torch.Tensor]) -> None:
    for item in items:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            _collect(item, out)
        elif isinstance(item, dict):
            _collect(item.values(), out)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages allocated while active that are still alive; ``peak`` is the largest count.

    ``mark(name)`` records the current and the peak-so-far under a name (phase boundaries). ``flops`` sums
    ``torch.utils.flop_counter``'s formulas over the same operators (what ``FlopCounterMode`` counts): one mode for
    both, and no module tracking, whose backward hooks keep gradient checkpointing's recomputed activations alive
    (with ``FlopCounterMode`` active, a checkpointed step measured 3x its own peak).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.flops = 0
        self.excluded = 0            # bytes of live storages set aside (the gradients of parameters)
        self.peak_excluding = 0      # the largest ``live - excluded``: activations and temporaries only
        self._excluded_ids: set[int] = set()
        self._seen: dict[int, int] = {}
        self.marks: dict[str, tuple[int, int]] = {}

    def _release(self, key: int) -> None:
        size = self._seen.pop(key, 0)
        self.live -= size
        if key in self._excluded_ids:
            self._excluded_ids.discard(key)
            self.excluded -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FLOP_FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        inputs = set()  # storages the op read: an output sharing one is a view or an in-place result, not new memory
        for t in operator_tensors(args, kwargs):
            try:
                inputs.add(id(t.untyped_storage()))
            except (NotImplementedError, RuntimeError):
                pass
        for t in (out,) if isinstance(out, torch.Tensor) else operator_tensors(out):
            try:
                storage = t.untyped_storage()
            except (NotImplementedError, RuntimeError):
                continue
            key = id(storage)
            if key in self._seen or key in inputs:
                continue
            size = storage.nbytes()
            self._seen[key] = size
            self.live += size
            weakref.finalize(storage, self._release, key)
        self.peak = max(self.peak, self.live)
        self.peak_excluding = max(self.peak_excluding, self.live - self.excluded)
        return out

    def exclude(self, tensor: torch.Tensor) -> None:
        """Set ``tensor``'s storage aside from ``peak_excluding`` from now on (a parameter's new gradient)."""
        key = id(tensor.untyped_storage())
        if key in self._seen and key not in self._excluded_ids:
            self._excluded_ids.add(key)
            self.excluded += self._seen[key]

    def get_total_flops(self) -> int:
        return self.flops

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


def _attention_grads(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention's gradients written out (autograd does not run inside an operator's implementation), in float32:
    P = softmax(s Q K^T + bias), dV = P^T G, dP = G V^T, dS = P * (dP - rowsum(dP * P)), dQ = s dS K, dK = s dS^T Q."""
    qf, kf, vf, gf = (x.to(torch.float32) for x in (q, k, v, grad))
    scores = qf @ kf.transpose(-2, -1) * scale
    probs = torch.softmax(scores if bias is None else scores + bias, dim=-1)
    dv = probs.transpose(-2, -1) @ gf
    dprobs = gf @ vf.transpose(-2, -1)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
    dq = dscores @ kf * scale
    dk = dscores.transpose(-2, -1) @ qf * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("flowgrpo_plan::flash_attention_backward", mutates_args=())
def _flash_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attention_grads(grad, q, k, v, scale)


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


@torch.library.custom_op("flowgrpo_plan::masked_attention", mutates_args=())
def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = _ORIGINAL_SDPA(q, k, v, attn_mask=mask, scale=scale)
    lse = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
    return out, lse


@_masked_attention.register_fake
def _(q, k, v, mask, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flowgrpo_plan::masked_attention_backward", mutates_args=())
def _masked_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               mask: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # with the mask's bias on the scores (a boolean mask: -inf where it is False)
    bias = torch.zeros((), dtype=torch.float32).masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
        else mask.to(torch.float32)
    return _attention_grads(grad, q, k, v, scale, bias)


@_masked_attention_backward.register_fake
def _(grad, q, k, v, mask, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _masked_setup_context(ctx, inputs, output):
    q, k, v, mask, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, mask, out, lse)
    ctx.scale = scale


def _masked_backward(ctx, grad_out, grad_lse):
    q, k, v, mask, _out, _lse = ctx.saved_tensors
    dq, dk, dv = _masked_attention_backward(grad_out.contiguous(), q, k, v, mask, ctx.scale)
    return dq, dk, dv, None, None


_masked_attention.register_autograd(_masked_backward, setup_context=_masked_setup_context)


def flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` with flash attention's memory (dropout-free, non-causal calls; any other call
    goes to torch's own function). A mask (HunyuanVideo 1.5's, LTX-2's text masks) keeps the memory-efficient
    kernel's footprint, output and log-sum-exp, with the mask itself counted where it was made."""
    if dropout_p or is_causal or enable_gqa or query.shape[:-2] != key.shape[:-2]:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    if attn_mask is not None:
        return _masked_attention(query, key, value, attn_mask, scale)[0]
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


__all__ = ["LiveBytes", "flash_attention", "flash_attention_patched", "operator_tensors"]


def _register_flop_formulas() -> None:
    """FLOPs of the attention operator for ``FlopCounterMode``: 4 B H Lq Lk D forward (Q K^T and P V, a multiply-add
    as 2), twice that backward (dP = G V^T, dV = P^T G, dQ = dS K, dK = dS^T Q), as torch counts its SDPA kernels."""
    from torch.utils.flop_counter import register_flop_formula

    def forward_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        b, h, lq, d = q_shape
        lk, dv = k_shape[-2], v_shape[-1]
        return 2 * b * h * lq * lk * d + 2 * b * h * lq * lk * dv

    def backward_flops(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * forward_flops(q_shape, k_shape, v_shape)

    def masked_forward_flops(q_shape, k_shape, v_shape, mask_shape, *args, out_shape=None, **kwargs) -> int:
        return forward_flops(q_shape, k_shape, v_shape)

    def masked_backward_flops(grad_shape, q_shape, k_shape, v_shape, mask_shape, *args, out_shape=None,
                              **kwargs) -> int:
        return 2 * forward_flops(q_shape, k_shape, v_shape)

    register_flop_formula(torch.ops.flowgrpo_plan.flash_attention)(forward_flops)
    register_flop_formula(torch.ops.flowgrpo_plan.flash_attention_backward)(backward_flops)
    register_flop_formula(torch.ops.flowgrpo_plan.masked_attention)(masked_forward_flops)
    register_flop_formula(torch.ops.flowgrpo_plan.masked_attention_backward)(masked_backward_flops)


_register_flop_formulas()
