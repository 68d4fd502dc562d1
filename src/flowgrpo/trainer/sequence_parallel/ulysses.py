"""Ulysses sequence parallelism for any token count: the attention and the final gather that diffusers' context
parallelism runs in its ``ulysses_anything`` mode, trainable and on every backend.

diffusers 0.42.1 splits a transformer's tokens with the model's context-parallel plan (``_cp_plan``: which inputs
are split along which dimension, which outputs are gathered) and, in ``ulysses_anything`` mode, splits a length L
that S does not divide with ``tensor_split`` (the first ``L mod S`` processes hold one token more). Two of its pieces
cannot train here: its uneven attention has no backward pass, and its uneven gathers use all-gathers of tensors of
different sizes, which gloo (CPU) refuses. This module supplies both, by padding the *communication buffers* (never
the tokens the model sees):

* `UlyssesAttention` (an autograd function with diffusers' ``Templated*Attention`` interface). Process s holds the
  tokens ``T_s`` (``|T_s| = L_s``) of every head. An all-to-all gives each process all L tokens of its H / S heads:
  each process pads its ``(L_s, H / S)`` blocks to ``max_s L_s``, the exchange is an equal-sized
  ``all_to_all_single``, and the receiver drops each sender's padding. Attention then runs on exactly the L tokens
  (no padded key is ever attended to, so no mask is needed), and the reverse exchange returns each process its
  ``L_s`` tokens of all H heads. The backward pass is the same two exchanges in reverse order around the backend's
  own backward op. For L divisible by S the padding is empty and this is diffusers' ``TemplatedUlyssesAttention``.
* `gather_sequence`: the model's output gathered along the sequence (the plan's ``ContextParallelOutput``): padded
  to ``max_s L_s``, all-gathered, each block cut back to ``L_s``. Its backward returns each process the gradient of
  its own ``L_s`` tokens, which is why the processes' parameter gradients are *summed* over the SP group.

`install_trainable_ulysses` points diffusers' dispatcher at `UlyssesAttention` for the ``ulysses_anything`` mode
(module attribute ``diffusers.models.attention_dispatch.TemplatedUlyssesAnythingAttention``; done once, by name, and
refused with a clear error if that diffusers internal has moved).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import ContextParallelGatherHook

__all__ = ["SequenceGatherHook", "UlyssesAttention", "gather_sequence", "install_trainable_ulysses", "local_sizes"]


def local_sizes(lengths: list[int], group: Any, device: torch.device) -> list[list[int]]:
    """For each of ``lengths`` (this process's local token counts), every process's count ``L_s`` in the SP ``group``
    (one all-gather of a few integers)."""
    world = dist.get_world_size(group)
    mine = torch.tensor(lengths, dtype=torch.int64, device=device)
    every = torch.empty(world * len(lengths), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    return [list(map(int, column)) for column in every.reshape(world, len(lengths)).t().tolist()]


def _pad_dim(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``x`` zero-padded at the end of ``dim`` to ``length``."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal-sized ``all_to_all_single`` along dim 0 (``world`` blocks)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def tokens_to_heads(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """``(B, L_s, H, D)`` on process s -> ``(B, L, H / S, D)``: all tokens of this process's heads, in rank order."""
    world = len(sizes)
    batch, _, heads, dim = x.shape
    longest = max(sizes)
    x = _pad_dim(x, 1, longest).reshape(batch, longest, world, heads // world, dim)
    x = _all_to_all(x.permute(2, 1, 0, 3, 4), group)  # (S, L_max, B, H/S, D): block j came from process j
    x = torch.cat([x[j, :sizes[j]] for j in range(world)], dim=0)  # (L, B, H/S, D)
    return x.permute(1, 0, 2, 3).contiguous()


def heads_to_tokens(x: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """``(B, L, H / S, D)`` -> ``(B, L_s, H, D)`` on process s: the inverse of `tokens_to_heads`."""
    world = len(sizes)
    rank = dist.get_rank(group)
    batch, _, local_heads, dim = x.shape
    longest = max(sizes)
    blocks = torch.split(x, sizes, dim=1)  # process j's tokens
    x = torch.stack([_pad_dim(b, 1, longest) for b in blocks])  # (S, B, L_max, H/S, D)
    x = _all_to_all(x, group)  # block j: this process's tokens of process j's heads
    x = x[:, :, :sizes[rank]]  # (S, B, L_s, H/S, D)
    return x.permute(1, 2, 0, 3, 4).reshape(batch, sizes[rank], world * local_heads, dim)


def _gather_mask(mask: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    """A key mask split like the keys (last dim ``L_s``) gathered to all L keys, in rank order."""
    longest = max(sizes)
    padded = _pad_dim(mask, mask.dim() - 1, longest).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


def _local_mask(mask: torch.Tensor, local_keys: int, heads: int, kv_sizes: list[int], group: Any) -> torch.Tensor:
    """An attention mask as the exchanged attention needs it: split like the keys (last dim ``L_s``), gathered to all
    L keys; one per head (``(B, H, Lq, Lk)``, as LTX-2's processor shapes it), cut to this process's ``H / S``."""
    if mask.shape[-1] == local_keys:
        mask = _gather_mask(mask, kv_sizes, group)
    world = len(kv_sizes)
    if mask.dim() == 4 and mask.shape[1] == heads and heads > 1:
        local = heads // world
        rank = dist.get_rank(group)
        mask = mask[:, rank * local:(rank + 1) * local]
    return mask


class UlyssesAttention(torch.autograd.Function):
    """Ulysses attention over tokens split unevenly (see the module docstring); diffusers' templated interface:
    ``apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
    backward_op, _parallel_config)`` with ``(B, L_s, H, D)`` tensors."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, forward_op,
                backward_op, _parallel_config=None, **kwargs):
        if return_lse:
            raise ValueError("Ulysses sequence parallelism does not return the attention's log-sum-exp (ring "
                             "attention needs it and is not supported); leave ring_degree at 1.")
        cp = _parallel_config.context_parallel_config
        group = cp._ulysses_mesh.get_group()
        world = dist.get_world_size(group)
        heads = query.shape[2]
        if heads % world or key.shape[2] % world:
            raise ValueError(f"Ulysses attention with {world} processes needs a head count they divide; this "
                             f"attention has {heads} query and {key.shape[2]} key heads.")
        device = query.device
        q_sizes, kv_sizes = local_sizes([query.shape[1], key.shape[1]], group, device)
        ctx.forward_op, ctx.backward_op, ctx._parallel_config = forward_op, backward_op, _parallel_config
        ctx.group, ctx.q_sizes, ctx.kv_sizes = group, q_sizes, kv_sizes
        q = tokens_to_heads(query, q_sizes, group)
        k = tokens_to_heads(key, kv_sizes, group)
        v = tokens_to_heads(value, kv_sizes, group)
        if attn_mask is not None:
            attn_mask = _local_mask(attn_mask, key.shape[1], heads, kv_sizes, group)
        out = forward_op(ctx, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, False, _save_ctx=True,
                         _parallel_config=_parallel_config)
        return heads_to_tokens(out, q_sizes, group)

    @staticmethod
    def backward(ctx, grad_out, *args):
        group = ctx.group
        grad = tokens_to_heads(grad_out, ctx.q_sizes, group)
        grad_q, grad_k, grad_v, *_ = ctx.backward_op(ctx, grad)
        grad_q = heads_to_tokens(grad_q, ctx.q_sizes, group)
        grad_k = heads_to_tokens(grad_k, ctx.kv_sizes, group)
        grad_v = heads_to_tokens(grad_v, ctx.kv_sizes, group)
        return grad_q, grad_k, grad_v, None, None, None, None, None, None, None, None, None


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` of blocks of different lengths; the backward pass keeps this process's block."""

    @staticmethod
    def forward(ctx, tensor, dim, group):
        (sizes,) = local_sizes([tensor.shape[dim]], group, tensor.device)
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.length = dim, sum(sizes[:rank]), sizes[rank]
        padded = _pad_dim(tensor, dim, max(sizes)).contiguous()
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.start, ctx.length).contiguous(), None, None


def gather_sequence(tensor: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The full sequence from every process's block of ``tensor`` along ``dim`` (blocks of any lengths)."""
    return _GatherSequence.apply(tensor, dim, group)


class SequenceGatherHook(ContextParallelGatherHook):
    """diffusers' gather hook (a plan's ``ContextParallelOutput``) with `gather_sequence` (any block lengths, gloo
    included) instead of its uneven all-gather."""

    def post_forward(self, module, output):
        is_tensor = isinstance(output, torch.Tensor)
        outputs = [output] if is_tensor else list(output)
        if len(outputs) != len(self.metadata):
            raise ValueError(f"{type(module).__name__} returned {len(outputs)} outputs; its sequence-parallel plan "
                             f"gathers {len(self.metadata)}.")
        group = self.parallel_config._flattened_mesh.get_group()
        for i, spec in enumerate(self.metadata):
            if spec is not None:
                outputs[i] = gather_sequence(outputs[i], spec.gather_dim, group)
        return outputs[0] if is_tensor else tuple(outputs)


def install_trainable_ulysses() -> None:
    """Make diffusers' dispatcher run `UlyssesAttention` for ``ulysses_anything`` (idempotent). diffusers 0.42.1's own
    class for that mode raises in its backward pass and all-gathers blocks of different sizes."""
    from diffusers.models import attention_dispatch

    current = getattr(attention_dispatch, "TemplatedUlyssesAnythingAttention", None)
    if current is UlyssesAttention:
        return
    if current is None or not hasattr(attention_dispatch, "_templated_context_parallel_attention"):
        import diffusers

        raise RuntimeError(f"diffusers {diffusers.__version__} no longer dispatches Ulysses attention through "
                           "attention_dispatch.TemplatedUlyssesAnythingAttention, which sequence parallelism replaces "
                           "to train; install diffusers 0.42.x or update flowgrpo.trainer.sequence_parallel.ulysses.")
    attention_dispatch.TemplatedUlyssesAnythingAttention = UlyssesAttention
