"""Exponential moving average of the trainable weights.

    ema <- d * ema + (1 - d) * theta     (every ``update_interval`` optimizer steps; d = decay, or with ``warmup``
                                           d = min((1 + step) / (10 + step), decay), Flow-GRPO's EMA)

The warm-up lets the first updates move the average quickly (d = 0.18 at step 1, 0.5 at step 8), so that an early
evaluation does not see mostly the initial weights.

Kept in float32 on the parameters' device. ``swapped_in(params)`` temporarily loads the EMA weights into the
model (evaluation, export) and restores the live weights afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["EMA_STATE_NAME", "EMAWeights"]

#: the EMA's state in every save (checkpoints and the final output folder)
EMA_STATE_NAME = "ema_state.pt"


class EMAWeights:
    def __init__(self, parameters: list[torch.nn.Parameter], decay: float = 0.9, update_interval: int = 1,
                 warmup: bool = False):
        self.decay = decay
        self.warmup = bool(warmup)
        self.update_interval = max(1, int(update_interval))
        self.shadow = [p.detach().float().clone() for p in parameters]
        self.num_updates = 0

    @torch.no_grad()
    def update(self, parameters: list[torch.nn.Parameter], step: int) -> None:
        if step % self.update_interval:
            return
        decay = self.current_decay(step)
        for s, p in zip(self.shadow, parameters):
            s.mul_(decay).add_(p.detach().float(), alpha=1 - decay)
        self.num_updates += 1

    def current_decay(self, step: int) -> float:
        """The decay of an update at optimizer step ``step``."""
        return min((1 + step) / (10 + step), self.decay) if self.warmup else self.decay

    @contextmanager
    def swapped_in(self, parameters: list[torch.nn.Parameter]):
        backup = [p.detach().clone() for p in parameters]
        with torch.no_grad():
            for s, p in zip(self.shadow, parameters):
                p.copy_(s.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, parameters):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "update_interval": self.update_interval, "num_updates": self.num_updates,
                "warmup": self.warmup,
                "shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"EMA state has {len(state['shadow'])} tensors, the model {len(self.shadow)} trainable "
                             "ones: was it saved with another LoRA configuration?")
        self.decay = state["decay"]
        self.update_interval = state["update_interval"]
        self.warmup = bool(state.get("warmup", False))
        self.num_updates = state["num_updates"]
        self.shadow = [s.to(d.device) for s, d in zip(state["shadow"], self.shadow)]
