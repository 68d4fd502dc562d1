"""FSDP2's own sharding of a recipe's transformer, on a fake process group: the cross-check of the planned states.

The planner counts FSDP2's per-GPU weights, gradients and optimizer states as numel x bytes / world size
(:func:`~flowgrpo.plan.planner.compose`). This module does what accelerate does with the config, without a GPU and
without memory, and reads the shards FSDP2 really makes:

1. the transformer is built from its config on the meta device and gets the recipe's LoRA (as the planned step);
2. a fake process group of the config's world size (``torch.testing._internal.distributed.fake_pg``) and a
   one-dimensional ``DeviceMesh`` over it;
3. ``fully_shard`` on every module whose class the config names (``fsdp_transformer_layer_cls_to_wrap``), then on
   the root, with the config's ``reshard_after_forward``;
4. the shards are materialised as fake tensors (``FakeTensorMode``), every trained shard gets a zero gradient and
   one AdamW step creates the optimizer states.

FSDP2 splits each parameter along its first dimension as ``torch.chunk`` does: rank 0 holds ``ceil(d / n)`` rows,
the last ranks fewer (or none), so rank 0 is the most loaded rank and every rank's shards add up to the whole
parameter. :func:`fsdp2_states` returns rank 0's local bytes next to the planner's ``/ n`` figures; the difference is
the padding of uneven first dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .accelerate_config import Parallelism
from .model_specs import ModelSpec
from .step import StepSettings, build_on_meta, prepare_transformer

__all__ = ["ShardedStates", "fsdp2_states"]


@dataclass(frozen=True)
class ShardedStates:
    """Rank 0's local bytes under FSDP2 and the planner's figure for each (bytes)."""

    world_size: int
    wrapped_modules: int                 # modules of the config's classes sharded before the whole model
    trained_weights: float               # rank 0's local trained parameters
    frozen_weights: float                # rank 0's local frozen parameters
    gradients: float                     # rank 0's local gradients (the trained shards' own dtype)
    optimizer_states: float              # rank 0's AdamW exp_avg + exp_avg_sq
    planned: dict[str, float]            # the same four terms as numel x bytes / world size

    def ratios(self) -> dict[str, float]:
        """Rank 0 over planned, per term (1.0 when a term is empty)."""
        measured = {"trained_weights": self.trained_weights, "frozen_weights": self.frozen_weights,
                    "gradients": self.gradients, "optimizer_states": self.optimizer_states}
        return {k: (v / self.planned[k] if self.planned[k] else 1.0) for k, v in measured.items()}

    def as_dict(self) -> dict[str, Any]:
        from .planner import GB as gb

        return {"world_size": self.world_size, "wrapped_modules": self.wrapped_modules,
                "rank0_gb": {"trained_weights": self.trained_weights / gb, "frozen_weights": self.frozen_weights / gb,
                             "gradients": self.gradients / gb, "optimizer_states": self.optimizer_states / gb},
                "planned_gb": {k: v / gb for k, v in self.planned.items()},
                "rank0_over_planned": self.ratios()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors) -> float:
    return float(sum(_local(t).numel() * t.element_size() for t in tensors))


def fsdp2_states(spec: ModelSpec, settings: StepSettings, parallel: Parallelism,
                 transformer_config: dict[str, Any] | None = None) -> ShardedStates:
    """Shard ``spec``'s transformer (``transformer_config``: a smaller one, for tests) as ``parallel`` says, on a
    fake process group, and return rank 0's weights, gradients and AdamW states with the planner's figures.

    Raises ``ValueError`` for a configuration that is not FSDP, ``RuntimeError`` when a process group already exists
    in this process (the fake one would replace it)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if parallel.kind != "fsdp":
        raise ValueError(f"{parallel.source}: a {parallel.kind} configuration; FSDP2's sharding applies to FSDP ones.")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; check FSDP2's sharding in a fresh one.")
    n = parallel.world_size
    transformer, _ = build_on_meta(spec, transformer_config)
    model = prepare_transformer(transformer, settings, spec)
    wrap = set(parallel.wrap_classes)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        mesh = init_device_mesh("cpu", (n,))
        wrapped = 0
        for module in reversed(list(transformer.modules())):  # inner modules first, as accelerate wraps them
            if type(module).__name__ in wrap:
                fully_shard(module, mesh=mesh, reshard_after_forward=parallel.reshard_after_forward)
                wrapped += 1
        fully_shard(model, mesh=mesh, reshard_after_forward=parallel.reshard_after_forward)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            trained = [p for p in model.parameters() if p.requires_grad]
            frozen = [p for p in model.parameters() if not p.requires_grad]
            for p in trained:
                p.grad = torch.zeros_like(p)
            optimizer = torch.optim.AdamW(trained, lr=1e-4, foreach=False)
            optimizer.step()
            states = [v for state in optimizer.state.values() for k, v in state.items()
                      if k in ("exp_avg", "exp_avg_sq")]
            measured = dict(trained_weights=_bytes(trained), frozen_weights=_bytes(frozen),
                            gradients=_bytes(p.grad for p in trained), optimizer_states=_bytes(states))
            trained_bytes = sum(p.numel() * p.element_size() for p in trained) / n  # the planner's numel x bytes / n
            planned = {"trained_weights": trained_bytes, "gradients": trained_bytes,
                       "optimizer_states": 2 * trained_bytes,
                       "frozen_weights": sum(p.numel() * p.element_size() for p in frozen) / n}
    finally:
        dist.destroy_process_group()
    return ShardedStates(n, wrapped, planned=planned, **measured)
