r"""Frozen teachers of on-policy distillation: what `Policy.build_teachers` keeps and `Policy.teacher_model` switches in.

Three forms, one per way a teacher is given:

* `AdapterTeacher` (``teacher_lora`` / ``teachers`` with a LoRA student): the teacher's LoRA (a folder, a
  ``.safetensors`` file or a Hub id, in diffusers' format as the trainers here export it, or any format the pipeline's
  own ``lora_state_dict`` converts) is loaded as a further, frozen peft adapter of the trained ``PeftModel``, named
  ``teacher<k>``, with the LoRA's own configuration (rank, alpha, target modules: from the file's
  ``lora_adapter_metadata``, else read from the tensors' shapes with alpha = rank, diffusers' convention). Its forward
  passes switch the active adapter of every LoRA layer for the duration of a ``with`` block, as the old policy's; the
  base weights are shared, so a teacher costs its LoRA tensors only. Layers the teacher's LoRA does not target run
  the base. Two-expert pipelines (Wan 2.2) read the second expert's LoRA from its own file
  (``pytorch_lora_weights_transformer_2.safetensors``).
* `MergedCopyTeacher` (a LoRA teacher for a fully fine-tuned student): the student's weights move, so the teacher is
  a frozen copy of the base transformer with the LoRA merged in (a second copy of the transformer).
* `ModelTeacher` (``teacher_model_name_or_path``): another checkpoint of the same family (a fine-tuned or larger
  transformer that reads the same latents and text embeddings), loaded frozen with every other component shared
  with the student's pipeline (its text encoders and VAE are not loaded again).

Teachers are never saved: an export or a checkpoint holds the student only, and a resumed run loads its teachers
again from where the configuration names them.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..outputs.lora_export import EXPERT_LORA_WEIGHTS_NAMES, LORA_WEIGHTS_NAME, expert_names
from .old_policy import adapter_active

__all__ = ["TEACHER_ADAPTER_PREFIX", "AdapterTeacher", "MergedCopyTeacher", "ModelTeacher", "Teacher",
           "read_teacher_lora", "teacher_adapter_name"]

TEACHER_ADAPTER_PREFIX = "teacher"
#: LoraConfig fields read from a LoRA file's metadata (the rest concern training, not the forward pass)
_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora",
                "lora_bias", "fan_in_fan_out", "bias")


def teacher_adapter_name(index: int) -> str:
    """The peft adapter name of teacher ``index``."""
    return f"{TEACHER_ADAPTER_PREFIX}{index}"


class Teacher:
    """The interface: ``forward_model(model)``, a context giving the module whose forward is the teacher
    (``model``: the trained one, maybe wrapped); ``source``, what it was loaded from."""

    source: str

    def forward_model(self, model: torch.nn.Module):
        raise NotImplementedError


def _lora_file(source: str, weight_name: str, required: bool) -> tuple[str, dict]:
    """Where ``pipeline_cls.lora_state_dict`` reads a LoRA: a file, a folder or a Hub id holding ``weight_name`` (when
    not ``required``, a folder or repository without it is searched by diffusers for its one LoRA file)."""
    if os.path.isfile(source):
        return os.path.dirname(source) or ".", {"weight_name": os.path.basename(source)}
    if os.path.isdir(source) and not os.path.isfile(os.path.join(source, weight_name)):
        if required:
            raise FileNotFoundError(f"The teacher LoRA folder {source!r} has no {weight_name}; give the folder a "
                                    "trainer exported (or its .safetensors file).")
        return source, {}
    return source, {"weight_name": weight_name} if required or os.path.isdir(source) else {}


def read_teacher_lora(pipeline_cls: Any, source: str, weight_name: str = LORA_WEIGHTS_NAME, required: bool = False
                      ) -> tuple[dict[str, torch.Tensor], dict]:
    """The LoRA tensors of the transformer, keyed like the bare transformer's modules
    (``transformer_blocks.0.attn.to_q.lora_A.weight``), and the ``LoraConfig`` keyword arguments that rebuild it.
    ``required``: ``weight_name`` must be there (a second expert's file); else a folder or Hub repository without it
    is read the way ``load_lora_weights`` reads it."""
    location, kwargs = _lora_file(source, weight_name, required)
    state, metadata = pipeline_cls.lora_state_dict(location, return_lora_metadata=True, **kwargs)
    prefix = "transformer."
    layers = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not layers:
        raise ValueError(f"The teacher LoRA {source!r} holds no transformer LoRA tensors (keys like "
                         f"'transformer.<module>.lora_A.weight'); found {sorted(state)[:3]}.")
    config = {k[len(prefix):]: v for k, v in (metadata or {}).items() if k.startswith(prefix)}
    config = {k: v for k, v in config.items() if k in _CONFIG_KEYS and v is not None}
    if "r" not in config:  # no metadata: the ranks from the shapes, alpha = rank (diffusers' convention)
        ranks = {k.rsplit(".lora_A", 1)[0]: int(v.shape[0]) for k, v in layers.items() if ".lora_A" in k}
        common = Counter(ranks.values()).most_common(1)[0][0]
        config = {"r": common, "lora_alpha": common, "target_modules": sorted(ranks),
                  "rank_pattern": {m: r for m, r in ranks.items() if r != common},
                  "alpha_pattern": {m: r for m, r in ranks.items() if r != common}}
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    return layers, config


def _lora_parts(pipeline_cls: Any, source: str, experts: tuple[str, ...] | None) -> tuple[dict, dict]:
    """The teacher LoRA's tensors keyed like the trainable module's (a two-expert module: ``<expert>.<module>``), and
    its config (the first expert's)."""
    if experts is None:
        return read_teacher_lora(pipeline_cls, source)
    layers, config = {}, None
    for name in experts:
        part, part_config = read_teacher_lora(pipeline_cls, source, EXPERT_LORA_WEIGHTS_NAMES[name], required=True)
        layers.update({f"{name}.{k}": v for k, v in part.items()})
        if config is None:
            config = dict(part_config)
    return layers, config


class AdapterTeacher(Teacher):
    """A teacher LoRA as a frozen adapter of the trained ``PeftModel`` (see the module docstring)."""

    def __init__(self, peft_model: torch.nn.Module, pipeline_cls: Any, source: str, name: str):
        from peft import LoraConfig, set_peft_model_state_dict
        from peft.tuners.tuners_utils import BaseTunerLayer

        if name in peft_model.peft_config:
            raise ValueError(f"The model already has an adapter named {name!r}.")
        self.source, self.name, self.model = source, name, peft_model
        layers, config = _lora_parts(pipeline_cls, source, expert_names(peft_model))
        lora_config = LoraConfig(**config, inference_mode=True)
        peft_model.add_adapter(name, lora_config)
        state = {f"base_model.model.{k}": v for k, v in layers.items()}
        result = set_peft_model_state_dict(peft_model, state, adapter_name=name)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        own = [k for k, _ in peft_model.named_parameters() if f".{name}." in k]
        if unexpected or not own:
            raise ValueError(f"The teacher LoRA {source!r} does not fit the student's transformer: "
                             f"{len(unexpected)} of its tensors name no module of it (e.g. {unexpected[:2]}). It must "
                             "be a LoRA of the same base model.")
        missing = [k for k in own if k.replace(f".{name}.", ".") not in state]
        if missing:
            raise ValueError(f"The teacher LoRA {source!r} lacks tensors for {len(missing)} of the layers its own "
                             f"configuration targets (e.g. {missing[:2]}).")
        for param_name, param in peft_model.named_parameters():
            if f".{name}." in param_name:
                param.requires_grad_(False)
        self.layers = [m for m in peft_model.modules() if isinstance(m, BaseTunerLayer)]

    @contextmanager
    def forward_model(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        """``model`` with this teacher's adapter active in every LoRA layer; the trained adapter and every
        parameter's ``requires_grad`` are restored when the block ends."""
        with adapter_active(self.layers, self.name):
            yield model


class MergedCopyTeacher(Teacher):
    """A teacher LoRA merged into a frozen copy of the base transformer (a fully fine-tuned student)."""

    def __init__(self, module: torch.nn.Module, pipeline_cls: Any, source: str):
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

        self.source = source
        base = copy.deepcopy(module).requires_grad_(False)
        layers, config = _lora_parts(pipeline_cls, source, expert_names(base))
        peft_model = get_peft_model(base, LoraConfig(**config))
        result = set_peft_model_state_dict(peft_model, {f"base_model.model.{k}": v for k, v in layers.items()})
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise ValueError(f"The teacher LoRA {source!r} does not fit the student's transformer: {len(unexpected)} "
                             f"of its tensors name no module of it (e.g. {unexpected[:2]}).")
        self.module = peft_model.merge_and_unload().requires_grad_(False).eval()

    @contextmanager
    def forward_model(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        yield self.module


class ModelTeacher(Teacher):
    """Another checkpoint of the student's family as the teacher (its transformer frozen; the other components are
    the student's)."""

    def __init__(self, module: torch.nn.Module, source: str):
        self.source = source
        self.module = module.requires_grad_(False).eval()

    @contextmanager
    def forward_model(self, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
        yield self.module


#: the transformer configuration keys a teacher base must share with the student: what the student's latents and
#: text embeddings are shaped by
SHARED_CONDITIONING_KEYS = ("in_channels", "out_channels", "patch_size", "joint_attention_dim",
                            "pooled_projection_dim", "text_dim", "cross_attention_dim", "caption_channels",
                            "text_embed_dim")


def check_teacher_transformer(student: torch.nn.Module, teacher: torch.nn.Module, source: str) -> None:
    """The teacher must read the student's latents and embeddings: the conditioning sizes of their configs agree."""
    a, b = dict(getattr(student, "config", {}) or {}), dict(getattr(teacher, "config", {}) or {})
    differ = {k: (a[k], b[k]) for k in SHARED_CONDITIONING_KEYS if k in a and k in b and a[k] != b[k]}
    if differ:
        raise ValueError(f"teacher_model_name_or_path={source!r} does not read the student's latents and text "
                         f"embeddings: {', '.join(f'{k} {s} (student) vs {t} (teacher)' for k, (s, t) in differ.items())}"
                         ". Give a checkpoint of the same family with the same VAE and text encoders.")
