"""Where a reward model's weights live: its ``reward_device`` and dtype, and offloading between scorings.

Reward models share the accelerator with the policy. With ``reward_offload: true`` (`RewardSet(offload=True)`), a
reward that supports it keeps its weights on the CPU between scorings: before each call they move to the reward's
device, after it they move back to the CPU (and CUDA's cache is emptied), so the policy has the memory while it
samples and trains. The cost is one host-device copy of the weights per scoring call (446 M parameters, 1.8 GB in
float32, for ImageReward; 986 M, 3.9 GB in float32 or 2.0 GB in bfloat16, for HPS v2.1).

A reward supports offloading when it has both methods of `OffloadableReward`:

* ``to(device=None)``: move the weights to ``device`` (default: the reward's own ``reward_device``); returns the
  reward;
* ``offload()``: move the weights to the CPU (a no-op before the model is loaded).

`ModelReward` is the base of the built-in model rewards (``imagereward``, ``hpsv2``, and through
`flowgrpo.rewards.vlm_models.VLMReward` ``hpsv3``, ``vqascore``, ``deqa``, ``unifiedreward``): lazy loading on the
first call, ``reward_device`` / ``dtype`` options, chunking in ``batch_size`` and a lock per reward (so it can be
called from `RewardSet.submit`'s pool). Rewards without the two methods (OCR, JPEG, remote servers, plain
functions) are called as they are.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["ModelReward", "OffloadableReward", "pick_device", "resolve_device", "resolve_dtype", "scoring_on_device",
           "supports_offload"]


def resolve_device(device: Any) -> Any:
    """``torch.device`` of ``device``; ``None`` is CUDA when available, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: Any, default: Any = "float32") -> Any:
    """``torch.dtype`` of ``dtype`` (a dtype, or a name such as ``"float32"``, ``"bf16"``); ``None`` is ``default``
    (float32 unless given)."""
    import torch

    if dtype is None:
        dtype = default
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}
        value = getattr(torch, aliases.get(name, name), None)
        if isinstance(value, torch.dtype):
            return value
    raise ValueError(f"dtype {dtype!r} is not a torch dtype; use e.g. 'float32', 'float16' or 'bfloat16'")


def pick_device(device: Any, reward_device: Any) -> Any:
    """The one device of the ``device`` / ``reward_device`` pair of options (the same option under two names)."""
    if device is not None and reward_device is not None and str(device) != str(reward_device):
        raise ValueError(f"device={device!r} and reward_device={reward_device!r} disagree; give only one of them")
    return reward_device if reward_device is not None else device


@runtime_checkable
class OffloadableReward(Protocol):
    """A reward whose weights can move between the CPU and its ``reward_device``."""

    def to(self, device: Any = None) -> Any: ...

    def offload(self) -> None: ...


def supports_offload(fn: Any) -> bool:
    """Whether the reward ``fn`` has the `OffloadableReward` methods (callables only; a class is not a reward)."""
    return not isinstance(fn, type) and callable(getattr(fn, "to", None)) and callable(getattr(fn, "offload", None))


@contextlib.contextmanager
def scoring_on_device(fn: Any, enabled: bool) -> Iterator[None]:
    """Around one scoring call: the weights on the reward device inside, back on the CPU after (when ``enabled`` and
    ``fn`` supports it; otherwise nothing happens)."""
    if not (enabled and supports_offload(fn)):
        yield
        return
    fn.to()
    try:
        yield
    finally:
        fn.offload()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def module_device(module: Any) -> Any:
    """The device of a module's first parameter (the CPU for a module without parameters)."""
    import torch

    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class ModelReward:
    """Base of a lazily loaded torch reward model scored in chunks.

    Subclasses implement ``_load(device, dtype)`` (build and load the model, return the ``nn.Module`` that holds
    every weight) and ``_score(prompts, images, **columns)`` (a float tensor of scores, one per pair); this class
    gives the placement (``reward_device``, ``dtype``), the lock, the offloading methods and the float conversion.
    A differentiable subclass (``differentiable = True``) also implements ``_score_tensor(prompts, images,
    **columns)`` on a float tensor of images, with gradient; a call with a tensor goes there, outside inference mode
    (`flowgrpo.rewards.differentiable`).
    A subclass whose ``dtype`` default is not float32 overrides `default_dtype`.

    Args:
        device / reward_device: where the model runs (one name for the same option; default: CUDA when available,
            else the CPU).
        dtype: the model's weights dtype (default `default_dtype`: float32); scores are returned as Python floats.
        batch_size: pairs per forward pass.
    """

    def __init__(self, device: Any = None, dtype: Any = None, batch_size: int = 32, reward_device: Any = None):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device_name = pick_device(device, reward_device)
        self.dtype_name = dtype
        resolve_dtype(dtype)  # a bad dtype fails here, before any weights load
        self.batch_size = int(batch_size)
        self._lock = threading.RLock()
        self._module: Any = None

    # ---- placement ------------------------------------------------------------------------------------

    @property
    def reward_device(self) -> Any:
        """The device the model scores on."""
        return resolve_device(self.device_name)

    def default_dtype(self, device: Any) -> Any:
        """The weights dtype on ``device`` when no ``dtype`` is given: float32."""
        return "float32"

    @property
    def dtype(self) -> Any:
        return resolve_dtype(self.dtype_name, self.default_dtype(self.reward_device))

    def load(self) -> Any:
        """Load (once) and return the model's module, on ``reward_device``."""
        return self._loaded_module()

    def _loaded_module(self) -> Any:
        """The ``nn.Module`` holding every weight, loaded on the first call (what `to` and `offload` move)."""
        with self._lock:
            if self._module is None:
                import torch

                with torch.inference_mode(False):  # normal tensors whoever calls: a differentiable call may follow
                    module = self._load(self.reward_device, self.dtype)
                self._module = module.eval().requires_grad_(False)
            return self._module

    @property
    def loaded(self) -> bool:
        return self._module is not None

    def to(self, device: Any = None) -> ModelReward:
        """Move the weights to ``device`` (default ``reward_device``), loading them first if needed."""
        with self._lock:
            self._loaded_module().to(resolve_device(device) if device is not None else self.reward_device)
        return self

    def offload(self) -> None:
        """Move the weights to the CPU (nothing to do before the first load)."""
        with self._lock:
            if self._module is not None:
                self._module.to("cpu")

    @property
    def current_device(self) -> Any:
        """Where the weights are now (the inputs of a forward pass go there)."""
        return module_device(self._loaded_module())

    # ---- scoring --------------------------------------------------------------------------------------

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        from .differentiable import is_image_tensor

        if is_image_tensor(images):
            return self._call_with_grad(prompts, images, **columns)
        if len(prompts) != len(images):
            name = getattr(self, "__name__", type(self).__name__)
            raise ValueError(f"{name} got {len(prompts)} prompts and {len(images)} images")
        if not images:
            return []
        import torch

        with self._lock:
            # loaded outside inference mode: its weights must stay usable by a later differentiable call
            self._loaded_module()
            with torch.inference_mode():
                scores = self._score(list(prompts), list(images), **columns)
        return [float(s) for s in scores.float().cpu().tolist()]

    def _call_with_grad(self, prompts: Sequence[str], images: Any, **columns: Any) -> Any:
        """The differentiable call (`flowgrpo.rewards.differentiable`): ``images`` a float tensor ``(N, 3, H, W)`` in
        [0, 1]; a float32 tensor ``(N,)`` on the images' device that carries their gradient."""
        from .differentiable import check_image_tensor, check_score_tensor

        name = getattr(self, "__name__", type(self).__name__)
        if not getattr(self, "differentiable", False):
            raise TypeError(f"reward {name!r} is not differentiable: it scores PIL images (a list), not a tensor")
        check_image_tensor(images, len(prompts), name)
        if not len(prompts):
            return images.new_zeros(0, dtype=images.dtype)
        with self._lock:
            self._loaded_module()
            scores = self._score_tensor(list(prompts), images, **columns)
        return check_score_tensor(scores, len(prompts), name).to(images.device)

    def _load(self, device: Any, dtype: Any) -> Any:
        raise NotImplementedError

    def _score(self, prompts: list[str], images: list[Any], **columns: Any) -> Any:
        raise NotImplementedError

    def _score_tensor(self, prompts: list[str], images: Any, **columns: Any) -> Any:
        """The differentiable rewards' ``_score`` on a float tensor ``(N, 3, H, W)`` in [0, 1], with gradient."""
        raise NotImplementedError

    def chunks(self, n: int) -> Iterator[slice]:
        """Slices of ``range(n)`` of at most ``batch_size`` items."""
        for start in range(0, n, self.batch_size):
            yield slice(start, min(n, start + self.batch_size))
