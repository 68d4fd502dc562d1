"""`FlowMatchSDEScheduler`: diffusers' flow-matching Euler scheduler with SDE / CPS steps inside an SDE window.

Drop it into any stock flow-matching pipeline (SD3, FLUX, ...)::

    pipe.scheduler = FlowMatchSDEScheduler.from_config(pipe.scheduler.config, noise_level=0.7)

and sampling becomes stochastic with the step math of `flowgrpo.schedulers.sde_step` (see there for the
formulas). With ``noise_level=0`` it is exactly the stock scheduler.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Literal

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import register_to_config

# Pipelines saved with this scheduler record this module in model_index.json; diffusers' loader then looks the
# loadable base classes up by name in this module's namespace, so SchedulerMixin must be importable from here.
from diffusers.schedulers.scheduling_utils import SchedulerMixin  # noqa: F401

from .sde_step import (
    FlowMatchSDESchedulerOutput,
    check_cps_log_prob,
    check_noise_level,
    check_reduction,
    check_sde_type,
    compute_dtype_for,
    flow_step,
)
from .sde_window import check_window_range, sample_sde_window

__all__ = ["FlowMatchSDEScheduler", "FlowMatchSDESchedulerOutput"]


class FlowMatchSDEScheduler(FlowMatchEulerDiscreteScheduler):
    r"""Flow-matching Euler scheduler whose steps inside an *SDE window* are stochastic, with exact log-probs.

    Step ``i`` goes from ``sigma = sigmas[i]`` to ``sigma' = sigmas[i + 1]`` (``dt = sigma' - sigma``,
    ``v = model_output``, ``a = noise_level``):

    - inside the window, ``sde_type="sde"`` (Flow-GRPO):
      ``sigma_t = a sqrt(sigma / (1 - sigma))`` (at ``sigma == 1`` the denominator uses ``sigmas[1]``),
      ``mean = x (1 + sigma_t^2 dt / (2 sigma)) + v (1 + sigma_t^2 (1 - sigma) / (2 sigma)) dt``,
      ``std = sigma_t sqrt(-dt)``;
    - inside the window, ``sde_type="cps"`` (coefficients-preserving sampling):
      ``std = sigma' sin(a pi / 2)``,
      ``mean = (1 - sigma') (x - sigma v) + sqrt(sigma'^2 - std^2) (x + (1 - sigma) v)``;
    - inside the window, ``sde_type="dance"`` (DanceGRPO's ``flux_step``, ``a`` its ``eta``):
      ``std = a sqrt(sigma - sigma')``, ``mean = x + dt (v - a^2 / 2 score)`` with
      ``score = -(x - (x - sigma v)(1 - sigma)) / sigma^2``;
    - outside the window, or with ``noise_level = 0``: the stock Euler (ODE) step ``x' = x + v dt``, computed by
      the parent class, so ``noise_level=0`` is bit-identical to ``FlowMatchEulerDiscreteScheduler``.

    ``x' = mean + std z`` with ``z ~ N(0, I)``; ``log_prob`` is the exact Gaussian log-density of ``x'`` per
    element, reduced over the non-batch dimensions by ``log_prob_reduction``.

    The window ``[start, end)`` (indices into ``timesteps``) is chosen at every `set_timesteps`: fixed with
    `set_sde_window`, otherwise drawn by `sample_sde_window` (``sde_window_size = 0``: every step but the last;
    ``k > 0``: ``k`` consecutive steps starting uniformly in ``sde_window_range``) from the generator given to
    `set_sde_generator` (the global RNG when none).

    Args:
        noise_level (`float`, defaults to 0.7): ``a``; 0 makes every step an ODE step. At most 1 for ``"cps"``.
        sde_type (`str`, defaults to ``"sde"``): ``"sde"``, ``"cps"`` or ``"dance"``.
        sde_window_size (`int`, defaults to 0): SDE steps per rollout; 0 = every step but the last.
        sde_window_range (`[lo, hi)`, *optional*): range of window starts; ``None`` means
            ``[0, num_inference_steps - sde_window_size)``.
        log_prob_reduction (`str`, defaults to ``"mean"``): ``"mean"`` or ``"sum"`` over non-batch dimensions.
        cps_log_prob (`str`, defaults to ``"exact"``): ``"exact"`` Gaussian log-density, or ``"reference"`` for the
            reference implementation's constant-free ``-(x' - mean)^2`` CPS log-prob (only to reproduce its numbers).

    The remaining arguments are those of `FlowMatchEulerDiscreteScheduler`.
    """

    _compatibles = ["FlowMatchEulerDiscreteScheduler"]
    order = 1

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        shift: float = 1.0,
        use_dynamic_shifting: bool = False,
        base_shift: float | None = 0.5,
        max_shift: float | None = 1.15,
        base_image_seq_len: int = 256,
        max_image_seq_len: int = 4096,
        invert_sigmas: bool = False,
        shift_terminal: float | None = None,
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        time_shift_type: Literal["exponential", "linear"] = "exponential",
        stochastic_sampling: bool = False,
        noise_level: float = 0.7,
        sde_type: Literal["sde", "cps", "dance"] = "sde",
        sde_window_size: int = 0,
        sde_window_range: Sequence[int] | None = None,
        log_prob_reduction: Literal["mean", "sum"] = "mean",
        cps_log_prob: Literal["exact", "reference"] = "exact",
    ):
        super().__init__(
            num_train_timesteps=num_train_timesteps,
            shift=shift,
            use_dynamic_shifting=use_dynamic_shifting,
            base_shift=base_shift,
            max_shift=max_shift,
            base_image_seq_len=base_image_seq_len,
            max_image_seq_len=max_image_seq_len,
            invert_sigmas=invert_sigmas,
            shift_terminal=shift_terminal,
            use_karras_sigmas=use_karras_sigmas,
            use_exponential_sigmas=use_exponential_sigmas,
            use_beta_sigmas=use_beta_sigmas,
            time_shift_type=time_shift_type,
            stochastic_sampling=stochastic_sampling,
        )
        check_sde_type(sde_type)
        check_noise_level(noise_level, sde_type)
        check_reduction(log_prob_reduction)
        check_cps_log_prob(cps_log_prob)
        try:
            window_size = -1 if isinstance(sde_window_size, bool) else operator.index(sde_window_size)
        except TypeError:
            window_size = -1
        if window_size < 0:
            raise ValueError(f"sde_window_size={sde_window_size!r} must be an integer >= 0 (0 = every step but the last).")
        window_range = check_window_range(sde_window_range)
        if window_range is not None:
            # Stored as a list so that the config round-trips through JSON unchanged.
            self.register_to_config(sde_window_range=list(window_range))
        if noise_level > 0 and stochastic_sampling:
            raise ValueError(
                "stochastic_sampling=True (diffusers' own re-noising sampler) cannot be combined with SDE steps "
                f"(noise_level={noise_level}); set stochastic_sampling=False or noise_level=0."
            )

        self._sde_generator: torch.Generator | list[torch.Generator] | None = None
        self._fixed_sde_window: tuple[int, int] | None = None
        self._sde_window: tuple[int, int] | None = None

    # ------------------------------------------------------------------------------------------------------------
    # SDE window and randomness
    # ------------------------------------------------------------------------------------------------------------

    @property
    def sde_window(self) -> tuple[int, int] | None:
        """The current SDE window ``[start, end)`` (indices into ``timesteps``); ``None`` before `set_timesteps`."""
        return self._sde_window

    def set_sde_generator(self, generator: torch.Generator | list[torch.Generator] | None) -> None:
        """Generator(s) for the SDE noise of `step` (when `step` gets none) and for drawing windows.

        Stock pipelines call ``scheduler.step`` without a generator; set one here to make their SDE noise
        reproducible. A list (one per sample) is used for the noise, its first generator for window draws.
        ``None`` goes back to the global RNG.
        """
        self._sde_generator = generator

    def set_sde_window(self, start: int | None, end: int | None = None) -> None:
        """Fix the SDE window to steps ``[start, end)`` for every following `set_timesteps` (``None`` unfixes it).

        With the window unfixed, each `set_timesteps` draws a new one from the config. ``0 <= start <= end``;
        ``end`` must not exceed the number of steps (checked at `set_timesteps`, and here when the timesteps are
        already set). A window that includes the last step is allowed here.
        """
        if start is None:
            if end is not None:
                raise ValueError(f"set_sde_window(None, {end!r}): pass both start and end, or None to unfix the window.")
            self._fixed_sde_window = None
            return
        if end is None:
            raise ValueError(f"set_sde_window({start!r}) needs an end: the window is the half-open range [start, end).")
        try:
            window = (operator.index(start), operator.index(end))
        except TypeError:
            raise ValueError(f"SDE window [{start!r}, {end!r}) must be two integers.") from None
        if not 0 <= window[0] <= window[1]:
            raise ValueError(f"SDE window [{start}, {end}) must satisfy 0 <= start <= end.")
        previous, self._fixed_sde_window = self._fixed_sde_window, window
        if getattr(self, "num_inference_steps", None) is not None:
            try:
                self._sde_window = self._resolve_window(len(self.timesteps))
            except ValueError:
                self._fixed_sde_window = previous
                raise

    def _window_generator(self) -> torch.Generator | None:
        gen = self._sde_generator
        return gen[0] if isinstance(gen, (list, tuple)) else gen

    def _resolve_window(self, num_steps: int) -> tuple[int, int]:
        if self._fixed_sde_window is not None:
            start, end = self._fixed_sde_window
            if end > num_steps:
                raise ValueError(
                    f"The fixed SDE window [{start}, {end}) does not fit the {num_steps}-step schedule; use "
                    f"end <= {num_steps} or call set_sde_window(None)."
                )
            return start, end
        if self.config.noise_level == 0:
            return 0, num_steps - 1  # no SDE steps at all; nothing is drawn
        return sample_sde_window(
            num_steps, self.config.sde_window_size, self.config.sde_window_range, generator=self._window_generator()
        )

    def is_sde_step(self, step_index: int) -> bool:
        """Whether step ``step_index`` (index into ``timesteps``) is stochastic with the current window."""
        if self.config.noise_level == 0 or self._sde_window is None:
            return False
        start, end = self._sde_window
        return start <= step_index < end

    # ------------------------------------------------------------------------------------------------------------
    # diffusers scheduler interface
    # ------------------------------------------------------------------------------------------------------------

    def set_timesteps(
        self,
        num_inference_steps: int | None = None,
        device: str | torch.device | None = None,
        sigmas: list[float] | None = None,
        mu: float | None = None,
        timesteps: list[float] | None = None,
    ):
        """Set the timesteps like `FlowMatchEulerDiscreteScheduler.set_timesteps`, then choose the SDE window."""
        super().set_timesteps(
            num_inference_steps=num_inference_steps, device=device, sigmas=sigmas, mu=mu, timesteps=timesteps
        )
        self._sde_window = self._resolve_window(len(self.timesteps))

    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        per_token_timesteps: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> FlowMatchSDESchedulerOutput | tuple:
        """One denoising step: SDE/CPS inside the SDE window, the stock Euler step outside it.

        Arguments as in `FlowMatchEulerDiscreteScheduler.step`; ``generator`` (one, or one per sample) overrides
        the one set with `set_sde_generator` for the SDE noise.

        Returns:
            `FlowMatchSDESchedulerOutput` ``(prev_sample, log_prob, prev_sample_mean, std)``, or with
            ``return_dict=False`` the tuple of those four in that order (element 0 is ``prev_sample``, as in
            diffusers). ``prev_sample`` has the model output's dtype, as in diffusers; ``log_prob`` and ``std`` have
            shape ``(batch,)`` and are zero on ODE steps.
        """
        if isinstance(timestep, int) or (
            isinstance(timestep, torch.Tensor) and not torch.is_floating_point(timestep)
        ):
            raise ValueError(
                "Passing integer indices (e.g. from `enumerate(timesteps)`) as timesteps to "
                f"`{type(self).__name__}.step()` is not supported. Make sure to pass one of the `scheduler.timesteps` "
                "as a timestep."
            )
        if self.step_index is None:
            self._init_step_index(timestep)
        index = self.step_index
        batch = sample.shape[0] if sample.ndim > 0 else 1

        if not self.is_sde_step(index):
            prev_sample = super().step(
                model_output,
                timestep,
                sample,
                s_churn=s_churn,
                s_tmin=s_tmin,
                s_tmax=s_tmax,
                s_noise=s_noise,
                generator=generator,
                per_token_timesteps=per_token_timesteps,
                return_dict=False,
            )[0]
            dtype = compute_dtype_for(sample, model_output)
            zeros = torch.zeros(batch, dtype=dtype, device=sample.device)
            output = FlowMatchSDESchedulerOutput(
                prev_sample=prev_sample,
                log_prob=zeros,
                prev_sample_mean=prev_sample.to(dtype),
                std=torch.zeros_like(zeros),
            )
        else:
            if per_token_timesteps is not None:
                raise ValueError(
                    "per_token_timesteps is only supported on ODE steps; SDE steps use one noise level per step. "
                    "Use noise_level=0 or an SDE window that excludes this step."
                )
            output = flow_step(
                model_output,
                sample,
                self.sigmas[index],
                self.sigmas[index + 1],
                None,
                self.config.noise_level,
                self.config.sde_type,
                generator if generator is not None else self._sde_generator,
                self.config.log_prob_reduction,
                self.sigmas[1] if len(self.sigmas) > 1 else None,
                self.config.cps_log_prob,
                out_dtype=model_output.dtype,
            )
            self._step_index += 1

        if not return_dict:
            return output.prev_sample, output.log_prob, output.prev_sample_mean, output.std
        return output
