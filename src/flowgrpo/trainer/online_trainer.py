"""OnlineRLTrainer: what every online-RL trainer of a flow-matching pipeline here shares, on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout.* The generation batch holds ``generation_batch_size / G`` prompts, each G times. Each unique prompt
   is encoded once (or read from the embedding cache). Images are sampled in micro-batches by the algorithm's
   ``_rollout`` (Flow-GRPO: SDE steps in a window, recording the window's transitions; DiffusionNFT: a deterministic
   solver run by the old policy, keeping only the final latent).
2. *Reward.* Each micro-batch is decoded once, in a background thread, and scored by the reward pool while the
   next micro-batch is sampled. The last micro-batch's rewards are still being scored while the first training
   forward runs; then rewards are gathered from all processes and turned into group advantages as in
   ``rollout/advantages.py`` (stored in each micro-batch's record as ``"advantages"``).
3. *Training.* The algorithm's ``_train_on_batch`` computes its loss on one recorded micro-batch and runs the
   backward passes; it calls ``_resolve_scoring()`` once its first forward has run.

Composed from: ``rollout/pipeline.py`` (`RolloutPipeline`: steps 1 and 2 and the sampling loop ``_sample``),
``evaluation/evaluator.py`` (`Evaluation`: ``evaluate``), ``model_loading.py`` (`PipelineLoading`), ``base.py``
(`FlowBaseTrainer`: the model card and the Hub push) and ``run_state/crash_safety.py`` (`CrashSafeTrainerMixin`).
This class holds the set-up (family adapter, LoRA or full fine-tuning with a reference policy, the prompt cache,
EMA), the training step, logging (metrics, sample images and videos) and saving (the diffusers LoRA, EMA state).

What a subclass provides: ``_config_class``, ``_name`` / ``_tag_names`` / ``_paper`` (model card), ``_rollout`` (and
optionally ``_rollout_plan``), ``_train_on_batch``, ``_card_setup_lines``; optional hooks: ``_scheduler_options``,
``_sde_type``, ``_eval_ode_solver``, ``_on_optimizer_step_end``.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import TrainerCallback
from transformers.trainer_utils import set_seed
from transformers.utils import logging

from ..cpu_threads import apply_cpu_thread_plan, install_main_thread_yield, plan_cpu_threads
from ..models import PromptEmbeds, family_adapter_class, get_family_adapter
from ..models.defaults import resolve_trainer_settings
from ..rewards import RewardSet, resolve_reward_funcs
from ..schedulers import FlowMatchSDEScheduler
from .base import FlowBaseTrainer
from .console import install_training_console
from .data.condition_images import IMAGE_COLUMN
from .data.datasets import INDEX_COLUMN, IndexedPromptDataset
from .data.prompt_cache import check_prompt_cache_capacity, setup_prompt_cache
from .data.sampler import RepeatSampler
from .evaluation.eval_change import EvaluationBaseline
from .evaluation.evaluator import Evaluation
from .fsdp_units import keep_present_wrap_classes
from .health.guards import HealthGuards, needs_reference_copy, resolve_gold_rewards
from .model_loading import _TWO_EXPERTS_FULL_FINETUNE, PipelineLoading, _import_own_components, _torch_dtype
from .online_config import OnlineRLConfig
from .outputs.contact_sheet import make_contact_sheet
from .outputs.lora_export import EXPERT_LORA_WEIGHTS_NAMES, save_diffusers_lora
from .outputs.media import encode_gif, is_video, tensorboard_video_summary, video_grid
from .rollout.pipeline import RolloutPipeline, _seed_for
from .rollout.sound import audio_reward_names, check_audio_rewards
from .run_state.ema import EMAWeights
from .run_state.old_policy import OLD_POLICY_ADAPTER, OldPolicy, build_old_policy, old_adapter_left_out

logger = logging.get_logger(__name__)

EMA_STATE_NAME = "ema_state.pt"


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


def _finite_mean(values: list[float]) -> float:
    """The mean of the values that are not NaN (NaN when none is: e.g. a metric every sample of a step lacked)."""
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else math.nan


class _StepHooks(TrainerCallback):
    """Keeps the trainer's micro-step counter, EMA and per-step hook in step with Trainer's loop (also after
    resuming)."""

    def __init__(self, trainer: OnlineRLTrainer):
        self.trainer = trainer
        self._startup_logged = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._micro_step = state.global_step * args.gradient_accumulation_steps
        self.trainer._buffer = None
        self.trainer._pending_scoring = None
        # Trainer re-points the handler at the raw model when training starts; diffusers configs lack
        # ``to_json_string``, which the tensorboard callback calls.
        handler = self.trainer.callback_handler
        if not isinstance(handler.model, _CallbackModelView):
            handler.model = _CallbackModelView(handler.model)

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        if not self._startup_logged:
            # Seconds from the start of this process to the end of its first optimizer step (imports, loading,
            # set-up and one step): logged once, with that step's metrics, as timing/startup.
            self._startup_logged = True
            import psutil

            t._metrics["train"]["timing/startup"].append(time.time() - psutil.Process().create_time())
        if t.ema is not None and not t.last_step_skipped:  # a skipped (non-finite) step changed no weight
            t.ema.update(t._trainable_parameters(), state.global_step)
        t._on_optimizer_step_end(state.global_step)
        t._health_step_end(state.global_step)
        if args.log_images_steps and state.global_step % args.log_images_steps == 0 and t._last_samples:
            t._log_images(*t._last_samples, step=state.global_step, notes=t._last_sample_notes)



class OnlineRLTrainer(HealthGuards, RolloutPipeline, Evaluation, PipelineLoading, FlowBaseTrainer):
    """The machinery every online-RL trainer shares (see the module docstring); subclasses add the algorithm.

    Args:
        model: a hub id or local folder of a diffusers pipeline, or a loaded ``DiffusionPipeline`` (SD3/SD3.5,
            FLUX.1, Qwen-Image, Wan, FLUX.1 Kontext, Qwen-Image-Edit). Its transformer is trained; everything else
            is frozen.
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
        # Cheap validation first: rewards and datasets fail before any model is loaded.
        self.reward_set: RewardSet = resolve_reward_funcs(reward_funcs, args.reward_weights, args.reward_kwargs,
                                                          num_workers=args.reward_num_workers,
                                                          on_failure=args.reward_on_failure,
                                                          offload=args.reward_offload)
        self.gold_reward_set: RewardSet | None = resolve_gold_rewards(args, self.reward_set)
        self._audio_rewards = audio_reward_names(self.reward_set, self.gold_reward_set)
        self._check_health_setup(args)
        train_dataset = IndexedPromptDataset.wrap(train_dataset, "train_dataset")
        eval_dataset = IndexedPromptDataset.wrap(eval_dataset, "eval_dataset")
        check_prompt_cache_capacity(args, train_dataset, eval_dataset)
        if args.quantization and not torch.cuda.is_available():
            raise ValueError(f"quantization={args.quantization!r} loads the transformer with bitsandbytes, which "
                             "needs a CUDA GPU; unset quantization on this machine.")
        if args.quantization and peft_config is None:
            raise ValueError("A quantized transformer cannot be fully fine-tuned; pass a LoRA peft_config.")
        index = self._pipeline_index(model, pipeline_kwargs or {})
        self._check_family_settings(index, args, peft_config, (train_dataset, eval_dataset))
        self.generation_settings = resolve_trainer_settings(model, args, index, pipeline_kwargs)
        if self._audio_rewards and index and "_class_name" in index:
            check_audio_rewards(family_adapter_class(index["_class_name"]), self._audio_rewards)
        _import_own_components(index)

        self.model_dtype = _torch_dtype(args.dtype)
        pipeline = self._load_pipeline(model, args, pipeline_kwargs or {})
        self.generation_settings = self.generation_settings or resolve_trainer_settings(pipeline, args)
        self.pipeline = pipeline
        self.adapter = get_family_adapter(pipeline, num_frames=args.num_frames)
        check_audio_rewards(type(self.adapter), self._audio_rewards)
        if len(self.adapter.transformers()) > 1 and peft_config is None:
            raise ValueError(_TWO_EXPERTS_FULL_FINETUNE)
        if peft_config is not None and not getattr(peft_config, "target_modules", None):
            peft_config = copy.deepcopy(peft_config)
            peft_config.target_modules = set(self.adapter.default_lora_target_modules)
        self._card_base_model = model if isinstance(model, str) else getattr(pipeline, "name_or_path", None)
        self._card_rewards = list(self.reward_set.names)
        # FLUX.2's reference images are optional: its card says image-to-image only when the data holds images.
        edits = self.adapter.accepts_images and (not self.adapter.images_optional or (
            train_dataset is not None and len(train_dataset) > 0 and IMAGE_COLUMN in train_dataset[0]))
        self._card_pipeline_tag = ("image-to-video" if edits else "text-to-video") if self.adapter.is_video else (
            "image-to-image" if edits else "text-to-image")
        if len(self.adapter.transformers()) > 1:
            self._card_second_expert_lora = EXPERT_LORA_WEIGHTS_NAMES["transformer_2"]

        for component in pipeline.components.values():
            if isinstance(component, torch.nn.Module):
                component.requires_grad_(False)
                component.eval()
        transformer = self.adapter.trainable_module()

        # Identical LoRA init on every rank: seed before building the adapter.
        set_seed(args.seed)
        self.ref_model = None
        if peft_config is not None:
            from peft import get_peft_model

            transformer = get_peft_model(transformer, peft_config)
            for p in transformer.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        else:
            transformer.requires_grad_(True)
            if self._needs_reference(args) or needs_reference_copy(args):  # the loss, or the health guards
                self.ref_model = copy.deepcopy(transformer).requires_grad_(False).eval()
        self.is_peft = peft_config is not None

        self._transformer_checkpointing = bool(args.gradient_checkpointing or args.activation_checkpointing)
        if self._transformer_checkpointing:
            for module in self.adapter.transformers():
                module.enable_gradient_checkpointing()
            args.gradient_checkpointing = args.activation_checkpointing = False

        scheduler = FlowMatchSDEScheduler.from_config(self.adapter.sde_scheduler_config(), **self._scheduler_options(args))
        pipeline.scheduler = scheduler
        self.sde_scheduler = scheduler

        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._buffer: list[dict] | None = None
        self._micro_step = 0
        self._last_samples: tuple | None = None
        self._last_sample_notes: list[str] | None = None
        self._last_eval: dict | None = None
        self._eval_baseline = EvaluationBaseline()
        if args.ddp_find_unused_parameters is None:  # read by Trainer when it builds the accelerator, just below
            args.ddp_find_unused_parameters = self.adapter.may_leave_weights_unused

        super().__init__(
            model=transformer, args=args, data_collator=_identity_collator, train_dataset=train_dataset,
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
        model_parameters = sum(p.numel() for module in self.adapter.transformers() for p in module.parameters())
        self.cpu_thread_plan = apply_cpu_thread_plan(plan_cpu_threads(args.cpu_threads, on_cpu=device.type == "cpu",
                                                                      model_parameters=model_parameters))
        if self.cpu_thread_plan is not None:
            logger.info("CPU threads: %s", self.cpu_thread_plan.describe())
        self._thread_yield_hooks = install_main_thread_yield(self.adapter.transformers())
        trained = {id(module) for module in self.adapter.transformers()}
        for component in pipeline.components.values():
            if isinstance(component, torch.nn.Module) and id(component) not in trained:
                if all(p.dtype == self.model_dtype for p in component.parameters()):
                    component.to(device=device)  # no cast asked for: diffusers then has nothing to warn about
                else:
                    component.to(device=device, dtype=self.model_dtype)
        if self.ref_model is not None:
            self.ref_model.to(device)
        self.ema = None
        if args.use_ema:
            self.ema = EMAWeights(self._trainable_parameters(), args.ema_decay, args.ema_update_interval,
                                  args.ema_warmup)
        # Diagnostics, alarms and guards (health/guards.py): the reference policy, early stopping, reference refresh.
        self._setup_health()
        # The negative prompt's embedding; per source image instead (see _encode_unique) when it depends on it.
        self._negative_embeds = None
        if not self.adapter.negative_depends_on_image:
            with torch.no_grad():
                self._negative_embeds = self.adapter.encode_prompts([args.negative_prompt],
                                                                    args.max_sequence_length, device)
        # Embedding cache and text-encoder offload (prompt_cache.py): filled, then the encoders leave the device.
        self.prompt_cache = setup_prompt_cache(args, self.adapter, pipeline, device,
                                               (self.train_dataset, self.eval_dataset), self.accelerator.autocast)
        # A second copy of the policy (DiffusionNFT's old policy, AWM's EMA adapter), saved in every checkpoint.
        self.old_policy: OldPolicy | None = None
        if self._uses_old_policy(args):
            self.old_policy = build_old_policy(self.model, self.is_peft)

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
            seed=self.args.seed,
        )

    def get_train_dataloader(self):
        # One dataloader batch per process = that process's share of a generation batch.
        original = self._train_batch_size
        self._train_batch_size = self.args.per_device_train_batch_size * self.args.steps_per_generation
        try:
            return super().get_train_dataloader()
        finally:
            self._train_batch_size = original

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.accelerator.unwrap_model(self.model).parameters() if p.requires_grad]

    @contextmanager
    def _generation_context(self):
        """No grad, eval mode, mixed-precision autocast, and (ZeRO-3) parameters gathered once per rollout."""
        model = self.model_wrapped
        was_training = model.training
        gather = nullcontext()
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        model.eval()
        try:
            with torch.no_grad(), gather, self.accelerator.autocast():
                yield model
        finally:
            model.train(was_training)

    # --- pieces of a trainer's _train_on_batch ------------------------------------------------------------------
    def _backward_kwargs(self) -> dict:
        """Extra ``accelerator.backward`` arguments: the losses are already divided by the accumulation steps, so
        DeepSpeed must not divide them again."""
        from accelerate.utils import DistributedType

        return {"scale_wrt_gas": False} if self.accelerator.distributed_type == DistributedType.DEEPSPEED else {}

    @staticmethod
    def _sync_on_last(model, part: int, parts: int):
        """A batch trained in ``parts`` backward passes: under DDP only the last one all-reduces the gradients."""
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        return model.no_sync() if ddp and part < parts - 1 else nullcontext()

    # ---- the algorithm's hooks ------------------------------------------------------------------------
    def _scheduler_options(self, args: OnlineRLConfig) -> dict[str, Any]:
        """Keyword arguments of the `FlowMatchSDEScheduler` built from the pipeline's scheduler config (called while
        the trainer is built, before ``self.args`` is set)."""
        return {}

    def _sde_type(self) -> str:
        """The stochastic step of ``_sample``'s SDE window (irrelevant for deterministic sampling)."""
        return "sde"

    def _eval_ode_solver(self) -> str:
        """The deterministic solver of evaluation samples."""
        return "euler"

    def _rollout_plan(self, gen_index: int) -> Any:
        """What every micro-batch of generation ``gen_index`` shares (Flow-GRPO: the SDE window); passed to
        ``_rollout``. A function of the step and the seed, so that a resumed run continues it."""
        return None

    def _rollout(self, model, embeds: PromptEmbeds, plan: Any, generator: torch.Generator, progress,
                 group_ids: torch.Tensor, gen_index: int) -> tuple[torch.Tensor, dict]:
        """Sample one micro-batch under ``torch.no_grad`` with ``model`` (the trained policy, in eval mode):
        returns the final latents (decoded and scored) and what ``_train_on_batch`` needs of it."""
        raise NotImplementedError

    def _train_on_batch(self, model, batch: dict, first_pass: bool) -> torch.Tensor:
        """Loss and backward passes of one recorded micro-batch (``first_pass``: the first pass over a fresh
        generation); returns the loss's value (detached, already scaled for gradient accumulation)."""
        raise NotImplementedError

    def _on_optimizer_step_end(self, step: int) -> None:
        """Called after each optimizer step ``step`` (1-based), before logging and checkpointing."""

    def _needs_reference(self, args: OnlineRLConfig) -> bool:
        """Whether the loss reads the reference policy (full fine-tuning then keeps a frozen copy; LoRA training
        disables the adapter instead): with a KL term, ``beta > 0``."""
        return args.beta > 0

    def _uses_old_policy(self, args: OnlineRLConfig) -> bool:
        """Whether the trainer keeps a second copy of the policy, ``self.old_policy`` (`run_state/old_policy.py`: a
        second LoRA adapter, or a frozen copy for full fine-tuning), updated by ``_update_old_policy``, saved in every
        checkpoint and left out of exports."""
        return False

    def _card_setup_lines(self) -> list[str]:
        """The model card's "Training setup" lines (markdown list items) besides the step count."""
        return []

    # ------------------------------------------------------------------------------------------------
    # training
    # ------------------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        args = self.args
        period = args.steps_per_generation * args.num_iterations
        if self._micro_step % period == 0 or self._buffer is None:
            self._buffer = self._generate_and_score(inputs)
        position = self._micro_step % period
        first_pass = position < args.steps_per_generation
        batch = self._buffer[position % args.steps_per_generation]
        self._micro_step += 1

        tic = time.perf_counter()
        model.train()
        loss = self._train_on_batch(model, batch, first_pass)
        self._metrics["train"]["timing/training"].append(time.perf_counter() - tic)
        return loss

    def _update_old_policy(self, decay: float) -> None:
        """theta_old <- decay theta_old + (1 - decay) theta, unless the step was skipped (a non-finite step changed no
        weight). Under DeepSpeed ZeRO-3 the trained and old tensors are gathered while they are updated (every process
        computes the same values; process 0's are kept)."""
        if self.last_step_skipped:
            return
        gather = nullcontext()
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            import deepspeed

            tensors = [p for pair in self.old_policy.pairs for p in pair if hasattr(p, "ds_id")]
            gather = deepspeed.zero.GatheredParameters(tensors, modifier_rank=0)
        with gather:
            self.old_policy.update(decay)

    # ------------------------------------------------------------------------------------------------
    # logging
    # ------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        metrics = {k: _finite_mean(v) for k, v in self._metrics[mode].items()}
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        logs = {**logs, **metrics}
        super().log(logs, start_time)
        self._metrics[mode].clear()

    def _log_images(self, images: list, prompts: list[str], rewards: list[float], step: int,
                    notes: list[str] | None = None) -> None:
        """Sample images (or videos) with prompts, rewards and the rewards' notes (e.g. why GenEval failed an image)
        to every image-capable ``report_to`` backend.

        TensorBoard: a contact sheet (``samples``; videos show their first, middle and last frame), the captions, and
        for videos all samples tiled into one animated GIF (``samples/video``). wandb: ``samples`` holds one image, or
        one GIF video, per sample.
        """
        if not self.is_world_process_zero() or not images:
            return
        import io

        from transformers.integrations import TensorBoardCallback, WandbCallback

        notes = notes or [""] * len(prompts)
        captions = [f"{p[:120]} | reward={r:.3f}" + (f" | {n}" if n else "") for p, r, n in zip(prompts, rewards, notes)]
        videos = all(is_video(im) for im in images)
        fps = self.args.log_video_fps
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback) and getattr(cb, "tb_writer", None) is not None:
                sheet = np.asarray(make_contact_sheet(images, captions))
                cb.tb_writer.add_image("samples", sheet, global_step=step, dataformats="HWC")
                if videos:
                    summary = tensorboard_video_summary("samples/video", video_grid(images), fps)
                    cb.tb_writer._get_file_writer().add_summary(summary, step)
                cb.tb_writer.add_text("samples/prompts", "\n\n".join(captions), global_step=step)
                cb.tb_writer.flush()
            if isinstance(cb, WandbCallback) and getattr(cb, "_wandb", None) is not None and cb._wandb.run:
                wandb = cb._wandb
                if videos:
                    media = [wandb.Video(io.BytesIO(encode_gif(v, fps)), format="gif", caption=c)
                             for v, c in zip(images, captions)]
                else:
                    media = [wandb.Image(im, caption=c) for im, c in zip(images, captions)]
                wandb.log({"samples": media, "train/global_step": step})

    # ------------------------------------------------------------------------------------------------
    # saving and resuming
    # ------------------------------------------------------------------------------------------------
    # (HealthGuards._save_checkpoint sets _in_checkpoint while a checkpoint is written: the old policy and the
    # health state go into checkpoints, not into exports)
    def _save_trainer_files(self, output_dir: str, state_dict=None) -> None:
        """``Trainer``'s own save of the trained model (peft adapter files, or the transformer's weights); exports
        leave the old-policy adapter out, and every save the reference adapter (saved by `ReferencePolicy.save`)."""
        export = self.old_policy is not None and self.is_peft and not self._in_checkpoint
        with old_adapter_left_out(self.accelerator.unwrap_model(self.model)) if export else nullcontext(), \
                self._reference_adapter_left_out():
            super()._save(output_dir, state_dict=state_dict)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        output_dir = output_dir or self.args.output_dir
        self._save_trainer_files(output_dir, state_dict=state_dict)
        if not self.args.should_save:
            return
        unwrapped = self.accelerator.unwrap_model(self.model)
        ema_ctx = self.ema.swapped_in(self._trainable_parameters()) if self.ema is not None else nullcontext()
        # A gathered state dict (FSDP full state dict) is authoritative; otherwise the live (or EMA) weights.
        ema_ctx = ema_ctx if state_dict is None else nullcontext()
        with ema_ctx:
            if self.is_peft:
                save_diffusers_lora(self.adapter.lora_writer(), output_dir, unwrapped, state_dict=state_dict)
            elif state_dict is not None:
                from safetensors.torch import save_file

                folder = os.path.join(output_dir, "transformer")
                os.makedirs(folder, exist_ok=True)
                unwrapped.save_config(folder)
                save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
                          os.path.join(folder, "diffusion_pytorch_model.safetensors"))
            else:
                unwrapped.save_pretrained(os.path.join(output_dir, "transformer"))
        if self.ema is not None:
            torch.save(self.ema.state_dict(), os.path.join(output_dir, EMA_STATE_NAME))
        if self.old_policy is not None and self._in_checkpoint:
            self.old_policy.save(output_dir)
        self._save_health_state(output_dir)  # checkpoints: health_state.json and the refreshed reference

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.old_policy is not None and self.is_peft and \
                not os.path.isdir(os.path.join(resume_from_checkpoint, OLD_POLICY_ADAPTER)):
            raise ValueError(f"{resume_from_checkpoint} holds no old-policy adapter ({OLD_POLICY_ADAPTER}/): it was "
                             f"not written by {type(self).__name__} with the same settings, so the run cannot "
                             f"continue exactly. Resume from a {self._name} checkpoint, or start a new run.")
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        path = os.path.join(resume_from_checkpoint, EMA_STATE_NAME)
        if self.ema is not None and os.path.exists(path):
            self.ema.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        if self.old_policy is not None:
            self.old_policy.load(resume_from_checkpoint)
        self._load_health_state(resume_from_checkpoint)

    def _card_extra_sections(self) -> str:
        lines = ["## Training setup", "", *self._card_setup_lines(), f"- optimizer steps: {self.state.global_step}"]
        if self._last_eval:
            lines += ["", "## Evaluation (last run)", ""]
            lines += [f"- {k}: {v:.4f}" for k, v in self._last_eval["metrics"].items()]
        lines += self._card_best_lines()
        return "\n".join(lines)


__all__ = ["EMA_STATE_NAME", "OnlineRLTrainer", "_seed_for"]
