"""``torch_compile``: the transformer's repeated blocks compiled once, so that rollouts, evaluation and training run the
same compiled code.

Regional compilation: each block (the class names of the model's ``_repeated_blocks``, through diffusers'
``ModelMixin.compile_repeated_blocks``; a model without them, SD3, by its ``_no_split_modules``) gets
``module.compile(backend, mode, dynamic=True)``. Blocks of one class share their compiled graphs; the code around
them (embeddings, the final projection) stays eager. The compiled grad path's forward equals the compiled no-grad
path's exactly, while eager and compiled differ by about 1e-6 (DESIGN.md, section 13): the first pass's ratio is 1
only if the rollout's log-probs and the training forward come from the same compiled blocks. So nothing else compiles
the model: the trainer turns ``Trainer``'s own whole-model ``torch.compile`` off (it keeps ``torch_compile`` as the
switch), and every copy of the policy that samples or is replayed (the frozen copies of full fine-tuning, the
reference copy) is compiled the same way.

Shapes are dynamic (``dynamic=True``): the rollout micro-batch, the evaluation batch and a training batch of several
timesteps share one graph per block class and grad mode; a dimension of size 0 or 1 is specialised, as torch does.
A new graph is still compiled for each grad mode, each set of active LoRA adapters (the old policy's, the
reference's adapter switched off) and each new block class. The recompile limit is raised so that these variants are
all compiled (torch's default of 8 per code object counts every block class and variant together), and reaching it
raises instead of quietly falling back to eager code, which would break the ratio.

`CompileWatch` times every compilation (Dynamo's, and the backward graphs compiled lazily at the first backward) with
torch's compile callbacks: the trainer logs the seconds up to its first optimizer step once as ``timing/compile_s``,
and, at every log, ``compile/graphs`` (graphs compiled so far) and ``compile/recompiles`` (graphs compiled after the
first optimizer step: steady training should add none).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

__all__ = ["COMPILE_RECOMPILE_LIMIT", "CompileWatch", "block_class_names", "compile_blocks"]

logger = logging.getLogger(__name__)

#: Dynamo's recompile limit while blocks are compiled (per code object: all block classes and their variants count
#: together)
COMPILE_RECOMPILE_LIMIT = 64


def block_class_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The class names of ``model``'s repeated blocks: ``_repeated_blocks``, else ``_no_split_modules``."""
    return tuple(getattr(model, "_repeated_blocks", None) or getattr(model, "_no_split_modules", None) or ())


def compile_blocks(model: torch.nn.Module, *, backend: str | None = "inductor", mode: str | None = None) -> int:
    """Compile every block of ``model`` (a diffusers transformer, possibly holding LoRA layers) in place; returns the
    number of blocks compiled. Raises when the model names no block classes, or none of them is in it."""
    import torch._dynamo

    names = block_class_names(model)
    if not names:
        raise ValueError(f"torch_compile: {type(model).__name__} names no repeated blocks (_repeated_blocks or "
                         "_no_split_modules), so there is nothing to compile region by region; set torch_compile: "
                         "false.")
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, COMPILE_RECOMPILE_LIMIT)
    config.fail_on_recompile_limit_hit = True
    kwargs = {"backend": backend or "inductor", "mode": mode, "dynamic": True}
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"torch_compile: none of {list(names)} is a module of {type(model).__name__}; nothing to "
                         "compile. Set torch_compile: false.")
    if getattr(model, "_repeated_blocks", None) and hasattr(model, "compile_repeated_blocks"):
        model.compile_repeated_blocks(**kwargs)
    else:
        for block in blocks:
            block.compile(**kwargs)
    return len(blocks)


class CompileWatch:
    """Seconds spent compiling and graphs compiled in this process, from torch's compile callbacks (Dynamo's frame
    compilations and the lazy backward compilations); `mark_warm` ends the warm-up (compilations after it count as
    recompilations); `close` unregisters."""

    def __init__(self) -> None:
        from torch._dynamo.callback import callback_handler

        self._handler = callback_handler
        self._lock = threading.Lock()
        self._started: float | None = None
        self.seconds = 0.0
        self.graphs = 0
        self.backward_graphs = 0
        self.recompiles = 0
        self._warm = False
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)

    def _on_start(self, args: Any) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _on_end(self, args: Any) -> None:
        with self._lock:
            if self._started is not None:
                self.seconds += time.perf_counter() - self._started
                self._started = None
            trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
            if trigger == "LAZY_BACKWARD":
                self.backward_graphs += 1
            else:
                self.graphs += 1
                if self._warm:
                    self.recompiles += 1
                    logger.warning("torch_compile: a graph was compiled after the first optimizer step (compile %s, "
                                   "%d so far): a new shape or mode reached the compiled blocks. Set "
                                   "TORCH_LOGS=recompiles to see the guard that failed.",
                                   getattr(args, "compile_id", "?"), self.recompiles)

    def mark_warm(self) -> None:
        """The warm-up (the first optimizer step: rollouts, evaluation before it, training) is over."""
        self._warm = True

    def close(self) -> None:
        for remove, callback in ((self._handler.remove_start_callback, self._on_start),
                                 (self._handler.remove_end_callback, self._on_end)):
            try:
                remove(callback)
            except ValueError:
                pass

