"""Switching a diffusers transformer to Ulysses sequence parallelism: the device mesh, diffusers' context-parallel
configuration, the family's plan of what to split and gather.

The mesh has three named dimensions, ``("data_parallel", "ring", "ulysses")`` of sizes ``(D, 1, S)``: diffusers reads
its ``"ring"`` and ``"ulysses"`` dimensions (``ContextParallelConfig(ulysses_degree=S, mesh=...)``), the rows of
``"ulysses"`` being the SP groups of consecutive ranks. FSDP2 (accelerate's ``fully_shard``) shards over the whole
launch, i.e. over the flattened ``data_parallel x ulysses`` mesh, and averages gradients over it; the trainer
multiplies each loss by S so that the average is the mean over replicas of each SP group's summed gradient
(`layout.sequence_parallel_loss_scale`).
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import SequenceParallelLayout, check_heads_divisible
from .ulysses import SequenceGatherHook, install_trainable_ulysses

__all__ = ["MESH_DIMS", "enable_sequence_parallel", "sequence_parallel_mesh"]

#: the names of the mesh's dimensions (diffusers needs "ring" and "ulysses")
MESH_DIMS = ("data_parallel", "ring", "ulysses")
_INPUT_HOOK = "flowgrpo_sp_input---{}"
_OUTPUT_HOOK = "flowgrpo_sp_output---{}"


def sequence_parallel_mesh(layout: SequenceParallelLayout, device: torch.device) -> Any:
    """The ``(D, 1, S)`` device mesh of the launch (a collective: every process calls it, once)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (layout.data_parallel_size, 1, layout.size), mesh_dim_names=MESH_DIMS)


def _attention_head_counts(transformer: torch.nn.Module) -> set[int]:
    """The head counts of the transformer's attention modules (diffusers' ``heads``)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return {int(m.heads) for m in transformer.modules()
            if isinstance(m, (Attention, AttentionModuleMixin)) and getattr(m, "heads", None)}


def enable_sequence_parallel(transformer: torch.nn.Module, plan: dict, mesh: Any, device: torch.device) -> None:
    """Split ``transformer``'s tokens over the ``"ulysses"`` dimension of ``mesh`` following ``plan`` (a diffusers
    context-parallel plan: module name -> inputs to split, or outputs to gather).

    diffusers' ``enable_parallelism`` sets up the attention processors (their ``_parallel_config``) and checks the
    attention backend; the plan's hooks are diffusers' split hook (``tensor_split``: any token count) and
    `SequenceGatherHook`; the attention is `ulysses.UlyssesAttention`. ``transformer`` is the diffusers model (inside
    a peft model, after the LoRA layers are in place, so that a gathered output includes its LoRA's part).
    """
    from diffusers.hooks.context_parallel import ContextParallelSplitHook, _get_submodule_by_name
    from diffusers.hooks.hooks import HookRegistry
    from diffusers.models._modeling_parallel import ContextParallelConfig, ContextParallelOutput, ParallelConfig

    size = int(mesh["ulysses"].size())
    for heads in sorted(_attention_head_counts(transformer)):
        check_heads_divisible(heads, size, type(transformer).__name__)
    install_trainable_ulysses()
    config = ContextParallelConfig(ulysses_degree=size, mesh=mesh, ulysses_anything=True)
    if device.type == "cpu":
        # diffusers 0.42.1 computes the device as ``rank % torch.accelerator.device_count()``, which is 0 on a CPU
        # (ZeroDivisionError), even when given a mesh: resolve the configuration with the CPU device here instead.
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

        def resolve_on_cpu(cp_config):
            parallel = ParallelConfig(context_parallel_config=cp_config)
            parallel.setup(rank, world, device, mesh=mesh)
            transformer._parallel_config = parallel
            return parallel

        transformer._resolve_parallel_config = resolve_on_cpu
    # the processors and the backend check; the plan's hooks are ours (an empty plan registers none of diffusers')
    transformer.enable_parallelism(config=config, cp_plan={})
    if device.type == "cpu":
        del transformer._resolve_parallel_config
    for module_id, spec in plan.items():
        found = _get_submodule_by_name(transformer, module_id)
        for module in found if isinstance(found, list) else [found]:
            registry = HookRegistry.check_if_exists_or_initialize(module)
            if isinstance(spec, dict):
                registry.register_hook(ContextParallelSplitHook(spec, config), _INPUT_HOOK.format(module_id))
            else:
                outputs = [spec] if isinstance(spec, ContextParallelOutput) else list(spec)
                registry.register_hook(SequenceGatherHook(outputs, config), _OUTPUT_HOOK.format(module_id))
