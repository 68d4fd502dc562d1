"""The weights a rollout worker needs, as one flat state: collected on the trainer, loaded on a worker, and a digest
of either side so that the trainer can check what each worker holds; and the same state cut into buckets for a
collective broadcast (`bucket_layout`, `pack_bucket`, `unpack_bucket`).

What a worker samples with, by algorithm (its `WorkerNeeds.synced`):

* the trained tensors (a LoRA's, or the whole transformer for full fine-tuning): every sampler;
* the copies that sample: the old policy (DiffusionNFT samples with it; AWM off-policy with its EMA adapter; DGPO
  with its EMA reference after the switch) and named copies (CRD's sampling copy); a copy that only the loss reads
  stays on the trainer;
* the reference, when a rollout reads it (``base_model_tail_steps``) and it can change (a ``ref`` adapter or a frozen
  copy refreshed by ``sync_ref_model`` or GARDO).

Keys name where a tensor lives: ``policy/<parameter name>`` (every adapter of a LoRA-trained model, or the trained
transformer's parameters), ``old_policy/<name>``, ``copy/<copy>/<name>`` and ``reference/<name>`` (frozen copies). The
digest is BLAKE2b over the keys in sorted order, each with its dtype, shape and bytes: a worker computes it from the
tensors it holds after loading, the trainer from what it sent, and they must agree.

**Buckets.** A collective transport sends the state as a few flat tensors, each of one dtype and at most
``bucket_bytes`` (a tensor larger than that gets a bucket of its own): `bucket_layout` gives, in key order, each
tensor's bucket, offset, dtype and shape; the trainer packs a bucket (`pack_bucket`), broadcasts it, and every worker
copies the bucket's slices into its live tensors (`unpack_bucket`), never holding the whole state twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorSlot", "bucket_layout", "check_layout", "collect_policy_state", "live_tensors", "load_policy_state",
           "pack_bucket", "policy_state_digest", "state_digest", "synced_copies", "unpack_bucket"]

#: the names `WorkerNeeds.synced` may hold besides named copies
OLD_POLICY, REFERENCE = "old_policy", "reference"


def _trained_model(policy: Any) -> torch.nn.Module:
    return policy.unwrapped if policy.accelerator is not None else policy.model


def synced_copies(policy: Any, include_reference: bool = False) -> tuple[str, ...]:
    """Every copy ``policy`` holds beside the trained weights (the old policy, the named copies), and the reference
    with ``include_reference``: what a state holds when no `WorkerNeeds.synced` is given."""
    names = ((OLD_POLICY,) if policy.old_policy is not None else ()) + tuple(policy.copies)
    return names + ((REFERENCE,) if include_reference else ())


def _copy_tensors(prefix: str, kept: Any, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if hasattr(kept, "module"):  # a frozen copy (full fine-tuning)
        copies = dict(kept.module.named_parameters())
        return {f"{prefix}/{name}": copies[name] for name in kept.names}
    return {f"policy/{copy_key}": params[copy_key] for _, copy_key in kept.names}  # an adapter of the trained model


def live_tensors(policy: Any, synced: Iterable[str] | None = None, *,
                 include_reference: bool = False) -> dict[str, torch.Tensor]:
    """The live tensors a state holds, by key (see the module docstring): the trained ones and those of the copies
    named in ``synced`` (default: `synced_copies`)."""
    synced = tuple(synced_copies(policy, include_reference) if synced is None else synced)
    model = _trained_model(policy)
    params = dict(model.named_parameters())
    names = [name for name, p in params.items() if p.requires_grad]
    if not names:
        raise RuntimeError("The policy has no trainable tensor to send to the rollout workers.")
    out = {f"policy/{name}": params[name] for name in names}
    for copy_name in synced:
        if copy_name == OLD_POLICY:
            if policy.old_policy is None:
                raise ValueError("The rollout workers need the old policy, which this policy does not keep.")
            out.update(_copy_tensors("old_policy", policy.old_policy, params))
        elif copy_name == REFERENCE:
            reference = policy.reference
            if reference is None:
                continue  # nothing can change: the rollouts read the base
            if reference.kind == "adapter":
                out.update({f"policy/{ref_key}": params[ref_key] for _, ref_key in reference._adapter.names})
            elif reference.kind == "copy":
                out.update({f"reference/{name}": p for name, p in reference.copy.named_parameters()})
        else:
            if copy_name not in policy.copies:
                raise ValueError(f"The rollout workers need the copy {copy_name!r}, which this policy does not keep "
                                 f"(it keeps {sorted(policy.copies)}).")
            out.update(_copy_tensors(f"copy/{copy_name}", policy.copies[copy_name], params))
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
def collect_policy_state(policy: Any, *, synced: Iterable[str] | None = None,
                         include_reference: bool = False) -> dict[str, torch.Tensor]:
    """The worker's weights as CPU tensors (contiguous copies). Call it on every process of a launch: a sharded tensor
    (FSDP2's DTensor) is gathered with ``full_tensor()`` and ZeRO-3's partitions with ``GatheredParameters``, both
    collectives that every rank must enter (a gather on rank 0 alone waits forever)."""
    live = live_tensors(policy, synced, include_reference=include_reference)
    state = {}
    with _gathered(policy, list(live.values())):
        for key in sorted(live):
            value = live[key].detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            state[key] = value.to("cpu", copy=True).contiguous()
    return state


def check_layout(live: Mapping[str, torch.Tensor], layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Every tensor the worker samples with must be in the sent ``layout`` (key -> dtype, shape) and every key must
    name one of them (a missing adapter, e.g. the old policy's, or another model's keys are refused); dtypes and shapes
    must match exactly (no silent cast)."""
    missing = sorted(set(live) - set(layout))
    unexpected = sorted(set(layout) - set(live))
    if missing or unexpected:
        raise ValueError(f"The weights sent to the rollout worker do not match its policy: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all). The "
                         "worker must be built with the trainer's model, LoRA configuration and algorithm.")
    for key, target in live.items():
        dtype, shape = layout[key]
        if dtype != target.dtype or tuple(shape) != tuple(target.shape):
            raise ValueError(f"{key}: the trainer sent {dtype} {tuple(shape)}, the worker holds "
                             f"{target.dtype} {tuple(target.shape)}.")


@torch.no_grad()
def load_policy_state(policy: Any, state: Mapping[str, torch.Tensor], *, synced: Iterable[str] | None = None,
                      include_reference: bool = False) -> None:
    """Copy ``state`` into the worker's policy, in place, after `check_layout`."""
    live = live_tensors(policy, synced, include_reference=include_reference)
    check_layout(live, {k: (v.dtype, tuple(v.shape)) for k, v in state.items()})
    for key, target in live.items():
        target.copy_(state[key].to(target.device))


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


def policy_state_digest(policy: Any, *, synced: Iterable[str] | None = None, include_reference: bool = False) -> str:
    """The digest of what ``policy`` holds now (a worker's answer after loading: read back from its own tensors, not
    from what it was sent)."""
    return state_digest(live_tensors(policy, synced, include_reference=include_reference))


# ---- buckets of a collective broadcast -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a state travels: bucket ``bucket``, elements ``offset .. offset + numel`` of that bucket's
    flat tensor, of ``dtype`` (its name, e.g. ``"float32"``) and ``shape``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    numel: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def bucket_layout(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[TensorSlot]]:
    """The buckets of ``state``: its tensors in key order, grouped by dtype, a new bucket whenever the next tensor
    would take the current one past ``bucket_bytes``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0.")
    by_dtype: dict[torch.dtype, list[str]] = {}
    for key in sorted(state):
        by_dtype.setdefault(state[key].dtype, []).append(key)
    buckets: list[list[TensorSlot]] = []
    for dtype in sorted(by_dtype, key=str):
        current: list[TensorSlot] = []
        used = 0
        for key in by_dtype[dtype]:
            tensor = state[key]
            size = tensor.numel() * tensor.element_size()
            if current and used + size > bucket_bytes:
                buckets.append(current)
                current, used = [], 0
            current.append(TensorSlot(key, str(dtype).removeprefix("torch."), tuple(tensor.shape), len(buckets),
                                      used // tensor.element_size(), tensor.numel()))
            used += size
        if current:
            buckets.append(current)
    return buckets


def pack_bucket(state: Mapping[str, torch.Tensor], bucket: list[TensorSlot],
                device: torch.device | str = "cpu") -> torch.Tensor:
    """The flat tensor of ``bucket`` (on ``device``)."""
    flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].torch_dtype, device=device)
    for slot in bucket:
        flat[slot.offset:slot.offset + slot.numel].copy_(state[slot.key].reshape(-1))
    return flat


@torch.no_grad()
def unpack_bucket(flat: torch.Tensor, bucket: list[TensorSlot], live: Mapping[str, torch.Tensor]) -> None:
    """Copy each slot of the received ``flat`` tensor into the live tensor of its key."""
    for slot in bucket:
        target = live[slot.key]
        target.copy_(flat[slot.offset:slot.offset + slot.numel].view(slot.shape).to(target.device))
