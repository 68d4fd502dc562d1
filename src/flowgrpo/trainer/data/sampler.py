"""Prompt sampler that lays out GRPO groups for the Trainer's dataloader."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import Sampler


class RepeatSampler(Sampler[int]):
    """Yields dataset indices so that each generation batch holds whole groups.

    For every chunk of ``prompts_per_generation`` distinct indices (a fresh permutation per epoch, identical on
    every rank because it depends only on ``seed`` and the epoch), each index is repeated ``num_generations``
    times consecutively, and the whole chunk is emitted ``repeat_count`` times (once per micro-batch step that
    trains on that generation batch; the trainer samples only on the first). Accelerate then hands each rank
    its consecutive slice of every global batch, so a group may span ranks; rewards are gathered before
    advantages are computed.

        seed 0, 3 prompts, G=2, prompts_per_generation=3, repeat_count=2:
        [2, 2, 0, 0, 1, 1,   2, 2, 0, 0, 1, 1,   ...]
    """

    def __init__(self, data_source: Sized, num_generations: int, prompts_per_generation: int,
                 repeat_count: int = 1, shuffle: bool = True, seed: int = 0):
        self.num_samples = len(data_source)
        if self.num_samples < prompts_per_generation:
            raise ValueError(
                f"The dataset has {self.num_samples} prompts but one generation batch needs "
                f"{prompts_per_generation} distinct prompts; add prompts or lower generation_batch_size."
            )
        self.num_generations = num_generations
        self.prompts_per_generation = prompts_per_generation
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        usable = self.num_samples - self.num_samples % self.prompts_per_generation
        for start in range(0, usable, self.prompts_per_generation):
            chunk = order[start:start + self.prompts_per_generation]
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.num_generations

    def __len__(self) -> int:
        usable = self.num_samples - self.num_samples % self.prompts_per_generation
        return usable * self.num_generations * self.repeat_count
