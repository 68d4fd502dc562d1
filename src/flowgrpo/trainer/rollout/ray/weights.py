"""The weights a rollout worker needs, as one flat state: collected on the trainer, loaded on a worker, and a digest
of either side so that the trainer can check what each worker holds.

What a worker samples with, by algorithm:

* the trained tensors (a LoRA's, or the whole transformer for full fine-tuning): every sampler;
* the old-policy copy (DiffusionNFT samples with its old policy; AWM off-policy with its EMA adapter), when the
  trainer keeps one: the second adapter's tensors, or the frozen copy's;
* the reference, when a rollout reads it (the algorithm's `WorkerNeeds.synced` names it: ``base_model_tail_steps``)
  and it can change (a ``ref`` adapter or a frozen copy refreshed by ``sync_ref_model`` or GARDO).

Keys name where a tensor lives: ``policy/<parameter name>`` (every adapter of a LoRA-trained model, or the trained
transformer's parameters), ``old_policy/<name>`` and ``reference/<name>`` (frozen copies). The digest is BLAKE2b over
the keys in sorted order, each with its dtype, shape and bytes: a worker computes it from the tensors it holds after
loading, the trainer from what it sent, and they must agree.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

__all__ = ["collect_policy_state", "load_policy_state", "policy_state_digest", "state_digest"]


def _trained_model(policy: Any) -> torch.nn.Module:
    return policy.unwrapped if policy.accelerator is not None else policy.model


def _named_tensors(policy: Any, include_reference: bool) -> dict[str, torch.Tensor]:
    """The live tensors the state holds, by key (see the module docstring)."""
    model = _trained_model(policy)
    params = dict(model.named_parameters())
    names = [name for name, p in params.items() if p.requires_grad]
    out = {f"policy/{name}": params[name] for name in names}
    old = policy.old_policy
    if old is not None:
        if hasattr(old, "module"):  # a frozen copy (full fine-tuning)
            copies = dict(old.module.named_parameters())
            out.update({f"old_policy/{name}": copies[name] for name in old.names})
        else:  # a second adapter of the trained model
            out.update({f"policy/{old_key}": params[old_key] for _, old_key in old.names})
    reference = policy.reference
    if include_reference and reference is not None:
        if reference.kind == "adapter":
            out.update({f"policy/{ref_key}": params[ref_key] for _, ref_key in reference._adapter.names})
        elif reference.kind == "copy":
            out.update({f"reference/{name}": p for name, p in reference.copy.named_parameters()})
    if not names:
        raise RuntimeError("The policy has no trainable tensor to send to the rollout workers.")
    return out


@contextmanager
def _gathered(policy: Any, tensors: list[torch.Tensor]) -> Iterator[None]:
    """DeepSpeed ZeRO-3: every rank gathers the partitioned tensors for the block (a collective)."""
    if getattr(policy, "_zero3", False):
        import deepspeed

        with deepspeed.zero.GatheredParameters([t for t in tensors if hasattr(t, "ds_id")], modifier_rank=None):
            yield
    else:
        with nullcontext():
            yield


@torch.no_grad()
def collect_policy_state(policy: Any, *, include_reference: bool = False) -> dict[str, torch.Tensor]:
    """The worker's weights as CPU tensors (contiguous copies). Call it on every process of a launch: a sharded tensor
    (FSDP2's DTensor) is gathered with ``full_tensor()`` and ZeRO-3's partitions with ``GatheredParameters``, both
    collectives that every rank must enter (a gather on rank 0 alone waits forever)."""
    live = _named_tensors(policy, include_reference)
    state = {}
    with _gathered(policy, list(live.values())):
        for key in sorted(live):
            value = live[key].detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            state[key] = value.to("cpu", copy=True).contiguous()
    return state


@torch.no_grad()
def load_policy_state(policy: Any, state: Mapping[str, torch.Tensor], *, include_reference: bool = False) -> None:
    """Copy ``state`` into the worker's policy, in place. Every tensor the worker samples with must be in it and every
    key must name one of them (a missing adapter, e.g. the old policy's, or another model's keys are refused); dtypes
    and shapes must match exactly (no silent cast)."""
    live = _named_tensors(policy, include_reference)
    missing = sorted(set(live) - set(state))
    unexpected = sorted(set(state) - set(live))
    if missing or unexpected:
        raise ValueError(f"The weights sent to the rollout worker do not match its policy: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all). The "
                         "worker must be built with the trainer's model, LoRA configuration and algorithm.")
    for key, target in live.items():
        value = state[key]
        if value.dtype != target.dtype or tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{key}: the trainer sent {value.dtype} {tuple(value.shape)}, the worker holds "
                             f"{target.dtype} {tuple(target.shape)}.")
        target.copy_(value.to(target.device))


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """BLAKE2b (16 bytes, hex) over the keys in sorted order, each with its dtype, shape and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(state):
        tensor = state[key].detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.to("cpu").contiguous()
        digest.update(key.encode())
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def policy_state_digest(policy: Any, *, include_reference: bool = False) -> str:
    """The digest of what ``policy`` holds now (a worker's answer after loading: read back from its own tensors, not
    from what it was sent)."""
    return state_digest(_named_tensors(policy, include_reference))
