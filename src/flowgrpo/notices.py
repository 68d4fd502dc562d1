"""Log filters for library notices that concern features no flowgrpo run uses.

Installed when ``flowgrpo`` is imported, before any of its modules imports transformers, diffusers, peft,
bitsandbytes or DeepSpeed, so that a newcomer's first run (``make demo``, the README's notebook example, a script)
shows the run, not these lines. Each filter drops one message of one logger; every other message of those loggers
still shows:

* transformers: an image processor "requires torchvision (not installed); falling back to" its PIL version.
  diffusers' SD3 / FLUX modules name those processors (for IP-adapters); the PIL version is what a run here wants.
* bitsandbytes: "Failed to load CPU gemm_4bit_forward from kernels-community" (with "No module named 'kernels'"
  without the ``kernels`` package, or a Hub error offline), and the ``kernels`` package's "Skipping publisher trust
  check for 'kernels-community/quantization-bitsandbytes'" offline. When bitsandbytes is installed, diffusers'
  quantizers and peft import it whatever the run; at import it tries to load an optional kernel that speeds up 4-bit
  matrix products on CPUs, and 4-bit models are trained here on GPUs only (``recipes/sd35m_24gb.yaml``).
* diffusers: "There are modules in ... that should be kept in float32: []" when a model is cast with ``.to(dtype)``
  (the planner casts models built from configs): the list is empty, so nothing is kept in float32 and nothing is
  inconsistent. The notice with a non-empty list still shows.
* DeepSpeed: "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." When
  DeepSpeed is installed, accelerate imports it to unwrap any model (``Trainer.__init__``, every ``save_pretrained``),
  DeepSpeed or not; a CPU run knows it has no GPU.

The run's own notices are fixed where they arise instead: the trainers turn ``dataloader_pin_memory`` off on a CPU
(pinned memory needs an accelerator; torch warns and ignores it).
"""

from __future__ import annotations

import logging

__all__ = ["QUIET_NOTICES", "NoticeFilter", "quiet_library_notices"]

#: logger name -> the text that marks the dropped notice
QUIET_NOTICES = {
    "transformers.utils.import_utils": "requires torchvision (not installed); falling back to",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
    "kernels._internals.hf_hub": "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'",
    "diffusers.models.modeling_utils": "that should be kept in float32: []. Casting directly",
    "DeepSpeed": "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it",
}


class NoticeFilter(logging.Filter):
    """Drops the records whose message contains ``marker``."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker

    def filter(self, record: logging.LogRecord) -> bool:
        return self.marker not in record.getMessage()


def quiet_library_notices() -> None:
    """Install a :class:`NoticeFilter` for each of :data:`QUIET_NOTICES` (once per process)."""
    for name, marker in QUIET_NOTICES.items():
        target = logging.getLogger(name)
        if not any(isinstance(f, NoticeFilter) and f.marker == marker for f in target.filters):
            target.addFilter(NoticeFilter(marker))
