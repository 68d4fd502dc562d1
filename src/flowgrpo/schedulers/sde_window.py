"""SDE windows (Flow-GRPO-Fast / MixGRPO): which denoising steps of a rollout are stochastic.

A window is a half-open range of step indices ``[start, end)`` into the scheduler's timesteps. Inside it the
sampler takes SDE steps (whose transitions are stored and trained), outside it plain ODE steps.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

__all__ = ["check_window_range", "sample_sde_window"]


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}.") from None


def check_window_range(window_range: Sequence[int] | None) -> tuple[int, int] | None:
    """Validate a ``[lo, hi)`` range of window starts (``0 <= lo < hi``); ``None`` passes through."""
    if window_range is None:
        return None
    if isinstance(window_range, (str, bytes)) or not isinstance(window_range, Sequence) or len(window_range) != 2:
        raise ValueError(f"sde_window_range={window_range!r} must be two integers [lo, hi) (or None).")
    lo = _as_int(window_range[0], "sde_window_range[0]")
    hi = _as_int(window_range[1], "sde_window_range[1]")
    if lo < 0 or hi <= lo:
        raise ValueError(f"sde_window_range={[lo, hi]} must satisfy 0 <= lo < hi (window starts are drawn from [lo, hi)).")
    return lo, hi


def sample_sde_window(
    num_inference_steps: int,
    window_size: int,
    window_range: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Draw the SDE window ``[start, end)`` of one rollout.

    - ``window_size == 0``: ``(0, num_inference_steps - 1)``, SDE on every step but the last (plain Flow-GRPO;
      the last step is nearly deterministic). Nothing is drawn from the generator.
    - ``window_size = k > 0``: ``start`` uniform on the half-open ``window_range = [lo, hi)``, ``end = start + k``.
      ``window_range=None`` means ``[0, num_inference_steps - k)``, i.e. every window that ends before the last step.
      Windows must end before the last step: ``hi - 1 + k <= num_inference_steps - 1``.

    Args:
        num_inference_steps: number of denoising steps of the rollout (``>= 1``).
        window_size: ``k >= 0``.
        window_range: ``[lo, hi)`` of window starts, or ``None``.
        generator: ``torch.Generator`` to draw ``start`` from (the global RNG when ``None``). Seed it identically
            on every process so that all ranks train the same steps.

    Returns:
        ``(start, end)`` as Python ints.

    Raises:
        ValueError: naming the values, when the arguments are not integers of the right sign or the window
        cannot fit in the schedule.
    """
    steps = _as_int(num_inference_steps, "num_inference_steps")
    k = _as_int(window_size, "window_size")
    if steps < 1:
        raise ValueError(f"num_inference_steps={steps} must be >= 1.")
    if k < 0:
        raise ValueError(f"window_size={k} must be >= 0 (0 = SDE on every step but the last).")
    if k == 0:
        return 0, steps - 1
    if k > steps - 1:
        raise ValueError(
            f"window_size={k} does not fit num_inference_steps={steps}: windows end before the last step, so "
            f"window_size can be at most {steps - 1}."
        )
    if window_range is None:
        lo, hi = 0, steps - k
    else:
        lo, hi = check_window_range(window_range)
        if hi + k > steps:
            raise ValueError(
                f"window_range={[lo, hi]} with window_size={k} does not fit num_inference_steps={steps}: the latest "
                f"window [{hi - 1}, {hi - 1 + k}) must end before the last step {steps - 1}. Use "
                f"0 <= lo < hi <= {steps - k}."
            )
    device = generator.device if generator is not None else torch.device("cpu")
    start = lo + int(torch.randint(hi - lo, (1,), generator=generator, device=device).item())
    return start, start + k
