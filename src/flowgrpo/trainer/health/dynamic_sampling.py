r"""Dynamic sampling (DAPO) bookkeeping: which groups carry no signal, fresh prompts, and rebuilding the batch.

A group whose valid rewards are all equal (or that has none) gets advantage 0 for every image and teaches nothing.
With ``filter_zero_std_groups`` such groups are dropped after scoring and replaced by groups of fresh prompts
(drawn at random from the training set, from a seed that depends on the run's seed, the generation, the round and
the process), sampled and scored like the others; a replacement must itself have a non-zero std. After
``max_resample_rounds`` rounds, dropped groups that found no replacement are put back, so the batch keeps its
size and every micro-batch its shape. Replacement groups get fresh group ids, negative so that they never equal a
dataset index: -(1 + process * 2^20 + k).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["concat_records", "fresh_prompt_indices", "groups_without_signal", "replacement_group_id",
           "select_rows", "split_rows"]


def groups_without_signal(rewards: torch.Tensor, group_ids: torch.Tensor) -> list[int]:
    """Group ids (in first-seen order) whose valid rewards have zero population std, or that have no valid reward."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    group_ids = torch.as_tensor(group_ids)
    out, seen = [], set()
    for g in group_ids.tolist():
        if g in seen:
            continue
        seen.add(g)
        r = rewards[group_ids == g]
        r = r[~torch.isnan(r)]
        if r.numel() == 0 or float(r.std(unbiased=False)) <= 1e-12:
            out.append(int(g))
    return out


def fresh_prompt_indices(dataset_size: int, count: int, seed: int) -> list[int]:
    """``count`` dataset indices drawn uniformly (with replacement only when the set is smaller than ``count``)."""
    gen = torch.Generator().manual_seed(int(seed) & ((1 << 63) - 1))
    if count <= dataset_size:
        return torch.randperm(dataset_size, generator=gen)[:count].tolist()
    return torch.randint(dataset_size, (count,), generator=gen).tolist()


def replacement_group_id(process_index: int, k: int) -> int:
    return -(1 + process_index * (1 << 20) + k)


def _rows(value: Any) -> int | None:
    from ...models import PromptEmbeds

    if isinstance(value, PromptEmbeds):
        return len(value)
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.shape[0]
    return None


def concat_records(records: Sequence[dict]) -> dict:
    """Row-wise concatenation of rollout records (dicts of batch-first tensors and ``PromptEmbeds``); values without
    rows (e.g. Flow-GRPO's window) must be equal in every record and are kept once."""
    from ...models import PromptEmbeds

    out = {}
    for key in records[0]:
        values = [r[key] for r in records]
        if isinstance(values[0], PromptEmbeds):
            out[key] = PromptEmbeds.cat(values)
        elif _rows(values[0]) is not None:
            out[key] = torch.cat([v.to(values[0].device) for v in values], dim=0)
        else:
            if any(v != values[0] for v in values[1:]):
                raise ValueError(f"Rollout records disagree on {key!r}: {values}; they cannot be merged.")
            out[key] = values[0]
    return out


def select_rows(record: dict, index: torch.Tensor) -> dict:
    """Rows ``index`` of every batch-first value of ``record`` (others kept)."""
    from ...models import PromptEmbeds

    out = {}
    for key, value in record.items():
        if isinstance(value, PromptEmbeds):
            out[key] = value.index_select(index)
        elif _rows(value) is not None:
            out[key] = value.index_select(0, index.to(value.device))
        else:
            out[key] = value
    return out


def split_rows(record: dict, size: int) -> list[dict]:
    """``record`` cut into consecutive pieces of ``size`` rows."""
    n = next(_rows(v) for v in record.values() if _rows(v) is not None)
    return [select_rows(record, torch.arange(s, min(s + size, n))) for s in range(0, n, size)]
