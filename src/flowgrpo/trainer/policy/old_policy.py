r"""DiffusionNFT's old policy: the weights that sample the rollouts and give v_old in the loss.

After each optimizer step k the old policy moves toward the trained one,

    theta_old <- d(k) theta_old + (1 - d(k)) theta,
    d(k) = 0                                                   for k < start,
    d(k) = min(rate * (k - start), maximum)                    for k >= start,

(`old_policy_decay`, a pure function of the step; published: start 0, rate 0.001, maximum 0.5, and for OCR start 75,
rate 0.0075, maximum 0.999). With d = 0 the old policy is the current one; a larger d makes it a slower average of
the past policies. Before the first step theta_old = theta.

Two ways to hold it:

* `AdapterOldPolicy` (LoRA training): a second peft adapter, named ``"old"``, on the trained ``PeftModel``, with the
  trained adapter's configuration and a copy of its weights. Its forward passes switch the active adapter of every
  LoRA layer for the duration of a ``with`` block (the base weights are shared, so it costs no memory beyond the
  LoRA tensors). It is saved with the model: ``Trainer`` writes it as the peft adapter ``old/`` of each checkpoint
  and loads it back on resume. The exported diffusers LoRA holds only the trained adapter.
* `FrozenCopyOldPolicy` (full fine-tuning): a frozen copy of the transformer, saved in each checkpoint as
  ``old_policy.safetensors``.

The same two forms hold any further named copy a trainer keeps (CRD's sampling copy, `build_old_policy` with another
``name``): the adapter ``<name>``, or the frozen copy saved as ``<name>_policy.safetensors``.

Both update in float32 arithmetic and in place, so that sharded (DTensor) LoRA tensors stay sharded. The pairs of
trained and old tensors are looked up by name when they are used, not kept: FSDP2 replaces a module's parameters by
sharded ones when it wraps the model, after the old policy was built.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

OLD_POLICY_ADAPTER = "old"
OLD_POLICY_WEIGHTS_NAME = "old_policy.safetensors"

__all__ = ["OLD_POLICY_ADAPTER", "OLD_POLICY_WEIGHTS_NAME", "AdapterOldPolicy", "FrozenCopyOldPolicy", "OldPolicy",
           "build_old_policy", "copy_weights_name", "old_adapter_left_out", "old_policy_decay"]


def old_policy_decay(step: int, start: int, rate: float, maximum: float) -> float:
    """d(step) = 0 before ``start``, then ``min(rate * (step - start), maximum)`` (``step``: optimizer steps done)."""
    if step < start:
        return 0.0
    return float(min(rate * (step - start), maximum))


class OldPolicy:
    """The old policy's interface: ``forward_model(model)`` (a context giving the module whose forward is the old
    policy), ``update(decay)``, ``pairs`` (trained parameter, old-policy tensor), ``save`` / ``load``."""

    @property
    def pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(trained tensor, old-policy tensor), as the model holds them now."""
        raise NotImplementedError

    def forward_model(self, model: torch.nn.Module):
        """A context manager that gives the module whose forward is the old policy (``model``: the trained one)."""
        raise NotImplementedError

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """theta_old <- decay * theta_old + (1 - decay) * theta, for every trained tensor."""
        if not 0 <= decay <= 1:
            raise ValueError(f"decay={decay} must be in [0, 1].")
        for theta, old in self.pairs:
            value = theta.detach()
            if hasattr(value, "full_tensor") and not hasattr(old, "full_tensor"):
                value = value.full_tensor()  # a sharded (FSDP2) trained tensor and a whole frozen copy
            if decay == 0:
                old.copy_(value)
            else:
                old.copy_(old.float().mul_(decay).add_(value.float(), alpha=1 - decay))

    def save(self, folder: str | os.PathLike) -> None:
        """Write what ``load`` needs into a checkpoint folder (nothing when the model's own save holds it)."""

    def load(self, folder: str | os.PathLike) -> None:
        """Restore from a checkpoint folder written by ``save`` (and the model's own save)."""


class AdapterOldPolicy(OldPolicy):
    """The old policy as a second LoRA adapter of ``peft_model`` (see the module docstring)."""

    def __init__(self, peft_model: torch.nn.Module, trained_adapter: str = "default",
                 name: str = OLD_POLICY_ADAPTER):
        from peft.tuners.tuners_utils import BaseTunerLayer

        if name in peft_model.peft_config:
            raise ValueError(f"The model already has an adapter named {name!r}; the old policy needs that name.")
        self.trained_adapter, self.name = trained_adapter, name
        config = copy.deepcopy(peft_model.peft_config[trained_adapter])
        config.inference_mode = True
        peft_model.add_adapter(name, config)
        self.model = peft_model
        self.layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]
        params = dict(peft_model.named_parameters())
        trained_tag, old_tag = f".{trained_adapter}.", f".{name}."
        self.names: list[tuple[str, str]] = []
        for key in params:
            if trained_tag not in key:
                continue
            old_key = key.replace(trained_tag, old_tag)
            if old_key not in params:
                raise RuntimeError(f"The old-policy adapter has no tensor for {key!r}.")
            params[old_key].requires_grad_(False)
            self.names.append((key, old_key))
        if not self.names:
            raise RuntimeError(f"No tensors of adapter {trained_adapter!r} found in the model.")
        self.update(0.0)  # start as a copy of the trained adapter

    @property
    def pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        params = dict(self.model.named_parameters())
        return [(params[a], params[b]) for a, b in self.names]

    @contextmanager
    def forward_model(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` (the trained one, possibly wrapped by DDP) with the old adapter active in every LoRA layer; the
        trained adapter and every parameter's ``requires_grad`` are restored when the block ends."""
        with adapter_active(self.layers, self.name):
            yield model


@contextmanager
def adapter_active(layers: list, name: str) -> Iterator[None]:
    """Adapter ``name`` active (in inference mode) in every LoRA layer of ``layers`` for the block; each layer's
    previously active adapters and every parameter's ``requires_grad`` are restored when it ends."""
    flags = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    previous = [list(layer.active_adapters) for layer in layers]
    for layer in layers:
        layer.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        for layer, active in zip(layers, previous):
            layer.set_adapter(active)
        for p, flag in flags:
            p.requires_grad_(flag)


def copy_weights_name(name: str) -> str:
    """The checkpoint file of a frozen copy named ``name`` (``"old"``: ``old_policy.safetensors``)."""
    return f"{name}_policy.safetensors"


class FrozenCopyOldPolicy(OldPolicy):
    """The old policy (or another named copy) as a frozen copy of the fully fine-tuned transformer, saved in each
    checkpoint as ``weights_name``."""

    def __init__(self, module: torch.nn.Module, weights_name: str = OLD_POLICY_WEIGHTS_NAME):
        self.weights_name = weights_name
        self.trained = module
        self.module = copy.deepcopy(module).requires_grad_(False).eval()
        self.names = [k for k, p in module.named_parameters() if p.requires_grad]
        if not self.names:
            raise RuntimeError("The model has no trainable parameters to copy into the old policy.")

    @property
    def pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        trained, copies = dict(self.trained.named_parameters()), dict(self.module.named_parameters())
        return [(trained[k], copies[k]) for k in self.names]

    @contextmanager
    def forward_model(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        yield self.module

    def to(self, device: torch.device | str) -> FrozenCopyOldPolicy:
        self.module.to(device)
        return self

    def save(self, folder: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        state = {k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()}
        save_file(state, os.path.join(folder, self.weights_name))

    def load(self, folder: str | os.PathLike) -> None:
        from safetensors.torch import load_file

        path = os.path.join(folder, self.weights_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{folder} has no {self.weights_name}: it was not written by a "
                                    "run that fine-tunes the whole transformer with an old policy, so its old policy "
                                    "cannot be restored.")
        self.module.load_state_dict(load_file(path, device="cpu"))


def build_old_policy(model: torch.nn.Module, is_peft: bool, name: str = OLD_POLICY_ADAPTER) -> OldPolicy:
    """A second adapter (named ``name``) of a LoRA-trained model, or a frozen copy of a fully fine-tuned one (saved
    as ``<name>_policy.safetensors``)."""
    if is_peft:
        return AdapterOldPolicy(model, name=name)
    return FrozenCopyOldPolicy(model, weights_name=copy_weights_name(name))


@contextmanager
def old_adapter_left_out(peft_model: torch.nn.Module | None,
                         names: tuple[str, ...] = (OLD_POLICY_ADAPTER,)) -> Iterator[None]:
    """Exports write the trained adapter only: peft's own save writes every adapter of ``peft_config``, so the old one
    (and any other copy named in ``names``) is taken out of it for the duration of that save (and only that: the
    diffusers export relies on it being there to leave its tensors out). ``None`` (full fine-tuning): nothing to
    do."""
    configs = getattr(peft_model, "peft_config", None) or {}
    held = {name: configs.pop(name) for name in names if name in configs}
    try:
        yield
    finally:
        configs.update(held)
