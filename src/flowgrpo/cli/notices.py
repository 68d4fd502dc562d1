"""Log filters for the launch script: library notices that concern features no flowgrpo run uses.

Installed by ``flowgrpo.cli`` when it is imported (before transformers, peft or bitsandbytes are), so that a
newcomer's first ``make demo`` shows the run, not these lines:

* transformers: an image processor "requires torchvision (not installed); falling back to" its PIL version.
  diffusers' SD3 / FLUX modules name those processors (for IP-adapters); the PIL version is what a run here wants.
* bitsandbytes: "Failed to load CPU gemm_4bit_forward from kernels-community". The optional ``kernels`` package
  speeds up 4-bit matrix products on CPUs; 4-bit models are trained here on GPUs only (``recipes/sd35m_24gb.yaml``).
* diffusers: "There are modules in ... that should be kept in float32: []" when a model is cast with ``.to(dtype)``
  (the planner casts models built from configs): the list is empty, so nothing is kept in float32 and nothing is
  inconsistent. The notice with a non-empty list still shows.
* DeepSpeed: "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." It is
  imported (through accelerate and transformers) by every run, DeepSpeed or not; a CPU run knows it has no GPU.

Every other message of those loggers still shows.
"""

from __future__ import annotations

import logging

__all__ = ["QUIET_NOTICES", "NoticeFilter", "quiet_library_notices"]

#: logger name -> the text that marks the dropped notice
QUIET_NOTICES = {
    "transformers.utils.import_utils": "requires torchvision (not installed); falling back to",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
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
