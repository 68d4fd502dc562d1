r"""The reference policy of the KL penalty, and its refresh (TRL's ``sync_ref_model``).

Three forms:

* ``"base"`` (LoRA, no refresh): the base transformer, i.e. the trained model with its adapter disabled.
* ``"adapter"`` (LoRA with ``sync_ref_model`` or ``regularizer: gardo``): a second LoRA adapter named ``"ref"``,
  built as a copy of the trained adapter when training starts (so it is the initial policy), and switched in for
  the reference's forward passes. It is refreshed in place and saved in every checkpoint as
  ``reference_policy.safetensors``.
* ``"copy"`` (full fine-tuning): a frozen copy of the transformer.

Refresh with weight alpha (TRL's ``SyncRefModelCallback``): ref <- (1 - alpha) ref + alpha theta, tensor by
tensor. For the frozen copy this is TRL's own ``SyncRefModelCallback.sync_target_model``. For the adapter it mixes
the LoRA factors A and B separately, which is exactly the policy when alpha = 1 (GARDO's reset is such a copy)
and otherwise an approximation of mixing the weights (the product B A is not linear in the pair).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import TrainerCallback

__all__ = ["REFERENCE_ADAPTER", "REFERENCE_WEIGHTS_NAME", "ReferencePolicy", "ReferenceSyncCallback"]

REFERENCE_ADAPTER = "ref"
REFERENCE_WEIGHTS_NAME = "reference_policy.safetensors"


class ReferencePolicy:
    """See the module docstring. ``model``: the trained module (a ``PeftModel`` for LoRA)."""

    def __init__(self, model: torch.nn.Module, is_peft: bool, own_adapter: bool = False,
                 frozen_copy: torch.nn.Module | None = None):
        self.model = model
        self.refreshes = 0
        self._adapter = None
        self.copy = None
        if is_peft and own_adapter:
            from .old_policy import AdapterOldPolicy

            self._adapter = AdapterOldPolicy(model, name=REFERENCE_ADAPTER)
            self.kind = "adapter"
        elif is_peft:
            self.kind = "base"
        else:
            self.copy = frozen_copy if frozen_copy is not None else \
                copy.deepcopy(model).requires_grad_(False).eval()
            self.kind = "copy"

    @property
    def refreshable(self) -> bool:
        return self.kind != "base"

    @contextmanager
    def forward_model(self, model: torch.nn.Module, unwrap=lambda m: m) -> Iterator[torch.nn.Module]:
        """A context giving the module whose forward is the reference (``model``: the trained one, maybe wrapped)."""
        if self.kind == "base":
            with unwrap(model).disable_adapter():
                yield model
        elif self.kind == "adapter":
            with self._adapter.forward_model(model) as ref:
                yield ref
        else:
            yield self.copy

    @torch.no_grad()
    def refresh(self, alpha: float) -> None:
        """ref <- (1 - alpha) ref + alpha policy."""
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha={alpha} must be in (0, 1].")
        if self.kind == "base":
            raise RuntimeError("The reference is the base model (LoRA disabled) and cannot be refreshed; build it with "
                               "own_adapter=True (sync_ref_model or regularizer='gardo').")
        if self.kind == "adapter":
            self._adapter.update(1.0 - alpha)
        else:
            from accelerate.state import AcceleratorState
            from trl.trainer.callbacks import SyncRefModelCallback

            if AcceleratorState._shared_state:  # inside a run: TRL's sync (gathers ZeRO-3 shards when needed)
                SyncRefModelCallback.sync_target_model(self.model, self.copy, alpha)
            else:
                SyncRefModelCallback._sync_target_model(self.model, self.copy, alpha)
        self.refreshes += 1

    def tensors(self) -> dict[str, torch.Tensor]:
        """The reference's own tensors by name (empty for ``"base"``)."""
        if self.kind == "adapter":
            params = dict(self.model.named_parameters())
            return {old: params[old] for _, old in self._adapter.names}
        if self.kind == "copy":
            return dict(self.copy.state_dict())
        return {}

    def save(self, folder: str | os.PathLike) -> None:
        if self.kind == "base":
            return
        from safetensors.torch import save_file

        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().contiguous()
                 for k, v in self.tensors().items()}
        save_file(state, os.path.join(folder, REFERENCE_WEIGHTS_NAME), metadata={"refreshes": str(self.refreshes)})

    @torch.no_grad()
    def load(self, folder: str | os.PathLike) -> bool:
        """Restore from a checkpoint written by `save`; returns False when it has no reference file."""
        path = os.path.join(folder, REFERENCE_WEIGHTS_NAME)
        if self.kind == "base" or not os.path.isfile(path):
            return False
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            saved = {k: f.get_tensor(k) for k in f.keys()}
        own = self.tensors()
        missing = sorted(set(own) - set(saved))
        if missing:
            raise ValueError(f"{path} lacks reference tensors {missing[:3]}...: it was written for another model.")
        for name, tensor in own.items():
            tensor.copy_(saved[name].to(tensor.device, tensor.dtype))
        self.refreshes = int(metadata.get("refreshes", 0))
        return True


class ReferenceSyncCallback(TrainerCallback):
    """``sync_ref_model``: every ``ref_model_sync_steps`` optimizer steps, refresh the reference with weight
    ``ref_model_mixup_alpha`` (TRL's ``SyncRefModelCallback`` schedule and rule; its ``sync_target_model`` does the
    mixing for a frozen copy)."""

    def __init__(self, reference: ReferencePolicy, on_refresh=None):
        self.reference = reference
        self.on_refresh = on_refresh

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.reference.refresh(args.ref_model_mixup_alpha)
            if self.on_refresh is not None:
                self.on_refresh(state.global_step)
