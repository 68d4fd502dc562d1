"""Reading the training dataloader ahead (`ReadAhead`), so that the Ray backend knows the rows of the coming
generations while the current one trains."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

__all__ = ["ReadAhead"]


class ReadAhead:
    """Wraps the Trainer's epoch iterator: yields its batches unchanged, in order, while keeping ``depth`` batches read
    ahead; each batch that starts a generation (micro-step ``position`` a multiple of ``period``) is shown to
    ``note(generation, rows)`` as soon as it is read."""

    def __init__(self, source: Iterator, position: int, depth: int, period: int, note: Callable):
        self.source, self.position, self.depth, self.period, self.note = source, position, depth, period, note
        self.buffer: deque = deque()
        self.exhausted = False

    def __iter__(self) -> ReadAhead:
        return self

    def _fill(self, count: int) -> None:
        while len(self.buffer) < count and not self.exhausted:
            try:
                batch = next(self.source)
            except StopIteration:
                self.exhausted = True
                break
            if self.position % self.period == 0:
                self.note(self.position // self.period, batch)
            self.position += 1
            self.buffer.append(batch)

    def __next__(self):
        self._fill(1)
        if not self.buffer:
            raise StopIteration
        batch = self.buffer.popleft()
        self._fill(self.depth)
        return batch
