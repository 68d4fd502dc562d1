"""The model-FLOP utilisation assumed for step times, and where it comes from.

``est_step_time_s`` = step FLOPs / (MFU x the GPU's peak dense bf16 FLOP/s) + collective bytes / link bandwidth.
MFU is one number for every plan, fitted once to published Flow-GRPO step times (see docs/planning.md for the
settings assumed for each and the fit's error):

* verl-omni, Qwen-Image Flow-GRPO with LoRA on 4x H800: 420 s a step;
* verl-omni, Qwen-Image Flow-GRPO, full fine-tuning on 4x H200: 250 s a step;
* MM-GRPO, SD3.5-M Flow-GRPO-Fast on 1x H800: 58 s a step.
"""

from __future__ import annotations

#: fitted model-FLOP utilisation (docs/planning.md, "Step time")
MFU = 0.35
CALIBRATION_SOURCE = ("fitted to verl-omni Qwen-Image Flow-GRPO (420 s/step LoRA on 4x H800, 250 s/step full on "
                      "4x H200) and MM-GRPO SD3.5-M Fast (58 s on 1x H800); settings assumed in docs/planning.md")
CALIBRATION_ERROR = "not yet fitted: MFU 0.35 is the assumed prior (typical of diffusion-transformer training)"
