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

    With sequence parallelism (``sequence_parallel_size = S``, ``data_parallel_size = D``) the processes of an SP
    group must get the same rows: the chunk is cut into D equal shares (one per replica) and each share is emitted S
    times in a row, so that accelerate's consecutive slices give ranks ``d S .. d S + S - 1`` share d.

        the chunk above with D = 1, S = 2: [2, 2, 0, 0, 1, 1,   2, 2, 0, 0, 1, 1,   ...]  (each slice once per rank)
    """

    def __init__(self, data_source: Sized, num_generations: int, prompts_per_generation: int,
                 repeat_count: int = 1, shuffle: bool = True, seed: int = 0, sequence_parallel_size: int = 1,
                 data_parallel_size: int = 1):
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
        self.sequence_parallel_size = int(sequence_parallel_size)
        self.data_parallel_size = int(data_parallel_size)
        rows = prompts_per_generation * num_generations
        if rows % self.data_parallel_size:
            raise ValueError(f"A generation batch of {rows} images cannot be shared by {self.data_parallel_size} "
                             "data-parallel replicas; make it a multiple of them.")

    def _emit(self, chunk: list[int]) -> Iterator[int]:
        """One generation batch's rows, ``repeat_count`` times: each prompt ``num_generations`` times in a row, and
        each replica's share once per process of its SP group."""
        rows = [index for index in chunk for _ in range(self.num_generations)]
        share = len(rows) // self.data_parallel_size
        shares = [rows[d * share:(d + 1) * share] for d in range(self.data_parallel_size)]
        for _ in range(self.repeat_count):
            for part in shares:
                for _ in range(self.sequence_parallel_size):
                    yield from part

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
            yield from self._emit(order[start:start + self.prompts_per_generation])

    def __len__(self) -> int:
        usable = self.num_samples - self.num_samples % self.prompts_per_generation
        return usable * self.num_generations * self.repeat_count * self.sequence_parallel_size


class DomainRepeatSampler(RepeatSampler):
    """A `RepeatSampler` whose generation batches each hold prompts of one domain, the domains in turn.

    ``row_domains[i]`` is row i's domain (e.g. the dataset's ``dataset_name`` column); generation g (counted from the
    start of training, over epochs) draws its ``prompts_per_generation`` distinct prompts from domain
    ``domains[g % len(domains)]``, the next ones of that domain's stream (its rows in a fresh permutation per pass,
    from ``seed``, the domain and the pass). Everything is a function of g, so every rank agrees and a resumed run
    continues the same streams. An epoch has as many generations as a `RepeatSampler` over the same rows.
    """

    def __init__(self, row_domains: list, domains: list, num_generations: int, prompts_per_generation: int,
                 repeat_count: int = 1, shuffle: bool = True, seed: int = 0):
        super().__init__(row_domains, num_generations, prompts_per_generation, repeat_count, shuffle, seed)
        self.domains = list(domains)
        self.rows = {d: [i for i, v in enumerate(row_domains) if v == d] for d in self.domains}
        small = {d: len(rows) for d, rows in self.rows.items() if len(rows) < prompts_per_generation}
        if small:
            raise ValueError(f"Domains {small} have fewer prompts than one generation batch needs "
                             f"({prompts_per_generation} distinct prompts); add prompts or lower generation_batch_size.")

    def _stream(self, domain, start: int, count: int) -> list[int]:
        rows = self.rows[domain]
        out: list[int] = []
        position = start
        while len(out) < count:
            cycle, offset = divmod(position, len(rows))
            if self.shuffle:
                key = sum(ord(c) for c in str(domain)) * 1_000_003 + self.domains.index(domain)
                g = torch.Generator().manual_seed(self.seed + 7919 * cycle + key)
                order = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
            else:
                order = rows
            take = order[offset:offset + count - len(out)]
            out += take
            position += len(take)
        return out

    def domain_of_generation(self, generation: int):
        return self.domains[generation % len(self.domains)]

    def __iter__(self) -> Iterator[int]:
        per_epoch = len(self) // (self.prompts_per_generation * self.num_generations * self.repeat_count
                                  * self.sequence_parallel_size)
        k = len(self.domains)
        for local in range(per_epoch):
            g = self.epoch * per_epoch + local
            domain = self.domains[g % k]
            yield from self._emit(self._stream(domain, (g // k) * self.prompts_per_generation,
                                               self.prompts_per_generation))
