"""SDE windows (Flow-GRPO-Fast / MixGRPO): which denoising steps of a rollout are stochastic.

A window is a half-open range of step indices ``[start, end)`` into the scheduler's timesteps. Inside it the
sampler takes SDE steps (whose transitions are stored and trained), outside it plain ODE steps.

Where the window of a training rollout starts is a schedule over optimizer steps (`scheduled_sde_window`):

- ``"random"`` (Flow-GRPO-Fast): drawn uniformly from the range of starts by `sample_sde_window`;
- ``"progressive"`` (MixGRPO): at 0-based optimizer step ``k`` the start is
  ``lo + (k // shift_interval) * stride`` over the valid starts ``lo .. hi``; past ``hi`` it wraps to ``lo``
  (``roll_back``) or stays at ``hi`` (`progressive_window_start`);
- ``"fixed"``: always ``lo``.

The progressive and fixed schedules depend on ``k`` alone, so a resumed run continues them exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .dpm_solver import compress_sigmas

__all__ = [
    "SDE_WINDOW_STRATEGIES",
    "check_window_range",
    "RolloutStep",
    "progressive_window_start",
    "rollout_steps",
    "sample_sde_window",
    "scheduled_sde_window",
    "valid_window_starts",
]

SDE_WINDOW_STRATEGIES = ("random", "progressive", "fixed")


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


def valid_window_starts(num_inference_steps: int, window_size: int,
                        window_range: Sequence[int] | None = None) -> tuple[int, int]:
    """The first and the last valid window start, ``(lo, hi)`` inclusive.

    From the half-open ``window_range = [lo, hi + 1)`` when given, else ``0 .. num_inference_steps - window_size - 1``
    (every window that ends before the last step). Checks that the latest window fits.
    """
    steps = _as_int(num_inference_steps, "num_inference_steps")
    k = _as_int(window_size, "window_size")
    if k < 1:
        raise ValueError(f"window_size={k}: a scheduled window needs window_size >= 1.")
    if k > steps - 1:
        raise ValueError(f"window_size={k} does not fit num_inference_steps={steps}: windows end before the last "
                         f"step, so window_size can be at most {steps - 1}.")
    if window_range is None:
        return 0, steps - k - 1
    lo, hi = check_window_range(window_range)
    if hi + k > steps:
        raise ValueError(
            f"window_range={[lo, hi]} with window_size={k} does not fit num_inference_steps={steps}: the latest "
            f"window [{hi - 1}, {hi - 1 + k}) must end before the last step {steps - 1}. Use 0 <= lo < hi <= "
            f"{steps - k}."
        )
    return lo, hi - 1


def progressive_window_start(step: int, first: int, last: int, shift_interval: int = 25, stride: int = 1,
                             roll_back: bool = True) -> int:
    """MixGRPO's sliding window: the start at 0-based optimizer step ``step``.

    ``start = first + (step // shift_interval) * stride``; once that passes ``last`` it wraps around to ``first``
    and moves on again (``roll_back=True``: ``first + (m mod ceil((last - first + 1) / stride)) * stride`` with
    ``m = step // shift_interval``), or stays at ``last`` (``roll_back=False``).
    """
    step = _as_int(step, "step")
    first, last = _as_int(first, "first"), _as_int(last, "last")
    shift_interval, stride = _as_int(shift_interval, "shift_interval"), _as_int(stride, "stride")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0 (the 0-based optimizer step).")
    if shift_interval < 1 or stride < 1:
        raise ValueError(f"shift_interval={shift_interval} and stride={stride} must both be >= 1.")
    if last < first:
        raise ValueError(f"the valid starts {first} .. {last} are empty.")
    moves = step // shift_interval
    if roll_back:
        positions = -(-(last - first + 1) // stride)  # ceil: starts first, first + stride, ... <= last
        return first + (moves % positions) * stride
    return min(first + moves * stride, last)


def scheduled_sde_window(
    strategy: str,
    step: int,
    num_inference_steps: int,
    window_size: int,
    window_range: Sequence[int] | None = None,
    shift_interval: int = 25,
    stride: int = 1,
    roll_back: bool = True,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """The SDE window ``[start, end)`` of the rollout sampled at 0-based optimizer step ``step``.

    ``window_size == 0`` (SDE on every step but the last) gives ``(0, num_inference_steps - 1)`` for every
    strategy. Otherwise ``"random"`` draws the start from ``generator`` exactly as `sample_sde_window` does
    (``step`` is not used), ``"progressive"`` follows `progressive_window_start` over `valid_window_starts`, and
    ``"fixed"`` takes the first valid start. Only ``"random"`` touches ``generator``.
    """
    if strategy not in SDE_WINDOW_STRATEGIES:
        raise ValueError(f"sde_window_strategy={strategy!r} is not valid; choose one of "
                         f"{', '.join(map(repr, SDE_WINDOW_STRATEGIES))}.")
    k = _as_int(window_size, "window_size")
    if strategy == "random" or k == 0:
        return sample_sde_window(num_inference_steps, k, window_range, generator=generator)
    first, last = valid_window_starts(num_inference_steps, k, window_range)
    if strategy == "fixed":
        start = first
    else:
        start = progressive_window_start(step, first, last, shift_interval, stride, roll_back)
    return start, start + k


@dataclass
class RolloutStep:
    """One step of a rollout: from ``sigma`` to ``sigma_next`` at the model timestep ``timestep`` (0-d tensors).

    ``index`` is the step's index in the scheduler's schedule, ``None`` for a step of a compressed stretch;
    ``stochastic`` marks the SDE window's steps; ``final`` the trajectory's last step.
    """

    sigma: torch.Tensor
    sigma_next: torch.Tensor
    timestep: torch.Tensor
    index: int | None
    stochastic: bool
    final: bool


def rollout_steps(
    sigmas: torch.Tensor,
    timesteps: torch.Tensor,
    window: tuple[int, int],
    compression_ratio: float = 1.0,
    num_train_timesteps: int = 1000,
) -> list[RolloutStep]:
    """The steps of one rollout over the schedule ``sigmas`` (``n + 1`` levels) with SDE window ``[start, end)``.

    Steps ``0 .. end - 1`` are the schedule's own (those in the window are stochastic). The ``n - end`` steps after
    the window are replaced by ``max(1, int((n - end) * compression_ratio))`` steps over the same noise range
    (`compress_sigmas`; their timesteps are ``sigma * num_train_timesteps``, the flow-matching convention) when
    ``compression_ratio < 1``; with 1 they are the schedule's own steps.
    """
    n = len(timesteps)
    if sigmas.numel() != n + 1:
        raise ValueError(f"{n} timesteps need {n + 1} noise levels, got {sigmas.numel()}.")
    start, end = (_as_int(v, "window") for v in window)
    if not 0 <= start <= end <= n:
        raise ValueError(f"window [{start}, {end}) does not fit a schedule of {n} steps.")
    steps = [RolloutStep(sigmas[i], sigmas[i + 1], timesteps[i], i, start <= i < end, i == n - 1)
             for i in range(n)]
    if compression_ratio >= 1 or end >= n:
        return steps
    tail = compress_sigmas(sigmas[end:].detach().cpu(), compression_ratio)
    if len(tail) == n - end + 1:
        return steps
    levels = torch.tensor(tail, dtype=sigmas.dtype, device=sigmas.device)
    ts = (levels * num_train_timesteps).to(timesteps.dtype)
    compressed = [RolloutStep(levels[k], levels[k + 1], ts[k], None, False, k == len(tail) - 2)
                  for k in range(len(tail) - 1)]
    return steps[:end] + compressed
