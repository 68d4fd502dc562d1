"""Sequence parallelism (``sequence_parallel_size``): the tokens of every sample split over a group of processes
(Ulysses, through diffusers' context parallelism), for video samples too long for one GPU.

* `layout`: which processes form an SP group, and the data-parallel view of the accelerator that the trainer's parts
  count samples with (one copy per group);
* `ulysses`: the attention and the gather for token counts S does not divide, with their backward passes;
* `enable`: the device mesh and the switch of one transformer to its family's plan.
"""

from .enable import MESH_DIMS, enable_sequence_parallel, sequence_parallel_mesh
from .layout import DataParallelView, SequenceParallelLayout, sequence_parallel_loss_scale
from .ulysses import UlyssesAttention, gather_sequence

__all__ = ["MESH_DIMS", "DataParallelView", "SequenceParallelLayout", "UlyssesAttention", "enable_sequence_parallel",
           "gather_sequence", "sequence_parallel_loss_scale", "sequence_parallel_mesh"]
