"""OnlineRLTrainer: what every online-RL trainer of a flow-matching pipeline here shares, on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout.* The generation batch holds ``generation_batch_size / G`` prompts, each G times. Each unique prompt
   is encoded once (or read from the embedding cache). Images are sampled in micro-batches by the algorithm's
   ``_rollout`` (Flow-GRPO: SDE steps in a window, recording the window's transitions; DiffusionNFT: a deterministic
   solver run by the old policy, keeping only the final latent).
2. *Reward.* Each micro-batch is decoded once, in a background thread, and scored by the reward pool while the
   next micro-batch is sampled. The last micro-batch's rewards are still being scored while the first training
   forward runs; then rewards are gathered from all processes and turned into group advantages as in
   ``advantages.py`` (stored in each micro-batch's record as ``"advantages"``).
3. *Training.* The algorithm's ``_train_on_batch`` computes its loss on one recorded micro-batch and runs the
   backward passes; it calls ``_resolve_scoring()`` once its first forward has run.

Shared besides: loading the pipeline and its family adapter, LoRA or full fine-tuning with a reference policy,
the prompt cache, EMA, evaluation (deterministic sampling with fixed seeds), logging (metrics, sample images and
videos), saving (the diffusers LoRA, EMA state), the model card and the Hub push (`base.FlowBaseTrainer`), crash
safety (`crash_safety.CrashSafeTrainerMixin`).

What a subclass provides: ``_config_class``, ``_name`` / ``_tag_names`` / ``_paper`` (model card), ``_rollout`` (and
optionally ``_rollout_plan``), ``_train_on_batch``, ``_card_setup_lines``; optional hooks: ``_scheduler_options``,
``_sde_type``, ``_eval_ode_solver``, ``_on_optimizer_step_end``.
"""

from __future__ import annotations

import copy
import math
import os
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from torch.utils.data import Dataset
from transformers import TrainerCallback
from transformers.trainer_utils import set_seed
from transformers.utils import logging

from ..cpu_threads import apply_cpu_thread_plan, limit_worker_threads, plan_cpu_threads
from ..models import PromptEmbeds, family_adapter_class, get_family_adapter
from ..rewards import RewardResult, RewardSet, resolve_reward_funcs
from ..rewards.composition import metric_means
from ..schedulers import FlowMatchSDEScheduler, FlowODESolver, rollout_steps, sde_step_from_sigmas
from .advantages import compute_reward_advantages
from .base import FlowBaseTrainer
from .condition_images import IMAGE_COLUMN, image_key, load_condition_image
from .contact_sheet import make_contact_sheet
from .datasets import INDEX_COLUMN, IndexedPromptDataset
from .ema import EMAWeights
from .eval_change import EvaluationBaseline
from .lora_export import EXPERT_LORA_WEIGHTS_NAMES, save_diffusers_lora
from .media import encode_gif, is_video, tensorboard_video_summary, video_grid
from .online_config import OnlineRLConfig
from .prompt_cache import check_prompt_cache_capacity, setup_prompt_cache
from .sampler import RepeatSampler
from .sliced_decode import decode_in_slices

logger = logging.get_logger(__name__)

EMA_STATE_NAME = "ema_state.pt"

_TWO_EXPERTS_FULL_FINETUNE = (
    "This Wan 2.2 pipeline has two experts (transformer and transformer_2); training it is supported with LoRA (one "
    "adapter on each expert, each used on its own steps), not as full fine-tuning. Pass a peft_config (a "
    "peft.LoraConfig, e.g. LoraConfig(r=32, lora_alpha=64)) or use_peft: true in a recipe."
)


def _identity_collator(features: list[dict]) -> list[dict]:
    return features


def _to_pil(images: torch.Tensor) -> list:
    """Decoded pixels in [0, 1] as PIL: ``(B, 3, H, W)`` -> B images, ``(B, F, 3, H, W)`` -> B lists of F frames."""
    from PIL import Image

    if images.dim() == 5:
        return [_to_pil(video) for video in images]
    arr = (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    return [Image.fromarray(a) for a in arr]


def _import_own_components(index: dict | None) -> None:
    """Import the flowgrpo modules that ``model_index.json`` names for components (the tiny Qwen-Image-Edit pipeline's
    processor): diffusers loads a component of a custom class only once its module has been imported."""
    import importlib

    for value in (index or {}).values():
        if isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], str) \
                and value[0].startswith("flowgrpo."):
            importlib.import_module(value[0])


def _load_images(values: list) -> list:
    """The ``image`` column's values as RGB PIL images (each distinct path read once)."""
    loaded: dict[str, Any] = {}
    out = []
    for value in values:
        if isinstance(value, (str, os.PathLike)):
            key = os.fspath(value)
            if key not in loaded:
                loaded[key] = load_condition_image(value)
            out.append(loaded[key])
        else:
            out.append(load_condition_image(value))
    return out


def _done_future(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _torch_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _seed_for(*parts: int) -> int:
    """A 63-bit seed that depends on every part (deterministic, no Python hash randomisation)."""
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value ^ (int(p) + 0x9E3779B97F4A7C15 + (value << 6) + (value >> 2))) & ((1 << 63) - 1)
    return value


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
        if args.log_images_steps and state.global_step % args.log_images_steps == 0 and t._last_samples:
            t._log_images(*t._last_samples, step=state.global_step, notes=t._last_sample_notes)



class OnlineRLTrainer(FlowBaseTrainer):
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
                                                          on_failure=args.reward_on_failure)
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
        _import_own_components(index)

        self.model_dtype = _torch_dtype(args.dtype)
        pipeline = self._load_pipeline(model, args, pipeline_kwargs or {})
        self.pipeline = pipeline
        self.adapter = get_family_adapter(pipeline, num_frames=args.num_frames)
        if len(self.adapter.transformers()) > 1 and peft_config is None:
            raise ValueError(_TWO_EXPERTS_FULL_FINETUNE)
        if peft_config is not None and not getattr(peft_config, "target_modules", None):
            peft_config = copy.deepcopy(peft_config)
            peft_config.target_modules = set(self.adapter.default_lora_target_modules)
        self._card_base_model = model if isinstance(model, str) else getattr(pipeline, "name_or_path", None)
        self._card_rewards = list(self.reward_set.names)
        self._card_pipeline_tag = "text-to-video" if self.adapter.is_video else (
            "image-to-image" if self.adapter.accepts_images else "text-to-image")
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
            if args.beta > 0:
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

        device = self.accelerator.device
        model_parameters = sum(p.numel() for module in self.adapter.transformers() for p in module.parameters())
        self.cpu_thread_plan = apply_cpu_thread_plan(plan_cpu_threads(args.cpu_threads, on_cpu=device.type == "cpu",
                                                                      model_parameters=model_parameters))
        if self.cpu_thread_plan is not None:
            logger.info("CPU threads: %s", self.cpu_thread_plan.describe())
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
            self.ema = EMAWeights(self._trainable_parameters(), args.ema_decay, args.ema_update_interval)
        # The negative prompt's embedding; per source image instead (see _encode_unique) when it depends on it.
        self._negative_embeds = None
        if not self.adapter.negative_depends_on_image:
            with torch.no_grad():
                self._negative_embeds = self.adapter.encode_prompts([args.negative_prompt],
                                                                    args.max_sequence_length, device)
        # Embedding cache and text-encoder offload (prompt_cache.py): filled, then the encoders leave the device.
        self.prompt_cache = setup_prompt_cache(args, self.adapter, pipeline, device,
                                               (self.train_dataset, self.eval_dataset), self.accelerator.autocast)

    # ------------------------------------------------------------------------------------------------
    # set-up helpers
    # ------------------------------------------------------------------------------------------------
    @staticmethod
    def _pipeline_index(model: Any, pipeline_kwargs: dict) -> dict | None:
        """The pipeline's ``model_index.json`` (class name and components) without loading it; ``None`` if unknown."""
        from diffusers import DiffusionPipeline

        if isinstance(model, DiffusionPipeline):
            return {**dict(model.config), "_class_name": type(model).__name__}
        if not isinstance(model, (str, os.PathLike)):
            return None
        try:
            return dict(DiffusionPipeline.load_config(str(model), **{k: v for k, v in pipeline_kwargs.items()
                                                                      if k in ("revision", "cache_dir", "token")}))
        except Exception:  # unreadable here (e.g. offline): the same checks run right after loading
            return None

    @staticmethod
    def _check_family_settings(index: dict | None, args: OnlineRLConfig, peft_config: Any, datasets: tuple) -> None:
        """Family-specific settings, checked from the pipeline's class name (``index``: its model_index.json) before
        anything is loaded: the frame count, the source-image column of editing families, and what Wan 2.2's two
        experts support."""
        if not index or "_class_name" not in index:
            return
        adapter_cls = family_adapter_class(index["_class_name"])
        adapter_cls.check_num_frames(args.num_frames)
        if adapter_cls.accepts_images:
            for name, dataset in zip(("train_dataset", "eval_dataset"), datasets):
                if dataset is None:
                    continue
                first = dataset[0]
                if IMAGE_COLUMN not in first:
                    raise ValueError(
                        f"{index['_class_name']} edits a source image, but {name} has no '{IMAGE_COLUMN}' column "
                        f"(columns: {[k for k in first if not k.startswith('_')]}); add one holding each prompt's "
                        "source image (a path, a PIL image or a datasets.Image feature).")
                load_condition_image(first[IMAGE_COLUMN])
            if args.cache_prompt_embeddings and args.precompute_prompt_embeddings:
                raise ValueError(f"precompute_prompt_embeddings encodes the datasets' prompts alone, but "
                                 f"{index['_class_name']} encodes each (prompt, source image) pair; set "
                                 "precompute_prompt_embeddings: false (the cache then keeps each pair on first use).")
        second = index.get("transformer_2")
        if isinstance(second, (list, tuple)) and second and second[0] is not None and index.get("boundary_ratio"):
            if peft_config is None:
                raise ValueError(_TWO_EXPERTS_FULL_FINETUNE)
            if args.quantization:
                raise ValueError("quantization loads one quantized transformer, but this Wan 2.2 pipeline has two "
                                 "experts; train its LoRAs without quantization.")

    def _load_pipeline(self, model: Any, args: OnlineRLConfig, pipeline_kwargs: dict):
        from diffusers import DiffusionPipeline

        if isinstance(model, DiffusionPipeline):
            if args.quantization:
                raise ValueError("quantization applies when loading from a hub id or folder; pass the model id, or "
                                 "quantize the pipeline's transformer yourself.")
            return model
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a hub id, a local folder or a DiffusionPipeline, got {type(model)}")
        kwargs = dict(pipeline_kwargs)
        if "torch_dtype" not in kwargs:  # diffusers' older name, still accepted when a caller passes it
            kwargs.setdefault("dtype", self.model_dtype)
        if args.quantization:
            kwargs["transformer"] = self._load_quantized_transformer(str(model), args, pipeline_kwargs)
        return DiffusionPipeline.from_pretrained(str(model), **kwargs)

    def _load_quantized_transformer(self, model: str, args: OnlineRLConfig, pipeline_kwargs: dict):
        from diffusers import DiffusionPipeline

        from .quantization import build_quantization_config

        config = DiffusionPipeline.load_config(model, **{k: v for k, v in pipeline_kwargs.items()
                                                          if k in ("revision", "cache_dir", "token")})
        library, class_name = config["transformer"]
        import diffusers

        cls = getattr(diffusers, class_name)
        return cls.from_pretrained(model, subfolder="transformer", dtype=self.model_dtype,
                                   quantization_config=build_quantization_config(args.quantization, self.model_dtype),
                                   **pipeline_kwargs)

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

    # Overlaps (on by default; switchable for measuring what each buys, see docs/benchmarks.md): decode each
    # rollout micro-batch in a background thread, and let the first training forward run while the last rewards
    # are being scored (advantages are only needed by the loss).
    _overlap_decode = True
    _overlap_reward_with_training = True
    _postprocess_pool: ThreadPoolExecutor | None = None
    _pending_scoring: tuple | None = None

    # Set by the benchmark harness on a GPU: synchronise before reading the clock, so that the phase timings are
    # those of the kernels and not of their launches. Off by default (a synchronisation stalls the pipeline).
    _timing_sync = False

    def _clock(self) -> float:
        if self._timing_sync and self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)
        return time.perf_counter()

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

    # ------------------------------------------------------------------------------------------------
    # rollouts
    # ------------------------------------------------------------------------------------------------
    def _encode_unique(self, prompts: list[str], device, images: list | None = None,
                       guidance_scale: float | None = None) -> tuple[PromptEmbeds, torch.Tensor]:
        """Encode each distinct prompt (editing families: each distinct (prompt, source image) pair) once; returns the
        embeddings and, per sample, its row. With CFG and a negative embedding that depends on the source image,
        the negative prompt is encoded once per pair too (``PromptEmbeds.negative``)."""
        args = self.args
        if images is None or not self.adapter.accepts_images:
            images = None
        guidance = args.guidance_scale if guidance_scale is None else guidance_scale
        per_image_negative = (images is not None and self.adapter.negative_depends_on_image
                              and self.adapter.uses_cfg(guidance))
        if self.prompt_cache is not None and not per_image_negative:
            return self.prompt_cache.encode_unique(prompts, device, conditions=images)
        keys = list(prompts) if images is None else [(p, image_key(im)) for p, im in zip(prompts, images)]
        unique: dict[Any, int] = {}
        rows = [unique.setdefault(k, len(unique)) for k in keys]
        first = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        unique_prompts = [prompts[first[k]] for k in unique]
        unique_images = [images[first[k]] for k in unique] if images is not None else None
        height, width = args.image_size
        embeds = self.adapter.encode_prompts(unique_prompts, args.max_sequence_length, device, images=unique_images,
                                             height=height, width=width)
        if per_image_negative:
            embeds.negative = self.adapter.encode_prompts([args.negative_prompt] * len(unique_prompts),
                                                          args.max_sequence_length, device, images=unique_images,
                                                          height=height, width=width)
        return embeds, torch.tensor(rows, dtype=torch.long)

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

    def _await_scoring(self, tic: float) -> float:
        """Wait for the rollout's rewards (scored while the first training forward ran) and return ``tic`` moved
        by the wait, so that the wait is logged as ``timing/reward``, not as forward time."""
        wait = self._clock()
        self._resolve_scoring()
        return tic + self._clock() - wait

    def _velocity(self, model, latents, timestep, embeds, guidance_scale, height, width):
        neg = None
        if self.adapter.uses_cfg(guidance_scale):
            neg = embeds.negative if embeds.negative is not None else (
                self._negative_embeds.expand_to(latents.shape[0]) if self._negative_embeds is not None else None)
        v = self.adapter.predict_velocity(model, latents.to(self.model_dtype), timestep, embeds, guidance_scale, neg,
                                          height, width)
        return v.float()

    def _sample(self, model, embeds: PromptEmbeds, num_steps: int, guidance_scale: float, noise_level: float,
                window: tuple[int, int], generator: torch.Generator, record: bool, progress=None, *,
                ode_solver: str = "euler", ode_compression_ratio: float = 1.0,
                initial_latents: torch.Tensor | None = None, record_means: bool = False):
        """Sample one micro-batch. Returns the final latents and (if ``record``) the window's trajectory.

        Steps inside ``window`` are SDE steps (noise from ``generator``); the others are deterministic, solved by
        ``ode_solver`` (``"euler"`` or ``"dpmpp_2m"``; the DPM-Solver history restarts after the window), and with
        ``ode_compression_ratio < 1`` the steps after the window are fewer solver steps over the same noise range
        (`rollout_steps`). ``window=(0, 0)`` samples a whole deterministic trajectory. ``initial_latents`` replaces
        the initial noise drawn from ``generator``; ``record_means`` also stores each window step's transition
        mean (``"means"``, for GRPO-Guard).
        """
        args = self.args
        height, width = args.image_size
        device = self.accelerator.device
        batch = len(embeds)
        self.adapter.set_timesteps(self.sde_scheduler, num_steps, height, width, device)
        sigmas = self.sde_scheduler.sigmas.to(device=device, dtype=torch.float32)
        timesteps = self.sde_scheduler.timesteps.to(device)
        if initial_latents is None:
            latents = self.adapter.prepare_latents(batch, height, width, generator, device, torch.float32)
        else:
            latents = initial_latents.to(device=device, dtype=torch.float32)
        traj = {"latents": [], "next_latents": [], "log_probs": [], "timesteps": [], "sigmas": [], "sigmas_next": []}
        if record_means:
            traj["means"] = []
        solver = FlowODESolver(ode_solver) if ode_solver != "euler" else None
        plan = rollout_steps(sigmas, timesteps, window, ode_compression_ratio,
                             self.sde_scheduler.config.num_train_timesteps)
        for step in plan:
            t = step.timestep.expand(batch)
            v = self._velocity(model, latents, t, embeds, guidance_scale, height, width)
            if step.stochastic or solver is None:
                out = sde_step_from_sigmas(
                    v, latents, step.sigma, step.sigma_next, noise_level=noise_level if step.stochastic else 0.0,
                    sde_type=self._sde_type(), generator=generator, sigma_max_fallback=float(sigmas[1]),
                )
                if solver is not None:
                    solver.reset()  # a deterministic stretch after the window starts a new history
                if record and step.stochastic:
                    traj["latents"].append(latents)
                    traj["next_latents"].append(out.prev_sample)
                    traj["log_probs"].append(out.log_prob)
                    traj["timesteps"].append(t)
                    traj["sigmas"].append(step.sigma.expand(batch))
                    traj["sigmas_next"].append(step.sigma_next.expand(batch))
                    if record_means:
                        traj["means"].append(out.prev_sample_mean)
                latents = out.prev_sample
            else:
                latents = solver.step(latents, v, step.sigma, step.sigma_next, final=step.final)
            if progress is not None:
                progress.update(1)
        if progress is not None and len(plan) < num_steps:
            progress.update(num_steps - len(plan))
        stacked = {k: torch.stack(v, dim=1) for k, v in traj.items()} if record else None
        return latents, stacked

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

    def _card_setup_lines(self) -> list[str]:
        """The model card's "Training setup" lines (markdown list items) besides the step count."""
        return []

    def _generation_index(self) -> int:
        return self._micro_step // (self.args.steps_per_generation * self.args.num_iterations)

    def _generate_and_score(self, inputs: list[dict]) -> list[dict]:
        """Rollout + rewards + advantages for this process's share of a generation batch, split in micro-batches.

        Returns one record per micro-batch: what the algorithm's ``_rollout`` recorded, plus ``"embeds"`` and (once
        the rewards are in, `_resolve_scoring`) ``"advantages"``.
        """
        args = self.args
        device = self.accelerator.device
        height, width = args.image_size
        gen_index = self._generation_index()
        prompts = [row["prompt"] for row in inputs]
        group_ids = torch.tensor([row[INDEX_COLUMN] for row in inputs], dtype=torch.long)
        columns = {k: [row[k] for row in inputs] for k in inputs[0] if k not in ("prompt", INDEX_COLUMN)}
        if IMAGE_COLUMN in columns:  # source images: conditioning (editing families) and a column for the rewards
            columns[IMAGE_COLUMN] = _load_images(columns[IMAGE_COLUMN])

        plan = self._rollout_plan(gen_index)
        noise_gen = torch.Generator().manual_seed(_seed_for(args.seed, gen_index, self.accelerator.process_index))
        micro = args.per_device_train_batch_size
        chunks = [slice(s, s + micro) for s in range(0, len(prompts), micro)]

        t0 = self._clock()
        timing = defaultdict(float)
        jobs, samples = [], []
        from tqdm.auto import tqdm

        progress = tqdm(total=len(chunks) * args.num_inference_steps, desc="rollout", leave=False,
                        disable=args.disable_tqdm or not self.is_local_process_zero())
        overlap_decode = self._overlap_decode
        with self._generation_context() as model:
            tic = self._clock()
            unique_embeds, rows = self._encode_unique(prompts, device, columns.get(IMAGE_COLUMN), args.guidance_scale)
            embeds_all = unique_embeds.index_select(rows)
            timing["text_encoding"] += self._clock() - tic
            for sl in chunks:
                embeds = embeds_all[sl]
                tic = self._clock()
                final, record = self._rollout(model, embeds, plan, noise_gen, progress, group_ids[sl], gen_index)
                timing["rollout"] += self._clock() - tic
                chunk_columns = {k: v[sl] for k, v in columns.items()}
                if overlap_decode:
                    # Decode and score in the background while the next micro-batch is sampled.
                    jobs.append(self._postprocess_executor().submit(self._decode_and_submit, final, prompts[sl],
                                                                    chunk_columns))
                else:
                    jobs.append(_done_future(self._decode_and_submit(final, prompts[sl], chunk_columns)))
                record["embeds"] = embeds
                samples.append(record)
        progress.close()
        timing["sampling_total"] = self._clock() - t0
        self._pending_scoring = (jobs, samples, chunks, prompts, group_ids, timing)
        if not self._overlap_reward_with_training:
            self._resolve_scoring()
        return samples

    def _postprocess_executor(self) -> ThreadPoolExecutor:
        if self._postprocess_pool is None:
            self._postprocess_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowgrpo-decode",
                                                        initializer=limit_worker_threads)
            weakref.finalize(self, self._postprocess_pool.shutdown, wait=False)
        return self._postprocess_pool

    def _decode_and_submit(self, final: torch.Tensor, prompts: list[str], columns: dict):
        """Decode one micro-batch (once) and hand it to the reward pool; returns (images, reward future, seconds)."""
        height, width = self.args.image_size
        tic = self._clock()
        # Grad mode and autocast are thread-local: set them here too (this may run in the decode thread).
        with torch.no_grad(), self.accelerator.autocast():
            pil = _to_pil(decode_in_slices(self.adapter.decode, final.to(self.model_dtype), height, width,
                                           self.args.vae_decode_batch_size))
        seconds = self._clock() - tic
        return pil, self.reward_set.submit(prompts, pil, **columns), seconds

    def _resolve_scoring(self) -> None:
        """Wait for the pending rollout's rewards; gather them, compute advantages into its buffers, log metrics."""
        if self._pending_scoring is None:
            return
        jobs, samples, chunks, prompts, group_ids, timing = self._pending_scoring
        self._pending_scoring = None
        args = self.args
        device = self.accelerator.device
        tic = self._clock()
        decoded, results, reward_error = [], [], None
        for job in jobs:
            pil, reward_future, decode_seconds = job.result()
            decoded.append(pil)
            timing["vae_decode"] += decode_seconds
            try:
                results.append(reward_future.result())
            except Exception as err:  # on_failure="raise": stop every process, after saving the last step
                reward_error = reward_error or err
        timing["reward_wait"] = self._clock() - tic
        self._raise_if_reward_failed(reward_error)

        # ---- gather rewards, advantages --------------------------------------------------------------
        def as_tensor(values):
            return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32,
                                device=device)

        totals = as_tensor([v for r in results for v in r.total])
        per_reward = {name: as_tensor([v for r in results for v in r.per_reward[name]])
                      for name in self.reward_set.names}
        g_totals = self.accelerator.gather(totals).cpu()
        g_groups = self.accelerator.gather(group_ids.to(device)).cpu()
        g_per_reward = {n: self.accelerator.gather(t).cpu() for n, t in per_reward.items()}
        advantages, stats = compute_reward_advantages(
            g_totals, g_per_reward, dict(zip(self.reward_set.names, self.reward_set.weights)), g_groups,
            args.scale_rewards, args.adv_clip_max, args.reward_aggregation,
        )
        n_local = len(prompts)
        rank = self.accelerator.process_index
        local_adv = advantages[rank * n_local:(rank + 1) * n_local].to(device)

        m = self._metrics["train"]
        m["reward"].append(stats.reward_mean)
        m["reward_std"].append(stats.reward_std)
        m["frac_reward_zero_std"].append(stats.frac_reward_zero_std)
        failed = torch.tensor([sum(r.failed.get(n, 0) for r in results) for n in self.reward_set.names],
                              dtype=torch.float32, device=device)
        g_failed = self.accelerator.gather(failed).cpu().view(-1, len(self.reward_set.names)).sum(0)
        for k, (name, vals) in enumerate(g_per_reward.items()):
            valid = vals[~torch.isnan(vals)]
            m[f"rewards/{name}/mean"].append(float(valid.mean()) if valid.numel() else math.nan)
            m[f"rewards/{name}/std"].append(float(valid.std(unbiased=False)) if valid.numel() else math.nan)
            m[f"rewards/{name}/failed"].append(float(g_failed[k]))  # samples scored None by on_failure="skip"
        # Metrics a reward defines itself (RewardOutput.metrics, e.g. GenEval's accuracy per task), over all processes.
        metric_sums = RewardResult.concatenate(results).metric_sums() if results else {}
        for key, mean in metric_means(gather_object([metric_sums]) if self.accelerator.num_processes > 1
                                      else [metric_sums]).items():
            m[f"rewards/{key}"].append(mean)
        # sampling: the rollout phase (text encoding, sampling, decoding unless it runs in the background);
        # reward: the time spent waiting for decoding and rewards that did not overlap anything.
        m["timing/sampling"].append(timing["sampling_total"])
        m["timing/reward"].append(timing["reward_wait"])
        for key in ("text_encoding", "rollout", "vae_decode"):
            m[f"timing/{key}"].append(timing[key])
        self._last_timing = dict(timing)

        flat_images = [im for chunk in decoded for im in chunk]
        totals_list = totals.cpu().tolist()
        self._last_samples = (flat_images[: args.num_log_images], prompts[: args.num_log_images],
                              totals_list[: args.num_log_images])
        self._last_sample_notes = [note for r in results for note in r.image_notes()][: args.num_log_images]
        for sl, traj in zip(chunks, samples):
            traj["advantages"] = local_adv[sl]

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

    def _reference_velocity(self, model, x, t, embeds, height, width):
        """Velocity under the reference policy (LoRA disabled, or the frozen copy)."""
        with torch.no_grad():
            if self.is_peft:
                peft_model = self.accelerator.unwrap_model(model)
                with peft_model.disable_adapter():
                    return self._velocity(model, x, t, embeds, self.args.guidance_scale, height, width)
            return self._velocity(self.ref_model, x, t, embeds, self.args.guidance_scale, height, width)

    # ------------------------------------------------------------------------------------------------
    # logging
    # ------------------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        metrics = {k: float(np.nanmean(v)) if len(v) else math.nan for k, v in self._metrics[mode].items()}
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
    # evaluation
    # ------------------------------------------------------------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Deterministic sampling (``_eval_ode_solver``: Euler for Flow-GRPO, DiffusionNFT's ``sampler``) at the eval
        step count and guidance with fixed seeds; rewards on the eval set.

        Logs ``eval_reward``, ``eval_reward_std`` and ``eval_rewards/<name>/{mean,std,count}`` (``count``: the images
        the reward scored, so that ``std / sqrt(count)`` is the standard error of the mean), the rewards' own metrics
        ``eval_rewards/<name>/<key>`` (e.g. GenEval's accuracy per task) and, from the second
        evaluation of the same prompts on, ``eval_rewards/<name>/{change,change_se}``: the change since the first
        evaluation and its standard error, paired image by image (same prompts and seeds; ``eval_change.py``);
        writes a contact sheet of
        prompts, images and scores to ``output_dir/eval_step_<N>.png``. With ``eval_images_per_prompt = k``,
        sample ``i`` is image ``i % k`` of prompt ``i // k`` and is drawn from its own seed, so evaluations at
        different steps compare the same noise; the metrics use every image, the sheet each prompt's first.
        """
        dataset = IndexedPromptDataset.wrap(eval_dataset, "eval_dataset") if eval_dataset is not None else \
            self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass one to the trainer or to evaluate()).")
        args = self.args
        height, width = args.image_size
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_prompt = args.eval_images_per_prompt
        indices = list(range(len(dataset) * per_prompt))[rank::world]
        ema_ctx = self.ema.swapped_in(self._trainable_parameters()) if self.ema is not None else nullcontext()
        records = []
        with ema_ctx, self._generation_context() as model:
            for start in range(0, len(indices), args.per_device_eval_batch_size):
                idx = indices[start:start + args.per_device_eval_batch_size]
                rows = [dataset[i // per_prompt] for i in idx]
                prompts = [r["prompt"] for r in rows]
                cols = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", INDEX_COLUMN)}
                if IMAGE_COLUMN in cols:
                    cols[IMAGE_COLUMN] = _load_images(cols[IMAGE_COLUMN])
                embeds, row_map = self._encode_unique(prompts, self.accelerator.device, cols.get(IMAGE_COLUMN),
                                                      args.eval_guidance_scale)
                embeds = embeds.index_select(row_map)
                gens = [torch.Generator().manual_seed(_seed_for(args.seed, 7919, i)) for i in idx]
                final, _ = self._sample(model, embeds, args.eval_num_inference_steps, args.eval_guidance_scale, 0.0,
                                        (0, 0), gens, record=False, ode_solver=self._eval_ode_solver())
                pil = _to_pil(decode_in_slices(self.adapter.decode, final.to(self.model_dtype), height, width,
                                               args.vae_decode_batch_size))
                result = self.reward_set(prompts, pil, **cols)
                for j, i in enumerate(idx):
                    records.append((i, prompts[j], pil[j], result.total[j],
                                    {n: result.per_reward[n][j] for n in self.reward_set.names},
                                    {k: v[j] for k, v in result.metrics.items()}))
        gathered = self.accelerator.gather_for_metrics(records, use_gather_object=True) if world > 1 else records
        gathered = sorted(gathered, key=lambda r: r[0])

        def stat(values):
            vals = [v for v in values if v is not None and not math.isnan(v)]
            return (float(np.mean(vals)), float(np.std(vals)), len(vals)) if vals else (math.nan, math.nan, 0)

        metrics = {}
        metrics[f"{metric_key_prefix}_reward"], metrics[f"{metric_key_prefix}_reward_std"], _ = stat(
            [r[3] for r in gathered])
        for name in self.reward_set.names:
            mean, std, count = stat([r[4][name] for r in gathered])
            metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = mean
            metrics[f"{metric_key_prefix}_rewards/{name}/std"] = std
            metrics[f"{metric_key_prefix}_rewards/{name}/count"] = float(count)
        for key in dict.fromkeys(k for r in gathered for k in r[5]):  # reward-defined (RewardOutput.metrics)
            metrics[f"{metric_key_prefix}_rewards/{key}"] = stat([r[5].get(key) for r in gathered])[0]
        # Paired with the first evaluation of the same prompts and seeds (eval_change.py).
        changes = self._eval_baseline.compare(metric_key_prefix, [r[1] for r in gathered],
                                              {name: [r[4][name] for r in gathered] for name in self.reward_set.names})
        for name, (change, change_se, _) in changes.items():
            metrics[f"{metric_key_prefix}_rewards/{name}/change"] = change
            metrics[f"{metric_key_prefix}_rewards/{name}/change_se"] = change_se
        if self.is_world_process_zero():
            os.makedirs(args.output_dir, exist_ok=True)
            shown = [r for r in gathered if r[0] % per_prompt == 0]  # the sheet: each prompt's first image
            captions = [f"{r[1][:60]} | {r[3]:.3f}" if r[3] is not None else f"{r[1][:60]} | n/a" for r in shown]
            sheet = make_contact_sheet([r[2] for r in shown], captions)
            path = Path(args.output_dir, f"eval_step_{self.state.global_step}.png")
            sheet.save(path)
            self._last_eval = {"metrics": metrics, "contact_sheet": str(path),
                               "samples": [(r[1], r[2], r[3]) for r in shown[:8]]}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ------------------------------------------------------------------------------------------------
    # saving and resuming
    # ------------------------------------------------------------------------------------------------
    def _save_trainer_files(self, output_dir: str, state_dict=None) -> None:
        """``Trainer``'s own save of the trained model (peft adapter files, or the transformer's weights)."""
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
                save_diffusers_lora(type(self.pipeline), output_dir, unwrapped, state_dict=state_dict)
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

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        path = os.path.join(resume_from_checkpoint, EMA_STATE_NAME)
        if self.ema is not None and os.path.exists(path):
            self.ema.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def _card_extra_sections(self) -> str:
        lines = ["## Training setup", "", *self._card_setup_lines(), f"- optimizer steps: {self.state.global_step}"]
        if self._last_eval:
            lines += ["", "## Evaluation (last run)", ""]
            lines += [f"- {k}: {v:.4f}" for k, v in self._last_eval["metrics"].items()]
        return "\n".join(lines)


__all__ = ["EMA_STATE_NAME", "OnlineRLTrainer"]
