"""Prompt datasets as the trainer sees them: rows with a ``prompt`` column plus the row index.

The index identifies a prompt's group: the G images sampled for one dataset row share it, even when two rows
hold the same text.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

from ...rewards.composition import AUDIO_COLUMNS

INDEX_COLUMN = "_flowgrpo_index"
PROMPT_COLUMN = "prompt"


class IndexedPromptDataset(Dataset):
    def __init__(self, data: Any):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        row = self.data[index]
        row = {PROMPT_COLUMN: row} if isinstance(row, str) else dict(row)
        row[INDEX_COLUMN] = int(index)
        return row

    @classmethod
    def wrap(cls, data: Any, name: str) -> IndexedPromptDataset | None:
        """Wrap ``data`` (a ``datasets.Dataset``, a list of dicts or of strings, or a map-style dataset of dicts)
        after checking it is non-empty and has a ``prompt`` column."""
        if data is None or isinstance(data, IndexedPromptDataset):
            return data
        if hasattr(data, "keys") and not hasattr(data, "column_names"):
            raise TypeError(f"{name} is a mapping with keys {list(data.keys())} (a DatasetDict?); pass one split, "
                            f"e.g. {name}=dataset['train'].")
        if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
            raise TypeError(f"{name} must be a map-style dataset with a length (datasets.Dataset, list of dicts or "
                            f"of strings), got {type(data).__name__}.")
        if len(data) == 0:
            raise ValueError(f"{name} is empty; it needs at least one prompt.")
        columns = getattr(data, "column_names", None)
        if columns is None:
            first = data[0]
            columns = [PROMPT_COLUMN] if isinstance(first, str) else list(first.keys())
        if PROMPT_COLUMN not in columns:
            raise ValueError(f"{name} has no '{PROMPT_COLUMN}' column (columns: {columns}); rename the column that "
                             f"holds the text, e.g. dataset.rename_column('text', '{PROMPT_COLUMN}').")
        reserved = [c for c in columns if c in AUDIO_COLUMNS]
        if reserved:
            raise ValueError(f"{name} has the column(s) {reserved}, reserved for the sound a model generates (given to "
                             f"the rewards that score it); rename them, e.g. dataset.rename_column('{reserved[0]}', "
                             f"'{reserved[0]}_reference').")
        return cls(data)
