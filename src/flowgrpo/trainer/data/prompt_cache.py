"""Prompt-embedding cache and text-encoder offloading: two of the memory savers of ``recipes/sd35m_24gb.yaml``.

The text encoders are frozen, so the embedding of a prompt never changes during a run. With
``cache_prompt_embeddings`` every distinct prompt is encoded once; its embedding rows are kept in host memory and
every later rollout or evaluation batch that holds the prompt reuses them (both go through
``RolloutEngine.encode_unique``). The cache is keyed by :func:`prompt_cache_key`: the prompt text plus an
optional digest of a conditioning input (the image of an editing model), so families whose embedding depends on
an image can share it.

With ``offload_text_encoders`` the encoders leave the accelerator once the cache is set up (for SD3.5: CLIP-L,
CLIP-G and T5-XXL, about 11 GB in bf16). A prompt that is not in the cache still works: the encoders are moved
back to the accelerator for that one encode and sent away again (:meth:`TextEncoderOffload.on_compute_device`).
We move them rather than encode on the CPU because T5-XXL costs about 2.4 TFLOP per prompt at 256 tokens (seconds per
prompt on a CPU, and bf16 CPU kernels are slow or missing on many hosts), while the round trip of 11 GB over PCIe
takes a second or two. The visit happens between optimizer steps, before sampling starts, when no activations or
gradients are alive, so it adds the encoders to the smallest footprint of the step rather than to its peak.

Cost of the cache, per prompt: one row of every embedding tensor. SD3/3.5 at ``max_sequence_length=256`` in bf16:
``prompt_embeds`` of (77 CLIP + 256 T5) tokens x 4096 plus ``pooled_prompt_embeds`` of 2048 = 2,732,032 bytes
(2.73 MB): 1024 prompts take 2.8 GB of host memory per process, the 20k prompts of a large OCR set 55 GB. That is
why the cache is bounded (``prompt_cache_size``, least recently used prompts dropped first) and why precomputing
every prompt of the datasets (``precompute_prompt_embeddings``) is refused, before anything is loaded, when the
datasets hold more distinct prompts than the cache.

Rows of different lengths: the text encoders of the Qwen-Image families (Qwen-Image, Qwen-Image 2.1,
Qwen-Image-Edit and -Edit-Plus) pad a batch only to its longest prompt, so rows cached from different batches can
differ along the sequence dimension (dim 1). A lookup pads every such tensor at the end of dim 1 with zeros, and
its mask (``prompt_embeds_mask``; for Qwen-Image 2.1 also ``image_pad_mask``) with zeros, exactly as the stock
pipelines pad a batch (``_get_qwen_prompt_embeds``: ``cat([u, u.new_zeros(...)])``). Text positions stay where they
were and the padding is masked out of attention, so the transformer's output for each row is that of the batched
encoding. A ragged tensor without a mask of the same lengths (a tensor whose name contains ``mask``) is refused
with an error (`flowgrpo.models.base.pad_rows_to_longest`).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from ...models import PromptEmbeds
from ...models.base import pad_rows_to_longest
from .datasets import PROMPT_COLUMN, IndexedPromptDataset

__all__ = [
    "PromptEmbeddingCache",
    "TextEncoderOffload",
    "check_prompt_cache_capacity",
    "dataset_prompts",
    "prompt_cache_key",
    "setup_prompt_cache",
    "text_encoders_of",
]

PromptKey = tuple[str, str | None]


def _condition_digest(condition: Any) -> str | None:
    """A stable digest of a conditioning input: a PIL image, a tensor / array, bytes or a string (a path or URL)."""
    if condition is None:
        return None
    digest = hashlib.sha1()
    if isinstance(condition, str):
        digest.update(b"str:" + condition.encode())
    elif isinstance(condition, (bytes, bytearray)):
        digest.update(b"bytes:" + bytes(condition))
    elif hasattr(condition, "tobytes") and hasattr(condition, "mode") and hasattr(condition, "size"):  # PIL image
        digest.update(f"pil:{condition.mode}:{condition.size}:".encode())
        digest.update(condition.tobytes())
    elif isinstance(condition, torch.Tensor):
        tensor = condition.detach().cpu().contiguous()
        digest.update(f"tensor:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif hasattr(condition, "tobytes") and hasattr(condition, "shape"):  # numpy array
        digest.update(f"array:{condition.dtype}:{tuple(condition.shape)}:".encode())
        digest.update(condition.tobytes())
    elif isinstance(condition, (list, tuple)):  # several source images of one prompt, in order
        digest.update(f"list:{len(condition)}:".encode())
        for part in condition:
            digest.update(str(_condition_digest(part)).encode())
    else:
        raise TypeError(f"Cannot key the prompt cache on a conditioning input of type {type(condition).__name__}; "
                        "pass a PIL image, a tensor, an array, bytes, a string or a list of them.")
    return digest.hexdigest()


def prompt_cache_key(prompt: str, condition: Any = None) -> PromptKey:
    """The cache key of one prompt: ``(prompt, None)``, or ``(prompt, digest of condition)`` for a prompt whose
    embedding also depends on a conditioning input (e.g. the source image of an editing model)."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}: {prompt!r}")
    return (prompt, _condition_digest(condition))


def text_encoders_of(pipeline: Any) -> dict[str, torch.nn.Module]:
    """The pipeline's text encoders: its ``torch.nn.Module`` components named ``text_encoder*``."""
    return {name: module for name, module in pipeline.components.items()
            if name.startswith("text_encoder") and isinstance(module, torch.nn.Module)}


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return None


class TextEncoderOffload:
    """Keeps a set of text encoders off the accelerator and brings them back only to encode.

    ``offloaded`` says where they are meant to be; ``visits`` counts the encodes that brought them back, and
    ``history`` records every move as ``(event, device)`` (``"offload"``, ``"visit"``, ``"restore"``).
    """

    def __init__(self, modules: Mapping[str, torch.nn.Module], compute_device: torch.device | str,
                 offload_device: torch.device | str = "cpu"):
        self.modules = dict(modules)
        self.compute_device = torch.device(compute_device)
        self.offload_device = torch.device(offload_device)
        self.offloaded = False
        self.visits = 0
        self.history: list[tuple[str, str]] = []

    def _move(self, device: torch.device, event: str) -> None:
        for module in self.modules.values():
            module.to(device)
        self.history.append((event, str(device)))
        if self.compute_device.type == "cuda" and device != self.compute_device:
            torch.cuda.empty_cache()  # hand the encoders' blocks back instead of keeping them reserved

    def offload(self) -> None:
        """Move the encoders to ``offload_device`` (the CPU)."""
        self._move(self.offload_device, "offload")
        self.offloaded = True

    def restore(self) -> None:
        """Move the encoders back to the accelerator for good (e.g. before calling the pipeline directly)."""
        self._move(self.compute_device, "restore")
        self.offloaded = False

    @contextmanager
    def on_compute_device(self) -> Iterator[None]:
        """The encoders on the accelerator inside the block; back off it afterwards if they were offloaded."""
        if not self.offloaded:
            yield
            return
        self.visits += 1
        self._move(self.compute_device, "visit")
        try:
            yield
        finally:
            self._move(self.offload_device, "offload")

    def devices(self) -> dict[str, str | None]:
        """Where each encoder's weights are now."""
        return {name: (str(d) if (d := _device_of(m)) is not None else None) for name, m in self.modules.items()}


class PromptEmbeddingCache:
    """Embeddings of distinct prompts, encoded once and kept on ``storage_device`` (host memory).

    Args:
        encode: ``encode(prompts, device) -> PromptEmbeds`` (one row per prompt), e.g. the family adapter's
            ``encode_prompts`` at the run's ``max_sequence_length``; for prompts that come with conditioning inputs
            it is called as ``encode(prompts, device, conditions=[...])``.
        device: where returned embeddings go (the accelerator).
        capacity: most prompts kept; the least recently used are dropped first.
        offload: the text encoders to bring back to ``device`` when something must be encoded, or ``None``.
        storage_device: where the cached rows live (the CPU).
    """

    def __init__(self, encode: Callable[[list[str], torch.device], PromptEmbeds], device: torch.device | str,
                 capacity: int = 1024, offload: TextEncoderOffload | None = None,
                 storage_device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError(f"capacity={capacity} must be >= 1 prompts.")
        self.encode = encode
        self.device = torch.device(device)
        self.capacity = int(capacity)
        self.offload = offload
        self.storage_device = torch.device(storage_device)
        self._entries: OrderedDict[PromptKey, dict[str, torch.Tensor]] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.encoded = 0  # prompts run through the text encoders
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: PromptKey | str) -> bool:
        return (prompt_cache_key(key) if isinstance(key, str) else key) in self._entries

    @property
    def bytes_per_prompt(self) -> int | None:
        """Host memory of one cached prompt (``None`` while the cache is empty)."""
        for entry in self._entries.values():
            return sum(t.numel() * t.element_size() for t in entry.values())
        return None

    def stats(self) -> dict[str, float]:
        per_prompt = self.bytes_per_prompt or 0
        return {"size": len(self), "hits": self.hits, "misses": self.misses, "encoded": self.encoded,
                "evicted": self.evicted, "bytes": per_prompt * len(self),
                "encoder_visits": self.offload.visits if self.offload is not None else 0}

    # ---- filling ---------------------------------------------------------------------------------
    def _encode_into_cache(self, keys: Sequence[PromptKey], batch_size: int | None = None,
                           conditions: Mapping[PromptKey, Any] | None = None) -> None:
        """Run the text encoders on ``keys`` (in batches of ``batch_size``; all at once when ``None``), with each
        key's conditioning input from ``conditions`` when given."""
        if not keys:
            return
        step = len(keys) if not batch_size else int(batch_size)
        context = self.offload.on_compute_device() if self.offload is not None else nullcontext()
        with context, torch.no_grad():
            for start in range(0, len(keys), step):
                chunk = list(keys[start:start + step])
                prompts = [prompt for prompt, _ in chunk]
                if conditions is None:
                    embeds = self.encode(prompts, self.device)
                else:
                    embeds = self.encode(prompts, self.device, conditions=[conditions[k] for k in chunk])
                if len(embeds) != len(chunk):
                    raise RuntimeError(f"The text encoders returned {len(embeds)} rows for {len(chunk)} prompts.")
                for row, key in enumerate(chunk):
                    self._entries[key] = {name: self._store(t[row:row + 1]) for name, t in embeds.tensors.items()}
                self.encoded += len(chunk)

    def _store(self, row: torch.Tensor) -> torch.Tensor:
        """A compact copy of one row on the storage device (a view would keep the whole batch's storage alive)."""
        row = row.detach()
        return row.to(self.storage_device) if row.device != self.storage_device else row.clone()

    def _evict(self) -> None:
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.evicted += 1

    def precompute(self, prompts: Iterable[str], batch_size: int = 32) -> int:
        """Encode every prompt of ``prompts`` not cached yet, ``batch_size`` at a time; returns how many were
        encoded. Raises when the distinct prompts do not fit ``capacity`` (nothing is encoded then)."""
        keys = list(dict.fromkeys(prompt_cache_key(p) for p in prompts))
        if len(keys) > self.capacity:
            raise ValueError(_capacity_message(len(keys), self.capacity))
        todo = [k for k in keys if k not in self._entries]
        self._encode_into_cache(todo, batch_size)
        self._evict()
        return len(todo)

    # ---- lookup ----------------------------------------------------------------------------------
    def encode_unique(self, prompts: Sequence[str], device: torch.device | str | None = None,
                      conditions: Sequence[Any] | None = None) -> tuple[PromptEmbeds, torch.Tensor]:
        """Embeddings of the distinct prompts of ``prompts`` (first-seen order) and, per sample, its row.

        The contract of ``RolloutEngine.encode_unique``; prompts not in the cache are encoded together (the text
        encoders visit the accelerator once if they are offloaded) and kept.
        """
        device = torch.device(device) if device is not None else self.device
        if conditions is not None and len(conditions) != len(prompts):
            raise ValueError(f"{len(conditions)} conditioning inputs for {len(prompts)} prompts.")
        keys = [prompt_cache_key(p, conditions[i] if conditions is not None else None) for i, p in enumerate(prompts)]
        unique: dict[PromptKey, int] = {}
        rows = [unique.setdefault(k, len(unique)) for k in keys]
        missing = [k for k in unique if k not in self._entries]
        self.misses += len(missing)
        self.hits += len(unique) - len(missing)
        by_key = None
        if conditions is not None:
            by_key = {}
            for key, condition in zip(keys, conditions):
                by_key.setdefault(key, condition)
        self._encode_into_cache(missing, conditions=by_key)
        entries = []
        for key in unique:
            self._entries.move_to_end(key)
            entries.append(self._entries[key])
        embeds = PromptEmbeds({name: t.to(device, non_blocking=True) for name, t in pad_rows_to_longest(entries).items()})
        self._evict()  # after gathering: one call may hold more prompts than the cache
        return embeds, torch.tensor(rows, dtype=torch.long)


def _capacity_message(distinct: int, capacity: int) -> str:
    gb = distinct * 2_732_032 / 1e9
    return (f"precompute_prompt_embeddings: the datasets hold {distinct} distinct prompts but prompt_cache_size="
            f"{capacity}. Raise prompt_cache_size to at least {distinct} (host memory: about {gb:.1f} GB per process "
            f"for SD3/3.5 at 256 T5 tokens in bf16, 2.73 MB a prompt), or set precompute_prompt_embeddings: false "
            "to encode prompts when they are first drawn.")


def dataset_prompts(dataset: Any) -> list[str]:
    """The prompt column of a dataset as the trainer holds it (``IndexedPromptDataset`` or what it wraps)."""
    if dataset is None:
        return []
    data = dataset.data if isinstance(dataset, IndexedPromptDataset) else dataset
    if hasattr(data, "column_names"):
        return [str(p) for p in data[PROMPT_COLUMN]]
    rows = (data[i] for i in range(len(data)))
    return [row if isinstance(row, str) else str(row[PROMPT_COLUMN]) for row in rows]


def check_prompt_cache_capacity(args: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """Fail before any model is loaded when ``precompute_prompt_embeddings`` cannot hold the datasets' prompts."""
    if not (getattr(args, "cache_prompt_embeddings", False) and getattr(args, "precompute_prompt_embeddings", False)):
        return
    distinct = len(set(dataset_prompts(train_dataset)) | set(dataset_prompts(eval_dataset)))
    if distinct > args.prompt_cache_size:
        raise ValueError(_capacity_message(distinct, args.prompt_cache_size))


def setup_prompt_cache(args: Any, adapter: Any, pipeline: Any, device: torch.device, datasets: Sequence[Any] = (),
                       autocast: Callable[[], AbstractContextManager] | None = None) -> PromptEmbeddingCache | None:
    """The trainer's cache from its config: precomputed (``precompute_prompt_embeddings``) over ``datasets`` and
    with the text encoders offloaded (``offload_text_encoders``); ``None`` when ``cache_prompt_embeddings`` is off.

    Called once the pipeline is on ``device`` and the negative prompt is encoded. ``autocast`` is the context the
    rollouts encode in (the accelerator's mixed precision), so precomputed embeddings equal encoded-on-demand ones.
    """
    if not args.cache_prompt_embeddings:
        return None
    offload = None
    if args.offload_text_encoders:
        offload = TextEncoderOffload(text_encoders_of(pipeline), device)
    height, width = args.image_size

    def encode(prompts: list[str], dev: torch.device, conditions: list | None = None) -> PromptEmbeds:
        # conditions: the source images of an editing family, encoded at the run's working size
        return adapter.encode_prompts(prompts, args.max_sequence_length, dev, images=conditions, height=height,
                                      width=width)

    cache = PromptEmbeddingCache(encode, device, capacity=args.prompt_cache_size, offload=offload)
    if args.precompute_prompt_embeddings:
        prompts = [p for dataset in datasets for p in dataset_prompts(dataset)]
        batch = max(1, int(getattr(args, "per_device_eval_batch_size", 0) or 32))
        with autocast() if autocast is not None else nullcontext():
            cache.precompute(prompts, batch_size=batch)
    if offload is not None:
        offload.offload()
    return cache

