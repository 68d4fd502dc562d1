"""OnlineRLTrainer: what every online-RL trainer of a flow-matching pipeline here shares, on ``transformers.Trainer``.

The trainer is small and owns its parts, each built once in ``__init__`` from the configuration:

* ``trainer.policy`` (`policy.Policy`): the pipeline, the LoRA or full weights, the reference and old policies, the
  EMA, their velocities, saving and loading them;
* ``trainer.rollouts`` (`rollout.RolloutEngine`): encoding, sampling with the SDE scheduler (the algorithm's
  `RolloutStrategy`), decoding, scoring, advantages;
* ``trainer.evaluator`` (`evaluation.Evaluator`): periodic evaluation, gold rewards, contact sheets, the change since
  the first evaluation;
* ``trainer.health`` (`health.HealthGuards`): diagnostics, alarms, early stopping, reference refresh, GARDO, dynamic
  sampling, an observer called through explicit hooks.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout* (`_generate`). The generation batch holds ``generation_batch_size / G`` prompts, each G times; the
   rollout engine samples it in micro-batches, decoding and scoring each in the background.
2. *Reward.* The last micro-batch's rewards are still being scored while the first training forward runs; the
   algorithm's loss asks for the advantages (`_advantages`) after that forward, which gathers the rewards of all
   processes and turns them into group advantages.
3. *Training* (`_train_on_batch`). Each recorded micro-batch is trained in `_loss_parts` parts (Flow-GRPO: one per
   trained denoising step), grouped into passes of ``train_timesteps_per_pass`` parts (`timestep_passes`); the
   algorithm's `_pass_losses` gives each part's loss from one forward over the pass's rows, and this class runs one
   backward pass per pass (DDP synchronises on the last), scales by the parts and the accumulation steps, times the
   passes and logs the loss's metrics.

What an algorithm (a subclass) provides: ``_config_class``, ``_name`` / ``_tag_names`` / ``_paper`` (model card),
``_rollout_strategy``, ``_batch_loss`` or ``_pass_losses`` (and ``_loss_parts`` / ``_prepare_batch`` when it trains
a micro-batch in several parts), ``_card_setup_lines``; optional: ``_eval_ode_solver``, ``_eval_raw_weights``,
``_check_rewards``, ``_check_datasets``, ``_on_optimizer_step_end``, ``_generate``. What the algorithm *is* (the copies
of the policy it keeps, whether its loss reads the reference, what a rollout worker needs, what the planner plans) is
its `AlgorithmSpec`, declared next to its configuration and read as ``trainer.spec`` / ``trainer.algorithm``
(`flowgrpo.trainer.algorithm_spec`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import TrainerCallback
from transformers.utils import logging

from ..cpu_threads import apply_cpu_thread_plan, install_main_thread_yield, plan_cpu_threads
from ..models import family_adapter_class
from ..models.defaults import resolve_trainer_settings
from ..rewards import RewardSet, resolve_reward_funcs
from ..rewards.composition import reward_spec_names
from .base import FlowBaseTrainer
from .console import install_training_console
from .data.condition_images import IMAGE_COLUMN
from .data.datasets import INDEX_COLUMN, IndexedPromptDataset
from .data.prompt_cache import check_prompt_cache_capacity, setup_prompt_cache
from .data.sampler import RepeatSampler
from .evaluation.evaluator import Evaluator
from .fsdp_units import keep_present_wrap_classes
from .health.constraints import check_constraint_rewards
from .health.guards import HealthGuards, check_health_setup, needs_reference_copy, resolve_gold_rewards
from .online_config import OnlineRLConfig
from .outputs.lora_export import EXPERT_LORA_WEIGHTS_NAMES
from .outputs.sample_logging import log_sample_images
from .policy.compiled_blocks import CompileWatch
from .policy.loading import check_family_settings, import_own_components, read_pipeline_index
from .policy.policy import Policy
from .registry import spec_of
from .rollout.backend import RolloutWorkerError, model_source
from .rollout.backend_choice import build_rollout_backend
from .rollout.cache import check_rollout_cache_fields
from .rollout.engine import RolloutEngine
from .rollout.sound import audio_reward_names, check_audio_rewards
from .rollout.strategies import RolloutStrategy
from .sequence_parallel import (
    DataParallelView,
    SequenceParallelLayout,
    sequence_parallel_loss_scale,
    sequence_parallel_mesh,
)
from .speed_settings import check_speed_settings, torch_compile_refusal
from .step_metrics import StepMetrics
from .timestep_passes import passes_of

logger = logging.get_logger(__name__)

__all__ = ["LossPart", "OnlineRLTrainer"]


@dataclass
class LossPart:
    """One backward pass's loss (with gradient, not yet scaled) and the values to log with it."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _identity_collator(features: list[dict]) -> list[dict]:
    return features


class _JsonConfig(dict):
    """A diffusers config (a FrozenDict) with the two methods reporting callbacks expect of a transformers config."""

    def to_dict(self) -> dict:
        return dict(self)

    def to_json_string(self) -> str:
        import json

        return json.dumps(self, indent=2, sort_keys=True, default=str)


class _CallbackModelView:
    """What callbacks see as ``model``: the trained model, with a config that transformers' callbacks can log."""

    def __init__(self, model: torch.nn.Module):
        self._model = model

    @property
    def config(self) -> _JsonConfig:
        return _JsonConfig(getattr(self._model, "config", {}) or {})

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class _StepHooks(TrainerCallback):
    """Keeps the trainer's micro-step counter and end-of-step work in step with Trainer's loop (also after
    resuming)."""

    def __init__(self, trainer: OnlineRLTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._micro_step = state.global_step * args.gradient_accumulation_steps
        self.trainer.buffer = None
        # Trainer re-points the handler at the raw model when training starts; diffusers configs lack
        # ``to_json_string``, which the tensorboard callback calls.
        handler = self.trainer.callback_handler
        if not isinstance(handler.model, _CallbackModelView):
            handler.model = _CallbackModelView(handler.model)

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._on_step_end(state.global_step)


class OnlineRLTrainer(FlowBaseTrainer):
    """The machinery every online-RL trainer shares (see the module docstring); subclasses add the algorithm.

    Args:
        model: a hub id or local folder of a diffusers pipeline, or a loaded ``DiffusionPipeline`` (SD3/SD3.5,
            FLUX.1, Qwen-Image, Wan, FLUX.1 Kontext, Qwen-Image-Edit, ...). Its transformer is trained; everything
            else is frozen.
        reward_funcs: a registry name, a callable ``fn(prompts, images, **columns) -> list[float | None]``, a
            ``"package.module:function"`` path, or a list of those (weighted by ``args.reward_weights``).
        args: the trainer's configuration (``_config_class``).
        train_dataset / eval_dataset: a ``datasets.Dataset`` (or list of dicts / strings) with a ``prompt``
            column; other columns are passed to the rewards. Editing families (FLUX.1 Kontext, Qwen-Image-Edit)
            also need an ``image`` column (a path, a PIL image or a ``datasets.Image`` feature): each sample's
            source image, encoded at the working resolution and given to the rewards as PIL images.
        peft_config: a ``peft.LoraConfig`` for LoRA training; ``None`` fine-tunes the whole transformer. A config
            without ``target_modules`` gets the family's default targets (``adapter.default_lora_target_modules``;
            Wan 2.2 A14B: a LoRA on each of its two experts).
        callbacks, optimizers: as in ``transformers.Trainer``.
        pipeline_kwargs: extra ``from_pretrained`` arguments (e.g. ``revision``) when ``model`` is a string.
    """

    #: the configuration class ``args`` must be an instance of
    _config_class: type[OnlineRLConfig] = OnlineRLConfig

    def __init__(
        self,
        model: str | Any,
        reward_funcs: str | Callable | list,
        args: OnlineRLConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        pipeline_kwargs: dict | None = None,
    ):
        config_class = self._config_class
        if args is None:
            name = model if isinstance(model, str) else type(model).__name__
            args = config_class(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{self._name}")
        if not isinstance(args, config_class):
            raise TypeError(f"args must be a {config_class.__name__} for {type(self).__name__}, got "
                            f"{type(args).__name__}")
        #: the algorithm's spec (registered in ``flowgrpo.trainers``)
        self.spec = spec_of(args)
        # Cheap validation first: rewards and datasets fail before any model is loaded.
        train_dataset = IndexedPromptDataset.wrap(train_dataset, "train_dataset")
        eval_dataset = IndexedPromptDataset.wrap(eval_dataset, "eval_dataset")
        self.reward_set: RewardSet = self._resolve_rewards(args, reward_funcs, has_eval_dataset=eval_dataset is not None)
        self._check_rewards(args, self.reward_set)
        self.gold_reward_set: RewardSet | None = resolve_gold_rewards(args, self.reward_set)
        audio_rewards = audio_reward_names(self.reward_set, self.gold_reward_set)
        check_health_setup(args, self.reward_set.names, self.spec.facts(args))
        check_prompt_cache_capacity(args, train_dataset, eval_dataset)
        if args.quantization and not torch.cuda.is_available():
            raise ValueError(f"quantization={args.quantization!r} loads the transformer with bitsandbytes, which "
                             "needs a CUDA GPU; unset quantization on this machine.")
        if args.quantization and peft_config is None:
            raise ValueError("A quantized transformer cannot be fully fine-tuned; pass a LoRA peft_config.")
        index = read_pipeline_index(model, pipeline_kwargs or {})
        check_family_settings(index, args, peft_config, (train_dataset, eval_dataset))
        args.check_sequence_parallel_launch(args.world_size)  # before anything is loaded
        self._check_datasets(index, args, (train_dataset, eval_dataset))
        # Unset generation settings (size, steps, guidance, text length, frames) become the model's own, and
        # impossible ones are refused, from the configs alone (models/defaults.py); when the index could not be read,
        # the policy does it right after loading, before anything moves to a device.
        settings = resolve_trainer_settings(model, args, index, pipeline_kwargs)
        # torch_compile and rollout_cache against the launch, the algorithm and the family (speed_settings.py)
        family = family_adapter_class(index["_class_name"]).family if index and "_class_name" in index else None
        self._check_speed_settings(args, family)
        if audio_rewards and index and "_class_name" in index:
            check_audio_rewards(family_adapter_class(index["_class_name"]), audio_rewards)
        import_own_components(index)
        rollout_source = model_source(model, pipeline_kwargs, args)  # what rollout workers load (before the LoRA)

        # ---- the policy: loaded before transformers.Trainer, which needs the model ----------------------------
        self.policy = Policy(model, args, peft_config, pipeline_kwargs, generation_settings=settings,
                             keep_reference_copy=self.spec.facts(args, peft_config is not None).reads_reference
                             or needs_reference_copy(args))
        #: the facts of this run's algorithm, with the generation settings resolved (`AlgorithmFacts`)
        self.algorithm = self.spec.facts(args, use_lora=self.policy.is_peft)
        if family is None:  # a loaded pipeline (no model_index.json to read): its family is known now
            self._check_speed_settings(args, self.policy.adapter.family)
        #: the resolved generation settings and where each came from (``flowgrpo.models.defaults``)
        self.generation_settings = self.policy.generation_settings
        adapter = self.policy.adapter
        check_audio_rewards(type(adapter), audio_rewards)
        self._set_card_facts(adapter, train_dataset)

        self.metrics = StepMetrics()
        #: the current generation's records (one per micro-batch), trained on until the next rollout
        self.buffer: list[dict] | None = None
        self._micro_step = 0
        self._startup_logged = False
        self._evaluated_step: int | None = None
        if args.ddp_find_unused_parameters is None:  # read by Trainer when it builds the accelerator, just below
            args.ddp_find_unused_parameters = adapter.may_leave_weights_unused

        super().__init__(
            model=self.policy.model, args=args, data_collator=_identity_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=None, callbacks=callbacks, optimizers=optimizers,
        )
        # First in line, so that its on_train_begin swaps in the callback model view before the reporting
        # callbacks (tensorboard, wandb) read ``model.config``.
        self.callback_handler.callbacks.insert(0, _StepHooks(self))
        self.callback_handler.model = _CallbackModelView(self.model)
        fsdp_plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if fsdp_plugin is not None:  # a config shared by several families names some blocks this model lacks
            keep_present_wrap_classes(fsdp_plugin, self.model)
        # One bar with the key figures and a table per evaluation, instead of every logged dictionary.
        self.console = install_training_console(self)

        device = self.accelerator.device
        if device.type == "cpu":  # pinned host memory needs an accelerator: on a CPU torch warns and ignores it
            args.dataloader_pin_memory = False
        self._plan_cpu_threads(args, adapter)
        mesh = self._split_processes(args)

        # ---- the rest of the policy, the health guards, the rollout engine, the evaluator --------------------
        zero3 = self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        self.policy.attach(self.accelerator, lambda: self.model, lambda: self.model_wrapped, zero3=zero3)
        self.policy.place_on_device()
        self.policy.build_ema()
        self.policy.build_reference(own_adapter=bool(args.sync_ref_model or args.regularizer == "gardo"))
        self.health = HealthGuards(args, self.reward_set, self.gold_reward_set, self.policy, self.data_parallel,
                                   self.metrics, self.algorithm)
        for callback in self.health.callbacks():
            self.add_callback(callback)
        self.policy.encode_negative_prompt()
        prompt_cache = setup_prompt_cache(args, adapter, self.policy.pipeline, device,
                                          (self.train_dataset, self.eval_dataset), self.accelerator.autocast)
        if self.algorithm.keeps_old_policy:
            self.policy.build_old_policy()
        for name in self.algorithm.named_copies:
            self.policy.build_copy(name)
        if mesh is not None:  # every copy exists now; none has sampled yet
            self.policy.enable_sequence_parallel(mesh)
        #: torch_compile: the compile times and graphs (None without it); the blocks are compiled once every copy
        #: of the policy exists, and Trainer compiles nothing itself (`_build_accelerator_args`)
        self.compile_watch: CompileWatch | None = self._compile_blocks(args, zero3) if args.torch_compile else None
        self.rollouts = RolloutEngine(args, self.policy, self._rollout_strategy(args), self.reward_set,
                                      self.data_parallel, self.metrics, prompt_cache=prompt_cache,
                                      console=self.console, on_scores=self.health.on_scores,
                                      on_reward_error=self._raise_if_reward_failed,
                                      constraints=self.health.constraints)
        self.evaluator = Evaluator(args, self.policy, self.rollouts, self.reward_set, self.gold_reward_set,
                                   self.data_parallel, ode_solver=self._eval_ode_solver(), audio_rewards=audio_rewards,
                                   raw_weights=self._eval_raw_weights())
        #: where rollouts are sampled: the training processes (local) or Ray workers (rollout/backend.py)
        self.rollout_backend = build_rollout_backend(args, self.policy, self.rollouts, self.accelerator, self.metrics,
                                                     self.algorithm, rollout_source,
                                                     stale_replay=self._stale_generation_replay())
        self.rollout_backend.launch()  # Ray workers load the pipeline while the trainer goes on

    @staticmethod
    def _resolve_rewards(args: OnlineRLConfig, reward_funcs: Any, *, has_eval_dataset: bool) -> RewardSet:
        """The run's `RewardSet`: ``reward_funcs`` at ``reward_weights``, and each reward that ``reward_constraints``
        names outside them scored too with weight 0 (it acts through its multiplier only)."""
        constrained = check_constraint_rewards(args, reward_spec_names(reward_funcs),
                                               reward_spec_names(args.eval_reward_funcs or []),
                                               has_eval_dataset=has_eval_dataset)
        if constrained and isinstance(reward_funcs, RewardSet):
            raise ValueError(f"reward_constraints name {constrained}, which the given RewardSet lacks; add them to it "
                             "with weight 0, or pass reward names instead of a RewardSet.")
        if constrained:
            specs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
            weights = list(args.reward_weights) if args.reward_weights is not None else [1.0] * len(specs)
            reward_funcs, reward_weights = specs + constrained, weights + [0.0] * len(constrained)
        else:
            reward_weights = args.reward_weights
        return resolve_reward_funcs(reward_funcs, reward_weights, args.reward_kwargs,
                                    num_workers=args.reward_num_workers, on_failure=args.reward_on_failure,
                                    offload=args.reward_offload)

    def _set_card_facts(self, adapter, train_dataset) -> None:
        """What the model card says of the run: the base model, the rewards, the pipeline tag, a second expert."""
        self._card_base_model = self.policy.base_model_id
        self._card_rewards = list(self.reward_set.names)
        # FLUX.2's reference images are optional: its card says image-to-image only when the data holds images.
        edits = adapter.accepts_images and (not adapter.images_optional or (
            train_dataset is not None and len(train_dataset) > 0 and IMAGE_COLUMN in train_dataset[0]))
        self._card_pipeline_tag = ("image-to-video" if edits else "text-to-video") if adapter.is_video else (
            "image-to-image" if edits else "text-to-image")
        if len(adapter.transformers()) > 1:
            self._card_second_expert_lora = EXPERT_LORA_WEIGHTS_NAMES["transformer_2"]

    def _plan_cpu_threads(self, args: OnlineRLConfig, adapter) -> None:
        """On a CPU, the threads of torch and of the main thread's yields (`flowgrpo.cpu_threads`)."""
        on_cpu = self.accelerator.device.type == "cpu"
        model_parameters = sum(p.numel() for module in adapter.transformers() for p in module.parameters())
        self.cpu_thread_plan = apply_cpu_thread_plan(plan_cpu_threads(args.cpu_threads, on_cpu=on_cpu,
                                                                      model_parameters=model_parameters))
        if self.cpu_thread_plan is not None:
            logger.info("CPU threads: %s", self.cpu_thread_plan.describe())
        self._thread_yield_hooks = install_main_thread_yield(adapter.transformers())

    def _split_processes(self, args: OnlineRLConfig):
        """The launch as data-parallel replicas of ``sequence_parallel_size`` processes each: sets
        ``sequence_parallel`` (the layout) and ``data_parallel`` (the accelerator as the parts count samples: one
        process per replica, whose gathers keep one copy of what the processes of a sequence-parallel group share;
        the accelerator itself without SP); returns the device mesh of sequence parallelism, or None."""
        #: how the launch splits into data-parallel replicas of ``sequence_parallel_size`` processes each
        self.sequence_parallel = SequenceParallelLayout(args.sequence_parallel_size, self.accelerator.process_index,
                                                        self.accelerator.num_processes)
        self.data_parallel = self.accelerator
        if not self.sequence_parallel.enabled:
            return None
        mesh = sequence_parallel_mesh(self.sequence_parallel, self.accelerator.device)
        self.data_parallel = DataParallelView(self.accelerator, self.sequence_parallel, mesh["ulysses"].get_group())
        return mesh

    def _compile_blocks(self, args: OnlineRLConfig, zero3: bool) -> CompileWatch:
        """``torch_compile``: the policy's blocks compiled once (every copy of the policy exists by now), refused
        under FSDP and ZeRO-3 (a launch the environment did not show before loading)."""
        if self.is_fsdp_enabled or zero3:
            raise ValueError(torch_compile_refusal("FSDP" if self.is_fsdp_enabled else "DeepSpeed ZeRO-3"))
        watch = CompileWatch()
        blocks = self.policy.compile_blocks(args.torch_compile_backend, args.torch_compile_mode)
        logger.info("torch_compile: %d blocks compiled with backend %s (dynamic shapes)", blocks,
                    args.torch_compile_backend)
        return watch

    def _check_speed_settings(self, args: OnlineRLConfig, family: str | None) -> None:
        """Refuse torch_compile and rollout_cache where they cannot give this run's results (before loading)."""
        check_speed_settings(args, self.spec.facts(args), family, self._rollouts_use_cfg(args), self.spec.title)
        check_rollout_cache_fields(args.rollout_cache, args.rollout_cache_config)

    @staticmethod
    def _rollouts_use_cfg(args: OnlineRLConfig) -> bool:
        return args.guidance_scale is not None and args.guidance_scale > 1.0

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        """Trainer's accelerator arguments without its whole-model ``torch.compile``: with ``torch_compile`` the policy
        compiles the transformer's blocks itself (`Policy.compile_blocks`), so that rollouts and training share them."""
        out = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile and "dynamo_plugin" in out:
            from accelerate.utils import TorchDynamoPlugin

            out["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return out

    # ---- read-only views of the parts ------------------------------------------------------------------
    @property
    def adapter(self):
        """The family adapter of the trained pipeline (``policy.adapter``)."""
        return self.policy.adapter

    @property
    def pipeline(self):
        """The trained pipeline (``policy.pipeline``)."""
        return self.policy.pipeline

    @property
    def is_peft(self) -> bool:
        """Whether the transformer is trained with a LoRA (``policy.is_peft``)."""
        return self.policy.is_peft

    @property
    def stopped_by_hacking_alarm(self) -> bool:
        return self.health.stopped_by_hacking_alarm

    # ---- the datasets and their sampler ------------------------------------------------------------------
    def _set_signature_columns_if_needed(self):
        # Keep every column: the prompt column feeds generation, the others feed the rewards.
        if self._signature_columns is None:
            self._signature_columns = ["prompt", INDEX_COLUMN]

    def _get_train_sampler(self, train_dataset: Dataset | None = None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return RepeatSampler(
            dataset, num_generations=self.args.num_generations,
            prompts_per_generation=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self.args.num_iterations * self.args.steps_per_generation, shuffle=True,
            seed=self.args.seed, sequence_parallel_size=self.args.sequence_parallel_size,
            data_parallel_size=self.args.data_parallel_size,
        )

    def get_train_dataloader(self):
        # One dataloader batch per process = that process's share of a generation batch.
        original = self._train_batch_size
        self._train_batch_size = self.args.per_device_train_batch_size * self.args.steps_per_generation
        try:
            return super().get_train_dataloader()
        finally:
            self._train_batch_size = original

    # ---- the algorithm's hooks ------------------------------------------------------------------------------
    def _rollout_strategy(self, args: OnlineRLConfig) -> RolloutStrategy:
        """What a training rollout samples and records (`rollout.strategies`)."""
        raise NotImplementedError

    def _eval_ode_solver(self) -> str:
        """The deterministic solver of evaluation samples."""
        return "euler"

    def _eval_raw_weights(self) -> bool:
        """Whether evaluation also scores the raw weights when there is an EMA (AWM), under ``<prefix>_raw``."""
        return False

    def _check_rewards(self, args: OnlineRLConfig, rewards: RewardSet) -> None:
        """The algorithm's own checks of its training rewards, before anything is loaded (a reward-gradient trainer
        refuses the rewards that give no gradient)."""

    def _check_datasets(self, index: dict | None, args: OnlineRLConfig, datasets: tuple) -> None:
        """The algorithm's own checks of its datasets, before anything is loaded (``index``: model_index.json)."""

    def _prepare_batch(self, record: dict) -> dict:
        """What `_batch_loss` reads of a recorded micro-batch (default: the record). A subclass drawing per-batch
        choices (the trained steps, noise) returns them over the record, e.g. ``ChainMap(drawn, record)``, so that
        the advantages written into the record by the scoring stay visible."""
        return record

    def _loss_parts(self, batch: dict) -> int:
        """How many backward passes `_batch_loss` trains a micro-batch in (Flow-GRPO: one per trained step)."""
        return 1

    def _batch_loss(self, model: torch.nn.Module, batch: dict, part: int, first_pass: bool) -> LossPart:
        """The loss of part ``part`` of a micro-batch (``first_pass``: the first pass over a fresh generation). An
        algorithm implements this or `_pass_losses`; by default it is the one-part pass ``[part]``."""
        if type(self)._pass_losses is OnlineRLTrainer._pass_losses:
            raise NotImplementedError(f"{type(self).__name__} must implement _batch_loss or _pass_losses.")
        return self._pass_losses(model, batch, [part], first_pass)[0]

    def _pass_losses(self, model: torch.nn.Module, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """The losses of the parts ``parts`` of a micro-batch, trained together in one backward pass (a pass of
        ``train_timesteps_per_pass`` parts, `timestep_passes`): one `LossPart` per part, in order, each the part's loss
        as `_batch_loss` gives it. An algorithm whose parts replay the model on different rows overrides this to run
        each forward once over the parts' rows stacked (`stack_rows`, `split_rows`); this default computes the parts
        one after the other (their forwards apart, one backward for all)."""
        return [self._batch_loss(model, batch, part, first_pass) for part in parts]

    def _on_optimizer_step_end(self, step: int) -> None:
        """Called after each optimizer step ``step`` (1-based), before logging and checkpointing."""

    def _stale_generation_replay(self) -> Callable[[list[dict]], dict[str, float]] | None:
        """What the Ray backend calls on every generation sampled by older weights (``records -> metrics to log``; it
        may rewrite the records, e.g. Flow-GRPO's truncated importance weights or Flow-DPPO's anchor); None: stale
        samples are trained as they are."""
        return None

    def _card_setup_lines(self) -> list[str]:
        """The model card's "Training setup" lines (markdown list items) besides the step count."""
        return []

    # ------------------------------------------------------------------------------------------------
    # training
    # ------------------------------------------------------------------------------------------------
    def _generation_index(self) -> int:
        return self._micro_step // (self.args.steps_per_generation * self.args.num_iterations)

    def _generate(self, inputs: list[dict]) -> list[dict]:
        """Rollout and rewards of this process's share of a generation batch; returns one record per micro-batch
        (its rewards are scored while the first training forward runs, unless dynamic sampling scored them)."""
        gen_index = self._generation_index()
        self.health.on_generation_start(gen_index)
        generation = self.rollout_backend.generate(inputs, gen_index, self.state.global_step)
        refilled = self.health.on_generation(generation, self.rollouts, self.train_dataset, gen_index)
        if refilled is not None:
            return refilled.records
        self.rollouts.defer(generation)
        return generation.records

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # the Ray backend reads the coming generations' rows ahead, to sample them while this one trains
        epoch_iterator = self.rollout_backend.read_ahead(epoch_iterator, self._micro_step)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        """`transformers.Trainer.train` with the rollout backend started before and closed after; a rollout worker
        lost for good stops the run with a checkpoint of the last completed step (`RolloutWorkerError`). In a training
        process whose entry point paused the garbage collector, it is turned back on here with everything alive now
        frozen (`flowgrpo.process_gc`)."""
        from ..process_gc import resume as resume_garbage_collection

        resume_garbage_collection()
        self.rollout_backend.start()
        summary = self.rollout_backend.summary()
        if summary and self.is_world_process_zero():
            self.console.write(summary) if self.console is not None else logger.warning(summary)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        except RolloutWorkerError as err:
            where = self._checkpoint_after_reward_failure(trial)
            err.args = (f"{err.args[0]} The last completed step ({self.state.global_step}) {where}; rerun the same "
                        "command with --resume_from_checkpoint last once the workers can run.",)
            raise
        finally:
            self.rollout_backend.close()

    def training_step(self, model, inputs, num_items_in_batch=None):
        args = self.args
        period = args.steps_per_generation * args.num_iterations
        if self._micro_step % period == 0 or self.buffer is None:
            self.buffer = self._generate(inputs)
        position = self._micro_step % period
        first_pass = position < args.steps_per_generation
        record = self.buffer[position % args.steps_per_generation]
        self._micro_step += 1

        tic = time.perf_counter()
        model.train()
        loss = self._train_on_batch(model, record, first_pass)
        self.metrics.train["timing/training"].append(time.perf_counter() - tic)
        return loss

    def _train_on_batch(self, model, record: dict, first_pass: bool) -> torch.Tensor:
        """The algorithm's loss on one recorded micro-batch, in passes of ``train_timesteps_per_pass`` parts
        (`timestep_passes`): one forward over the pass's rows and one backward of the sum of its parts' losses each,
        every part scaled by 1 / (parts x accumulation steps); returns the scaled loss's value (detached)."""
        batch = self._prepare_batch(record)
        parts = self._loss_parts(batch)
        passes = passes_of(parts, self.args.train_timesteps_per_pass)
        # a first pass over samples of older weights (rollout_backend: ray, max_staleness >= 1) is not on-policy
        on_policy = first_pass and self.rollout_backend.staleness == 0
        scale = 1.0 / (parts * self.current_gradient_accumulation_steps)
        # sequence parallelism: S times the loss, so that data parallelism's mean over all processes is the mean over
        # replicas of each SP group's summed gradient (sequence_parallel.layout.sequence_parallel_loss_scale)
        backward_scale = scale * sequence_parallel_loss_scale(self.sequence_parallel)
        total = torch.zeros((), device=self.accelerator.device)
        m = self.metrics.train
        backward_kwargs = self._backward_kwargs()
        clock = self.rollouts.clock
        for index, group in enumerate(passes):
            with self._sync_on_last(model, index, len(passes)):
                self.rollouts.scoring_wait_s = 0.0
                tic = clock()
                outs = self._pass_losses(model, batch, group, on_policy)
                if len(outs) != len(group):
                    raise RuntimeError(f"{type(self).__name__}._pass_losses returned {len(outs)} losses for the "
                                       f"{len(group)} parts {group}; it must return one LossPart per part.")
                loss = outs[0].loss
                for out in outs[1:]:
                    loss = loss + out.loss
                tac = clock()
                self.accelerator.backward(loss * backward_scale, **backward_kwargs)
                toc = clock()
                # the wait for rewards scored while the forward ran is logged as timing/reward, not forward time
                m["timing/training_forward"].append(tac - tic - self.rollouts.scoring_wait_s)
                m["timing/training_backward"].append(toc - tac)
            for out in outs:
                total += out.loss.detach() * scale
                for key, value in out.metrics.items():
                    m[key].append(value)
                if first_pass and self.rollout_backend.logs_rollout_metrics and "ratio_mean" in out.metrics:
                    m["rollout/first_pass_ratio"].append(out.metrics["ratio_mean"])
        return total

    def _advantages(self, batch: dict) -> torch.Tensor:
        """The micro-batch's advantages: the rewards of the rollout's last micro-batches are scored while the first
        training forward runs, so the first call waits for them (and gathers them from every process)."""
        self.rollouts.resolve_scoring()
        return batch["advantages"]

    def _backward_kwargs(self) -> dict:
        """Extra ``accelerator.backward`` arguments: the losses are already divided by the accumulation steps, so
        DeepSpeed must not divide them again."""
        from accelerate.utils import DistributedType

        return {"scale_wrt_gas": False} if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {}

    @staticmethod
    def _sync_on_last(model, index: int, passes: int):
        """A micro-batch trained in ``passes`` backward passes: under DDP only the last one all-reduces the gradients
        (one all-reduce per micro-batch, whatever ``train_timesteps_per_pass``)."""
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        return model.no_sync() if ddp and index < passes - 1 else nullcontext()

    def _update_old_policy(self, decay: float) -> None:
        """theta_old <- decay theta_old + (1 - decay) theta, unless the step was skipped (a non-finite step changed no
        weight)."""
        if not self.last_step_skipped:
            self.policy.update_old_policy(decay)

    def _on_step_end(self, step: int) -> None:
        """After each optimizer step: the startup time (once), the EMA, the algorithm's hook, the health guards,
        sample images."""
        args = self.args
        if not self._startup_logged:
            # Seconds from the start of this process to the end of its first optimizer step (imports, loading,
            # set-up and one step): logged once, with that step's metrics, as timing/startup.
            self._startup_logged = True
            import psutil

            self.metrics.train["timing/startup"].append(time.time() - psutil.Process().create_time())
            if self.compile_watch is not None:  # the compilations of the first step (and of an evaluation before it)
                self.metrics.train["timing/compile_s"].append(self.compile_watch.seconds)
                self.compile_watch.mark_warm()
        if self.compile_watch is not None:
            self.metrics.train["compile/graphs"].append(float(self.compile_watch.graphs))
            self.metrics.train["compile/recompiles"].append(float(self.compile_watch.recompiles))
        ema = self.policy.ema
        if ema is not None and not self.last_step_skipped:  # a skipped (non-finite) step changed no weight
            ema.update(self.policy.trainable_parameters(), step)
        self._on_optimizer_step_end(step)
        self.health.on_step_end(step, self.buffer[0] if self.buffer else None, self.rollouts)
        samples = self.rollouts.last_samples
        if args.log_images_steps and step % args.log_images_steps == 0 and samples and self.is_world_process_zero():
            log_sample_images(self.callback_handler.callbacks, *samples, step=step,
                              notes=self.rollouts.last_sample_notes, fps=args.log_video_fps)

    # ------------------------------------------------------------------------------------------------
    # evaluation and logging
    # ------------------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """`Evaluator.evaluate` on ``eval_dataset`` (default: the trainer's), then the hacking alarm
        (``health/hacking_alarm``), the log and the callbacks; returns the metrics."""
        dataset = IndexedPromptDataset.wrap(eval_dataset, "eval_dataset") if eval_dataset is not None else \
            self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass one to the trainer or to evaluate()).")
        state = self.state
        metrics = self.evaluator.evaluate(dataset, metric_key_prefix, state.global_step)
        # the weights of this step were evaluated on the trainer's own set (see final_weights_evaluated)
        self._evaluated_step = state.global_step if eval_dataset is None and metric_key_prefix == "eval" else None
        decision = self.health.on_evaluate(metrics, metric_key_prefix, state.global_step,
                                           state.best_model_checkpoint, state.best_metric)
        if decision.stop:
            self.control.should_training_stop = True
            self.control.should_save = True
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def final_weights_evaluated(self) -> bool:
        """Whether the weights the trainer holds now were already evaluated on its evaluation set: ``train()``
        evaluates at its last step (eval_strategy ``steps`` always does, ``epoch`` at the last epoch), so a script
        that evaluates after ``train()`` would score the same images again (minutes per run on a full benchmark).
        False when the best checkpoint was loaded back since (``load_best_model_at_end``) or nothing was evaluated
        at this step."""
        return self._evaluated_step == self.state.global_step

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        metrics = self.metrics.means(mode)
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        super().log({**logs, **metrics}, start_time)
        self.metrics.clear(mode)

    # ------------------------------------------------------------------------------------------------
    # saving and resuming
    # ------------------------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """``Trainer``'s own save of the trained model, then the policy's export (the diffusers LoRA, the EMA) and, in a
        checkpoint, the old policy, the reference adapter and the health state."""
        output_dir = output_dir or self.args.output_dir
        with self.policy.trainer_save_context(self._in_checkpoint):
            super()._save(output_dir, state_dict=state_dict)
        if not self.args.should_save:
            return
        self.policy.save(output_dir, state_dict=state_dict, in_checkpoint=self._in_checkpoint)
        if self._in_checkpoint:
            self.health.save(output_dir)
            self.rollout_backend.save(output_dir, self.state.global_step)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self.policy.check_resumable(resume_from_checkpoint, self._name)
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        self.policy.load(resume_from_checkpoint)
        self.health.load(resume_from_checkpoint)
        self.rollout_backend.load(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """Trainer's restore of the best checkpoint's weights, and its EMA (the final save then exports them)."""
        super()._load_best_model()
        self.policy.load_ema(self.state.best_model_checkpoint)
        self._evaluated_step = None  # the best checkpoint's weights, not the last evaluated ones
        if self.is_world_process_zero():
            logger.warning(f"Loaded the best model: {self.state.best_model_checkpoint} ({self.args.metric_for_best_model}"
                           f"={self.state.best_metric}); the final weights, exported LoRA and Hub push are its.")

    def _card_last_eval(self) -> dict | None:
        return self.evaluator.last_eval

    def _card_extra_sections(self) -> str:
        lines = ["## Training setup", "", *self._card_setup_lines(), f"- optimizer steps: {self.state.global_step}"]
        last_eval = self.evaluator.last_eval
        if last_eval:
            lines += ["", "## Evaluation (last run)", ""]
            lines += [f"- {k}: {v:.4f}" for k, v in last_eval["metrics"].items()]
        lines += self.health.card_lines(self.state)
        return "\n".join(lines)
