"""TrainGuidanceArguments: the CFG scale of the trained velocity, separate from the rollouts' (AWM, Diffusion-DPO).

AWM and the flow-matching Diffusion-DPO references sample with one guidance scale and train another: AWM's official
code trains the conditional velocity alone whatever its sampling scale (``config/base_awm.py``: ``train.cfg =
False``, never set by ``config/dgx_awm.py``), and flow_grpo's DPO samples at CFG 4.5 (``config/dpo.py``) while its
loss calls the transformer on the prompt embeddings only (``scripts/train_sd3_dpo.py``). Neither loss needs the
sampling policy's velocity: AWM keeps only each rollout's clean sample and DPO only each pair's clean samples, so the
trained, reference and EMA-adapter velocities may use a scale of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["TrainGuidanceArguments"]


@dataclass
class TrainGuidanceArguments:
    train_guidance_scale: float | None = field(
        default=1.0,
        metadata={"help": "CFG scale of the trained velocity and of the velocities it is compared with (the reference; "
                          "AWM's old policy and EMA adapter); the rollouts use guidance_scale. Default 1.0: the "
                          "conditional velocity alone, one forward per pass, as the references train (AWM's official "
                          "train.cfg = False; flow_grpo's DPO samples at CFG 4.5 and trains without CFG). Z-Image "
                          "guides at any scale above 0: use 0.0 there for the conditional velocity. null: the rollouts' "
                          "guidance_scale (two forwards per pass when it guides)."},
    )

    def _check_train_guidance(self) -> None:
        value = self.train_guidance_scale
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"train_guidance_scale={value!r} must be a finite number >= 0 (1.0: the conditional "
                             "velocity alone, as the references train), or null to train at guidance_scale.")
        self.train_guidance_scale = float(value)

    def eval_guidance_rollouts_refusal(self) -> str | None:
        """``rollouts_at_eval_guidance`` is allowed: the loss reads only the rollouts' clean samples, and the trained
        velocity keeps ``train_guidance_scale``."""
        return None

    @property
    def training_guidance_scale(self) -> float:
        """The CFG scale the loss's velocities use: ``train_guidance_scale``, or ``guidance_scale`` when it is null."""
        scale = self.train_guidance_scale
        return float(self.guidance_scale if scale is None else scale)
