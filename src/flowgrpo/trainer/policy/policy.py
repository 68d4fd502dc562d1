"""`Policy`: the model a trainer trains and every copy of it the trainer keeps, in one place.

* **Loading** (`loading.py`): the pipeline is read, checked and loaded; its family adapter (`flowgrpo.models`)
  knows how to call it. The transformer (or the two experts of Wan 2.2 A14B) is trained with a LoRA (peft; trainable
  tensors in float32) or fully; every other component is frozen. Gradient checkpointing is switched on here.
* **The velocity** of any copy at a guidance scale: ``v = adapter.predict_velocity(model, x, t, embeds, w, negative)``
  in float32, with the negative prompt's embedding for classifier-free guidance (per source image when the family's
  negative depends on it, carried by the embeddings themselves).
* **The reference policy** (`reference.py`): the base with the LoRA switched off, a ``ref`` adapter (refreshed by
  ``sync_ref_model`` and GARDO), or a frozen copy of a fully fine-tuned transformer.
* **The old policy** (`old_policy.py`): a second LoRA adapter or a frozen copy, moved toward the trained weights after
  each optimizer step (DiffusionNFT's sampler, AWM's EMA adapter, DGPO's EMA reference, CRD's old copy).
* **Named copies** (``copies``, `build_copy`): more copies of the same two forms, each with its own name and schedule
  (CRD's sampling copy: the adapter ``sampling``, or ``sampling_policy.safetensors`` for full fine-tuning).
* **The EMA** of the trained weights (`ema.py`), swapped in for evaluation and export.
* **Teachers** (`teachers.py`, on-policy distillation): frozen LoRA adapters of the trained model, or another
  checkpoint's transformer, with their velocities; never saved.
* **Saving and loading** all of them: an export (a checkpoint or the output folder) holds the diffusers LoRA
  (``pytorch_lora_weights.safetensors``, the EMA's weights when there is an EMA) or the full transformer, and the EMA
  state; a checkpoint also holds the old policy, the named copies and the reference adapter.

It is built in two steps: the constructor loads (``transformers.Trainer`` needs the model to exist), and `attach`
gives it the accelerator and a way to reach the trainer's current model (``Trainer`` wraps and unwraps it) once
``Trainer.__init__`` has run. The parts built after that (`place_on_device`, `build_ema`, `build_reference`,
`encode_negative_prompt`, `build_old_policy`, `build_copy`) are called by the trainer in that order; `build_teachers`
by the distillation trainer once ``transformers.Trainer`` exists.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers.trainer_utils import set_seed

from ...models import PromptEmbeds, get_family_adapter
from ..outputs.lora_export import save_diffusers_lora
from .ema import EMA_STATE_NAME, EMAWeights
from .loading import (
    TWO_EXPERTS_FULL_FINETUNE,
    check_sequence_parallel_family,
    enable_vae_tiling,
    load_pipeline,
    torch_dtype,
)
from .old_policy import OLD_POLICY_ADAPTER, OldPolicy, build_old_policy, old_adapter_left_out
from .reference import REFERENCE_ADAPTER, ReferencePolicy
from .teachers import TEACHER_ADAPTER_PREFIX, Teacher

__all__ = ["Policy"]


class Policy:
    """See the module docstring.

    Args:
        model: a hub id, a local folder or a loaded ``DiffusionPipeline``.
        args: the trainer's configuration (``dtype``, ``num_frames``, ``seed``, ``quantization``, checkpointing,
            EMA and guidance settings).
        peft_config: a ``peft.LoraConfig`` (without ``target_modules``: the family's defaults), or ``None`` to
            fine-tune the whole transformer.
        pipeline_kwargs: extra ``from_pretrained`` arguments.
        keep_reference_copy: for full fine-tuning, keep a frozen copy of the transformer as the reference (when the
            loss or the health guards read the reference).
        generation_settings: the generation settings resolved before loading (``flowgrpo.models.defaults``); None
            when they could not be (no readable ``model_index.json``): then they are resolved from the loaded pipeline,
            before the family adapter is built and anything moves to a device.
    """

    def __init__(self, model: Any, args: Any, peft_config: Any = None, pipeline_kwargs: dict | None = None, *,
                 keep_reference_copy: bool = False, generation_settings: Any = None):
        from ...models.defaults import resolve_trainer_settings

        self.args = args
        self.dtype = torch_dtype(args.dtype)
        self.pipeline = load_pipeline(model, args, pipeline_kwargs or {}, self.dtype)
        #: the resolved generation settings (size, steps, guidance, text length, frames) and their sources
        self.generation_settings = generation_settings or resolve_trainer_settings(self.pipeline, args)
        self.adapter = get_family_adapter(self.pipeline, num_frames=args.num_frames)
        check_sequence_parallel_family(type(self.adapter), args)
        if getattr(args, "vae_tiling", False):
            enable_vae_tiling(self.pipeline)
        #: the model id the model card names as the base
        self.base_model_id = model if isinstance(model, str) else getattr(self.pipeline, "name_or_path", None)
        if len(self.adapter.transformers()) > 1 and peft_config is None:
            raise ValueError(TWO_EXPERTS_FULL_FINETUNE)
        if peft_config is not None and not getattr(peft_config, "target_modules", None):
            peft_config = copy.deepcopy(peft_config)
            peft_config.target_modules = set(self.adapter.default_lora_target_modules)
        for component in self.pipeline.components.values():
            if isinstance(component, torch.nn.Module):
                component.requires_grad_(False)
                component.eval()
        transformer = self.adapter.trainable_module()

        set_seed(args.seed)  # identical LoRA initialisation on every rank
        #: a frozen copy of the fully fine-tuned transformer, the reference policy (None with a LoRA)
        self.reference_copy: torch.nn.Module | None = None
        if peft_config is not None:
            from peft import get_peft_model

            transformer = get_peft_model(transformer, peft_config)
            for p in transformer.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        else:
            transformer.requires_grad_(True)
            if keep_reference_copy:
                self.reference_copy = copy.deepcopy(transformer).requires_grad_(False).eval()
        self.is_peft = peft_config is not None
        #: the module ``transformers.Trainer`` trains (a ``PeftModel`` with a LoRA)
        self.model = transformer

        self.checkpointing = bool(args.gradient_checkpointing or args.activation_checkpointing)
        if self.checkpointing:  # diffusers' own switch; Trainer's would call a method diffusers models lack
            for module in self.adapter.transformers():
                module.enable_gradient_checkpointing()
            args.gradient_checkpointing = args.activation_checkpointing = False

        self.accelerator = None
        self.ema: EMAWeights | None = None
        self.reference: ReferencePolicy | None = None
        self.old_policy: OldPolicy | None = None
        #: named copies of the policy beside the old one (name -> copy), built by `build_copy`
        self.copies: dict[str, OldPolicy] = {}
        #: on-policy distillation's frozen teachers (`build_teachers`), in the configuration's order
        self.teachers: list[Teacher] = []
        #: the negative prompt's embedding (None when it depends on each source image, or before it is encoded)
        self.negative_embeds: PromptEmbeds | None = None
        self._model_fn: Callable[[], torch.nn.Module] = lambda: self.model
        self._wrapped_fn: Callable[[], torch.nn.Module] = lambda: self.model
        self._zero3 = False

    # ------------------------------------------------------------------------------------------------
    # set-up after transformers.Trainer was built
    # ------------------------------------------------------------------------------------------------
    def attach(self, accelerator: Any, model_fn: Callable[[], torch.nn.Module],
               wrapped_fn: Callable[[], torch.nn.Module], zero3: bool = False) -> None:
        """The accelerator, and how to reach the trained model as the trainer holds it now (``model_fn``: as the
        optimizer sees it; ``wrapped_fn``: with DDP / FSDP / DeepSpeed around it). ``zero3``: DeepSpeed ZeRO-3, whose
        partitioned weights are gathered for each rollout and each old-policy update."""
        self.accelerator = accelerator
        self._model_fn, self._wrapped_fn = model_fn, wrapped_fn
        self._zero3 = zero3

    def place_on_device(self) -> None:
        """Move every frozen component (and the frozen reference copy) to the accelerator's device; components of
        another dtype are cast to the model's."""
        device = self.accelerator.device
        trained = {id(module) for module in self.adapter.transformers()}
        for component in self.pipeline.components.values():
            if isinstance(component, torch.nn.Module) and id(component) not in trained:
                if all(p.dtype == self.dtype for p in component.parameters()):
                    component.to(device=device)  # no cast asked for: diffusers then has nothing to warn about
                else:
                    component.to(device=device, dtype=self.dtype)
        if self.reference_copy is not None:
            self.reference_copy.to(device)

    def build_ema(self) -> None:
        """The EMA of the trained weights (``use_ema``)."""
        args = self.args
        if args.use_ema:
            self.ema = EMAWeights(self.trainable_parameters(), args.ema_decay, args.ema_update_interval,
                                  args.ema_warmup)

    def build_reference(self, own_adapter: bool) -> None:
        """The reference policy: with a LoRA the base (adapter off) or, with ``own_adapter``, a ``ref`` adapter that
        can be refreshed; the frozen copy for full fine-tuning (none when no part reads the reference)."""
        if self.is_peft or self.reference_copy is not None:
            self.reference = ReferencePolicy(self.unwrapped, self.is_peft, own_adapter=own_adapter and self.is_peft,
                                             frozen_copy=self.reference_copy)

    def encode_negative_prompt(self) -> None:
        """The negative prompt's embedding, once (families whose negative depends on the source image encode it with
        each image instead)."""
        args = self.args
        if not self.adapter.negative_depends_on_image:
            with torch.no_grad():
                self.negative_embeds = self.adapter.encode_prompts([args.negative_prompt], args.max_sequence_length,
                                                                   self.accelerator.device)

    def build_old_policy(self) -> None:
        """A second copy of the policy (DiffusionNFT's old policy, AWM's EMA adapter), saved in every checkpoint."""
        self.old_policy = build_old_policy(self.model, self.is_peft)

    def build_copy(self, name: str) -> OldPolicy:
        """One more copy of the policy, ``copies[name]``: an adapter ``name`` (LoRA) or a frozen copy saved as
        ``<name>_policy.safetensors``; it starts equal to the policy, moves by `update_copy`, is saved in every
        checkpoint, restored on resume and left out of exports."""
        taken = {"default", OLD_POLICY_ADAPTER, REFERENCE_ADAPTER, *self.copies}
        if name in taken or not name.isidentifier():
            raise ValueError(f"copy name {name!r} is taken or not an identifier; the names in use are {sorted(taken)}.")
        self.copies[name] = build_old_policy(self.model, self.is_peft, name=name)
        return self.copies[name]
    def enable_sequence_parallel(self, mesh: Any) -> None:
        """Split every transformer this policy runs (the trained one(s), and the frozen copies of full fine-tuning:
        reference, old policy, named copies) over the ``"ulysses"`` dimension of ``mesh``
        (`flowgrpo.trainer.sequence_parallel`): the family's plan and attention. Called once every copy exists (a copy
        made afterwards would share its original's hooks) and before any of them samples."""
        from ..sequence_parallel import enable_sequence_parallel

        device = self.accelerator.device
        modules = list(self.adapter.transformers())
        if self.reference is not None and self.reference.copy is not None:
            modules.append(self.reference.copy)
        for held in [self.old_policy, *self.copies.values()]:
            if held is not None and getattr(held, "module", None) is not None:
                modules.append(held.module)
        for module in dict.fromkeys(modules):
            self.adapter.prepare_sequence_parallel(module)
            enable_sequence_parallel(module, self.adapter.context_parallel_plan(module), mesh, device)

    def compile_blocks(self, backend: str | None = "inductor", mode: str | None = None) -> int:
        """``torch_compile``: compile the repeated blocks of the trained transformer(s) and of every frozen copy that
        samples or is replayed (the reference copy, the old policy's and named copies' of full fine-tuning), once,
        after the copies are built (`compiled_blocks.py`); returns the number of blocks compiled. A LoRA adapter
        (the old policy's, a named copy's, the reference's switched-off adapter) runs inside the same compiled
        blocks."""
        from .compiled_blocks import compile_blocks

        modules = list(self.adapter.transformers())
        frozen = [self.reference_copy, *(kept.module for kept in (self.old_policy, *self.copies.values())
                                         if kept is not None and hasattr(kept, "module"))]
        modules += [m for m in frozen if m is not None]
        return sum(compile_blocks(module, backend=backend, mode=mode) for module in modules)

    def build_teachers(self, specs: list[Any], pipeline_kwargs: dict | None = None) -> None:
        """The frozen teachers of ``specs`` (``TeacherSpec``: ``lora`` or ``model_name_or_path``), in order: a LoRA
        as a further adapter of the trained LoRA model (a merged frozen copy for full fine-tuning), another checkpoint
        as its transformer with the student's other components (`teachers.py`). Built before training starts, while
        the trained weights are still the base's."""
        from .teachers import AdapterTeacher, MergedCopyTeacher, teacher_adapter_name

        device = self.accelerator.device if self.accelerator is not None else None
        for index, spec in enumerate(specs):
            if spec.lora and self.is_peft:
                teacher = AdapterTeacher(self.unwrapped, self.adapter.lora_writer(), spec.lora,
                                         teacher_adapter_name(index))
            elif spec.lora:
                teacher = MergedCopyTeacher(self.unwrapped, self.adapter.lora_writer(), spec.lora)
                teacher.module.to(device)
            else:
                teacher = self._model_teacher(spec.model_name_or_path, pipeline_kwargs or {})
                teacher.module.to(device)
            self.teachers.append(teacher)

    def _model_teacher(self, source: str, pipeline_kwargs: dict) -> Teacher:
        """Another checkpoint's transformer(s), loaded with every other component taken from the student's pipeline."""
        from diffusers import DiffusionPipeline

        from ...models import get_family_adapter
        from .teachers import ModelTeacher, check_teacher_transformer

        trained = {id(module) for module in self.adapter.transformers()}
        shared = {name: c for name, c in self.pipeline.components.items()
                  if c is not None and id(c) not in trained and name != "scheduler"}
        kwargs = {**pipeline_kwargs, **shared}
        if "torch_dtype" not in kwargs:
            kwargs.setdefault("dtype", self.dtype)
        pipeline = DiffusionPipeline.from_pretrained(str(source), **kwargs)
        if type(get_family_adapter(pipeline)) is not type(self.adapter):
            raise ValueError(f"teacher_model_name_or_path={source!r} is a {type(pipeline).__name__}; the student is a "
                             f"{type(self.pipeline).__name__}. The teacher must be of the student's family.")
        module = get_family_adapter(pipeline, num_frames=self.args.num_frames).trainable_module()
        student = self.adapter.transformers()[0]
        check_teacher_transformer(student, get_family_adapter(pipeline).transformers()[0], str(source))
        return ModelTeacher(module, str(source))

    @contextmanager
    def teacher_model(self, model: torch.nn.Module, index: int) -> Iterator[torch.nn.Module]:
        """The module whose forward is teacher ``index`` (``model``: the trained one, maybe wrapped)."""
        with self.teachers[index].forward_model(model) as teacher:
            yield teacher

    def teacher_velocity(self, model: torch.nn.Module, index: int, latents: torch.Tensor, timestep: torch.Tensor,
                         embeds: PromptEmbeds, guidance_scale: float, height: int, width: int) -> torch.Tensor:
        """Teacher ``index``'s velocity (no gradient) at ``guidance_scale``, in float32."""
        with torch.no_grad(), self.teacher_model(model, index) as teacher:
            return self.velocity(teacher, latents, timestep, embeds, guidance_scale, height, width)

    # ------------------------------------------------------------------------------------------------
    # the trained model
    # ------------------------------------------------------------------------------------------------
    @property
    def unwrapped(self) -> torch.nn.Module:
        """The trained module without DDP / FSDP / DeepSpeed around it."""
        model = self._model_fn()
        return self.accelerator.unwrap_model(model) if self.accelerator is not None else model

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.unwrapped.parameters() if p.requires_grad]

    @contextmanager
    def generation_context(self) -> Iterator[torch.nn.Module]:
        """No grad, eval mode, mixed-precision autocast, and (ZeRO-3) parameters gathered once per rollout; gives the
        model to sample with."""
        model = self._wrapped_fn()
        was_training = model.training
        gather = nullcontext()
        if self._zero3:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(list(self._model_fn().parameters()), modifier_rank=None)
        model.eval()
        try:
            with torch.no_grad(), gather, self.accelerator.autocast():
                yield model
        finally:
            model.train(was_training)

    @contextmanager
    def ema_weights(self) -> Iterator[None]:
        """The EMA's weights swapped into the model for the block (nothing without an EMA)."""
        with self.ema.swapped_in(self.trainable_parameters()) if self.ema is not None else nullcontext():
            yield

    # ------------------------------------------------------------------------------------------------
    # velocities
    # ------------------------------------------------------------------------------------------------
    def velocity(self, model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, embeds: PromptEmbeds,
                 guidance_scale: float, height: int, width: int) -> torch.Tensor:
        """The velocity of ``model`` (any copy of the policy) in float32, with classifier-free guidance at
        ``guidance_scale`` against the negative prompt (the embeddings' own ``negative`` when they carry one)."""
        negative = None
        if self.adapter.uses_cfg(guidance_scale):
            negative = embeds.negative if embeds.negative is not None else (
                self.negative_embeds.expand_to(latents.shape[0]) if self.negative_embeds is not None else None)
        v = self.adapter.predict_velocity(model, latents.to(self.dtype), timestep, embeds, guidance_scale, negative,
                                          height, width)
        return v.float()

    @contextmanager
    def reference_model(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """The module whose forward is the reference (``model``: the trained one, maybe wrapped)."""
        with self.reference.forward_model(model, unwrap=self.accelerator.unwrap_model) as ref:
            yield ref

    def reference_velocity(self, model: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
                           embeds: PromptEmbeds, height: int, width: int,
                           guidance_scale: float | None = None) -> torch.Tensor:
        """The reference's velocity (no gradient), at ``guidance_scale`` (default: the training guidance)."""
        scale = self.args.guidance_scale if guidance_scale is None else guidance_scale
        with torch.no_grad(), self.reference_model(model) as ref:
            return self.velocity(ref, latents, timestep, embeds, scale, height, width)

    # ------------------------------------------------------------------------------------------------
    # the old policy
    # ------------------------------------------------------------------------------------------------
    def update_old_policy(self, decay: float) -> None:
        """theta_old <- decay theta_old + (1 - decay) theta. Under DeepSpeed ZeRO-3 the trained and old tensors are
        gathered while they are updated (every process computes the same values; process 0's are kept)."""
        self._update(self.old_policy, decay)

    def update_copy(self, name: str, decay: float) -> None:
        """theta_name <- decay theta_name + (1 - decay) theta for the copy ``copies[name]`` (as `update_old_policy`)."""
        self._update(self.copies[name], decay)

    def _update(self, kept: OldPolicy, decay: float) -> None:
        gather = nullcontext()
        if self._zero3:
            import deepspeed

            tensors = [p for pair in kept.pairs for p in pair if hasattr(p, "ds_id")]
            gather = deepspeed.zero.GatheredParameters(tensors, modifier_rank=0)
        with gather:
            kept.update(decay)

    # ------------------------------------------------------------------------------------------------
    # saving and loading
    # ------------------------------------------------------------------------------------------------
    @contextmanager
    def trainer_save_context(self, in_checkpoint: bool) -> Iterator[None]:
        """Around ``Trainer``'s own save of the trained model (peft's adapter files, or the transformer's weights):
        exports leave the old-policy adapter and the named copies out, and every save leaves out the reference adapter
        (saved by `ReferencePolicy.save`)."""
        names = ((OLD_POLICY_ADAPTER,) if self.old_policy is not None else ()) + tuple(self.copies)
        export = bool(names) and self.is_peft and not in_checkpoint
        with old_adapter_left_out(self.unwrapped, names) if export else nullcontext(), \
                self._reference_adapter_left_out():
            yield

    @contextmanager
    def _reference_adapter_left_out(self) -> Iterator[None]:
        """peft's own save writes every adapter of ``peft_config``; the ``ref`` adapter (saved by the reference
        itself) and the teachers' (loaded again from their sources) are taken out for its duration."""
        configs = self.unwrapped.peft_config if self.is_peft else {}
        names = [n for n in configs if n == REFERENCE_ADAPTER or n.startswith(TEACHER_ADAPTER_PREFIX)]
        held = {name: configs.pop(name) for name in names}
        try:
            yield
        finally:
            configs.update(held)

    def save(self, output_dir: str, state_dict: dict | None = None, in_checkpoint: bool = False) -> None:
        """The diffusers export (the EMA's weights when there is an EMA, unless ``state_dict``, a gathered full state
        dict, is given) and the EMA state; in a checkpoint also the old policy, the named copies and the reference
        adapter."""
        ema = self.ema_weights() if state_dict is None else nullcontext()
        with ema:
            if self.is_peft:
                save_diffusers_lora(self.adapter.lora_writer(), output_dir, self.unwrapped, state_dict=state_dict)
            elif state_dict is not None:
                from safetensors.torch import save_file

                folder = os.path.join(output_dir, "transformer")
                os.makedirs(folder, exist_ok=True)
                self.unwrapped.save_config(folder)
                save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
                          os.path.join(folder, "diffusion_pytorch_model.safetensors"))
            else:
                self.unwrapped.save_pretrained(os.path.join(output_dir, "transformer"))
        if self.ema is not None:
            torch.save(self.ema.state_dict(), os.path.join(output_dir, EMA_STATE_NAME))
        if in_checkpoint:
            if self.old_policy is not None:
                self.old_policy.save(output_dir)
            for named in self.copies.values():
                named.save(output_dir)
            if self.reference is not None and self.reference.kind == "adapter":
                self.reference.save(output_dir)

    def check_resumable(self, folder: str, trainer_name: str) -> None:
        """A checkpoint without the old-policy adapter (or a named copy's) cannot continue a run that keeps one."""
        names = ((OLD_POLICY_ADAPTER,) if self.old_policy is not None else ()) + tuple(self.copies)
        for name in names if self.is_peft else ():
            if not os.path.isdir(os.path.join(folder, name)):
                what = "old-policy adapter" if name == OLD_POLICY_ADAPTER else f"adapter of the policy copy {name!r}"
                raise ValueError(f"{folder} holds no {what} ({name}/): it was not written by {trainer_name} with the "
                                 f"same settings, so the run cannot continue exactly. Resume from a {trainer_name} "
                                 "checkpoint, or start a new run.")

    def load(self, folder: str) -> None:
        """What `save` wrote besides the trained weights (``Trainer`` loads those and every adapter): the EMA, the old
        policy, the named copies, the reference adapter."""
        self.load_ema(folder)
        if self.old_policy is not None:
            self.old_policy.load(folder)
        for named in self.copies.values():
            named.load(folder)
        if self.reference is not None and self.reference.kind == "adapter":
            self.reference.load(folder)

    def load_ema(self, folder: str) -> None:
        path = os.path.join(folder, EMA_STATE_NAME)
        if self.ema is not None and os.path.exists(path):
            self.ema.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
