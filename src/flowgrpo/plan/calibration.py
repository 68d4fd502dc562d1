"""The model-FLOP utilisation assumed for step times, and where it comes from.

``est_step_time_s`` = step FLOPs / (MFU x the GPU's peak dense bf16 FLOP/s) + collective bytes / link bandwidth.
MFU is one number for every plan, fitted once to published Flow-GRPO step times (see docs/planning.md for the
settings assumed for each and the fit's error):

* verl-omni, Qwen-Image Flow-GRPO with LoRA on 4x H800: 420 s a step;
* verl-omni, Qwen-Image Flow-GRPO, full fine-tuning on 4x H200: 250 s a step;
* MM-GRPO, SD3.5-M Flow-GRPO-Fast on 1x H800: 58 s a step.
"""

from __future__ import annotations

#: fitted model-FLOP utilisation: the geometric mean of the three points' (scripts/calibrate_plan.py, 2026-11-24)
MFU = 0.29
CALIBRATION_SOURCE = ("scripts/calibrate_plan.py: verl-omni Qwen-Image Flow-GRPO (420 s/step LoRA on 4x H800, 250 s/step "
                      "full on 4x H200; verl-omni.readthedocs.io performance page) and MM-GRPO SD3.5-M Fast (58 s on "
                      "1x H800); unpublished settings assumed as in docs/planning.md")
#: each point's predicted / published - 1 at the fitted MFU
CALIBRATION_ERRORS = {"verl-omni Qwen-Image LoRA 4x H800": 1.42, "verl-omni Qwen-Image full 4x H200": 0.99,
                      "MM-GRPO SD3.5-M Fast 1x H800": -0.82}
CALIBRATION_ERROR = ("+142% / +99% / -82% on the three points: step times are good to a factor of about 2.5 until "
                     "the published runs' sampling and training settings are known")
