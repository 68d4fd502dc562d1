"""A run's generation settings: the values given, else the checkpoint's own, else its family's; impossible ones refused.

The settings (:data:`GENERATION_SETTINGS`) are the image size, the sampling steps of rollouts and of evaluation, their
guidance scales, the text length and the frame count. Each left unset (``None``) is resolved, in this order:

1. a value derived from a given one: ``height`` / ``width`` from ``resolution`` (the configuration does it), and
   ``eval_guidance_scale`` from a given ``guidance_scale`` (evaluation samples as the rollouts unless told otherwise);
2. for ``guidance_scale``, an algorithm that samples CFG-free by design (DiffusionNFT, AWM, Diffusion-DPO) takes the
   family's no-guidance value on families whose guidance is classifier-free (a guidance embedding keeps its value);
3. the checkpoint's own defaults: the ``generation`` mapping of the first of :data:`CHECKPOINT_DEFAULTS_FILES` in the
   pipeline folder (the shipped toy world's ``toy_world.json``: 32 px, 20 steps, guidance 3, 8 text tokens);
4. the family's (:meth:`flowgrpo.models.base.ModelFamilyAdapter.generation_profile`): the size its pipeline uses
   without one (``default_sample_size * vae_scale_factor``, or the call's defaults), the text length of its pipeline
   capped by the encoder, the frame count, and the model card's steps and guidance (distilled variants: their few
   steps, no guidance).

Every resolved value is then checked against what the model can take (:func:`check_generation_settings`): a size
beyond the transformer's positional range or not a multiple of the VAE factor times the patch size, a text length
beyond the encoder's, frames the VAE cannot make, are errors naming the value, the allowed range and the fix
(:func:`impossible_value_message`); a guidance the family ignores (distilled, or an embedding with a negative prompt)
is a warning. Nothing here loads a weight: the configs come from the folder, the Hub cache or a loaded pipeline's
components (:func:`read_model_configs`, :func:`configs_from_pipeline`). The trainers (:func:`resolve_trainer_settings`),
``flowgrpo plan`` (:mod:`flowgrpo.plan.recipe_settings`) and ``flowgrpo evaluate`` resolve the same way.

A checkpoint carries its own defaults in ``generation_defaults.json`` next to ``model_index.json``::

    {"generation": {"resolution": 32, "num_inference_steps": 20, "guidance_scale": 3.0, "max_sequence_length": 8},
     "source": "what the numbers are (e.g. the model card)"}

with any of the keys :data:`CHECKPOINT_DEFAULT_KEYS` (``distilled``: sampled without guidance, so that guidance > the
family's off value is warned about). A toy world's ``toy_world.json`` holds the same ``generation`` mapping.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .profile import FamilyProfile, ModelConfigs

#: the settings resolved here, as named in the trainers' configurations
GENERATION_SETTINGS = ("height", "width", "num_inference_steps", "eval_num_inference_steps", "guidance_scale",
                       "eval_guidance_scale", "max_sequence_length", "num_frames")
#: files of a pipeline folder that may hold the checkpoint's own defaults (a ``generation`` mapping), first found wins
CHECKPOINT_DEFAULTS_FILES = ("generation_defaults.json", "toy_world.json")
#: keys of that ``generation`` mapping
CHECKPOINT_DEFAULT_KEYS = ("resolution", "height", "width", "num_inference_steps", "eval_num_inference_steps",
                           "guidance_scale", "eval_guidance_scale", "max_sequence_length", "num_frames", "distilled")
_INTEGER_SETTINGS = ("height", "width", "num_inference_steps", "eval_num_inference_steps", "max_sequence_length",
                     "num_frames")
GIVEN = "given"

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# reading the component configs
# --------------------------------------------------------------------------------------------------------------------

def _config_file_for(class_name: str) -> str:
    """The file a component of class ``class_name`` keeps its configuration in."""
    if class_name.endswith("Scheduler") or "Scheduler" in class_name:
        return "scheduler_config.json"
    if "Tokenizer" in class_name or "Processor" in class_name:
        return "tokenizer_config.json"
    if class_name.endswith("Guidance"):
        return "guider_config.json"
    return "config.json"


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not os.path.exists(name)


def _load_json(model: str, relative: str, hub: Mapping[str, Any]) -> dict | None:
    """``relative`` of a local folder or a Hub repository (the Hub cache when offline), or ``None``."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        path = folder / relative
        try:
            return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, ValueError):
            return None
    if not _is_hub_id(model):
        return None
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(repo_id=model, filename=relative, **{k: v for k, v in hub.items() if v is not None})
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:  # not on the Hub, not in the cache offline, or not JSON: the caller falls back
        return None


def read_checkpoint_defaults(model: str, hub: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """The checkpoint's own ``generation`` defaults and the file they came from (``({}, None)`` when it has none).

    Raises:
        ValueError: the file's ``generation`` mapping is not a mapping or has a key other than
            :data:`CHECKPOINT_DEFAULT_KEYS`.
    """
    for name in CHECKPOINT_DEFAULTS_FILES:
        data = _load_json(str(model), name, hub or {})
        if not isinstance(data, dict) or "generation" not in data:
            continue
        generation = data["generation"]
        if not isinstance(generation, dict):
            raise ValueError(f"{model}/{name}: 'generation' must map settings to values, got {generation!r}.")
        unknown = sorted(set(generation) - set(CHECKPOINT_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"{model}/{name}: unknown generation default(s) {unknown}; the keys are "
                             f"{', '.join(CHECKPOINT_DEFAULT_KEYS)}.")
        return dict(generation), name
    return {}, None


def read_model_configs(model: str | os.PathLike, *, revision: str | None = None, cache_dir: str | None = None,
                       token: Any = None, checkpoint_defaults: bool = True) -> ModelConfigs | None:
    """The component configs of the pipeline in a local folder or a Hub repository (read from the Hub cache when
    offline), without any weight; ``None`` when its ``model_index.json`` cannot be read.

    ``checkpoint_defaults=False`` leaves the checkpoint's own defaults out (the family's alone).
    """
    model = str(model)
    hub = {"revision": revision, "cache_dir": cache_dir, "token": token}
    index = _load_json(model, "model_index.json", hub)
    if not isinstance(index, dict) or "_class_name" not in index:
        return None
    components: dict[str, dict[str, Any]] = {}
    pipeline_config: dict[str, Any] = {}
    for key, value in index.items():
        if key.startswith("_"):
            continue
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(v is None or isinstance(v, str) for v in value):
            if value[0] is not None and value[1] is not None:
                config = _load_json(model, f"{key}/{_config_file_for(value[1])}", hub)
                if isinstance(config, dict):
                    components[key] = config
            continue
        pipeline_config[key] = value
    defaults, source = read_checkpoint_defaults(model, hub) if checkpoint_defaults else ({}, None)
    local = Path(model).expanduser().is_dir()
    return ModelConfigs(pipeline_class=index["_class_name"], name=model, components=components,
                        pipeline_config=pipeline_config, checkpoint_defaults=defaults,
                        checkpoint_defaults_source=source, origin=f"local folder {model}" if local else f"Hub {model}")


def _component_config(component: Any) -> dict[str, Any] | None:
    """A loaded component's configuration as a dict (a tokenizer's or processor's: its ``model_max_length``)."""
    tokenizer = getattr(component, "tokenizer", None) if not hasattr(component, "model_max_length") else component
    if tokenizer is not None and hasattr(tokenizer, "model_max_length") and not hasattr(component, "parameters"):
        return {"model_max_length": tokenizer.model_max_length}
    config = getattr(component, "config", None)
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        return config.to_dict()
    try:
        return dict(config)
    except (TypeError, ValueError):
        return None


def configs_from_pipeline(pipeline: Any, checkpoint_defaults: bool = True) -> ModelConfigs:
    """The component configs of a loaded ``DiffusionPipeline`` (its checkpoint's own defaults are read from the folder
    it was loaded from, when that is a local folder)."""
    components: dict[str, dict[str, Any]] = {}
    for key, component in pipeline.components.items():
        if component is None:
            continue
        config = _component_config(component)
        if config is not None:
            components[key] = config
    pipeline_config = {k: v for k, v in dict(pipeline.config).items()
                       if not k.startswith("_") and not (isinstance(v, (list, tuple)) and len(v) == 2)}
    name = str(getattr(pipeline, "name_or_path", None) or pipeline.config.get("_name_or_path", "") or "")
    defaults, source = ({}, None)
    if checkpoint_defaults and name and Path(name).expanduser().is_dir():
        defaults, source = read_checkpoint_defaults(name)
    return ModelConfigs(pipeline_class=type(pipeline).__name__, name=name, components=components,
                        pipeline_config=pipeline_config, checkpoint_defaults=defaults,
                        checkpoint_defaults_source=source, origin="loaded pipeline")


# --------------------------------------------------------------------------------------------------------------------
# resolving
# --------------------------------------------------------------------------------------------------------------------

@dataclass
class GenerationSettings:
    """A run's resolved generation settings: ``values`` by setting (:data:`GENERATION_SETTINGS`), where each came
    from (``sources``: "given", the checkpoint's file, or the family's reason), the family's ``profile``, the model's
    own size and text length (``own``: what an unset value gives, named by the error messages) and the ``warnings``
    of :func:`check_generation_settings`."""

    configs: ModelConfigs
    profile: FamilyProfile
    values: dict[str, Any]
    sources: dict[str, str]
    own: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        """How error messages name the model: its hub id or folder, and its pipeline class."""
        name = self.configs.name or "this model"
        return f"{name} ({self.configs.pipeline_class})"

    def resolved_from_model(self) -> list[str]:
        """The settings that were not given (the model's own, or the algorithm's)."""
        return [name for name in GENERATION_SETTINGS if self.sources.get(name) != GIVEN]

    def summary(self) -> str:
        """The values in a few words: ``32x32 px, 20 steps (evaluation 20), guidance 3 (evaluation 3), 8 text
        tokens`` (and the frames of a video)."""
        v = self.values
        text = (f"{v['height']}x{v['width']} px, {v['num_inference_steps']} steps (evaluation "
                f"{v['eval_num_inference_steps']}), guidance {v['guidance_scale']:g} (evaluation "
                f"{v['eval_guidance_scale']:g}), {v['max_sequence_length']} text tokens")
        return text + (f", {v['num_frames']} frames" if v["num_frames"] > 1 else "")

    def origins(self) -> str:
        """Where the values came from, grouped: ``given: ...; toy_world.json: ...; ...``."""
        groups: dict[str, list[str]] = {}
        for name in GENERATION_SETTINGS:
            groups.setdefault(self.sources[name], []).append(name)
        return "; ".join(f"{source}: {', '.join(names)}" for source, names in groups.items())

    def describe(self) -> str:
        """One line for the log: the values and where each came from."""
        return f"generation settings of {self.model}: {self.summary()} ({self.origins()})"

    def card_line(self) -> str:
        """The model card's line: the values, and which of them are the model's own (or the algorithm's)."""
        own = self.resolved_from_model()
        line = f"- generation: {self.summary()}"
        if own:
            line += " (not given, resolved from the model: " + "; ".join(
                f"{source}: {', '.join(n for n in own if self.sources[n] == source)}"
                for source in dict.fromkeys(self.sources[n] for n in own)) + ")"
        return line


def _first(*candidates: tuple[Any, str]) -> tuple[Any, str]:
    for value, source in candidates:
        if value is not None:
            return value, source
    raise ValueError("no candidate value")  # the family's default is always the last candidate


def resolve_generation_settings(configs: ModelConfigs, explicit: Mapping[str, Any], *, cfg_free: str | None = None,
                                guidance_scales: Sequence[float] = (), negative_prompt: str = "") -> GenerationSettings:
    """Resolve every setting of :data:`GENERATION_SETTINGS` that ``explicit`` leaves ``None`` (see the module
    docstring for the order), then check them all (:func:`check_generation_settings`).

    Args:
        configs: the pipeline's component configs.
        explicit: the values given (``None``: the model's own), by setting name.
        cfg_free: why the algorithm samples without classifier-free guidance (e.g. "DiffusionNFTConfig: CFG-free
            rollouts"), or ``None`` when it samples with the model's guidance.
        guidance_scales: further evaluation guidance scales given (``eval_guidance_scales``), checked as well.
        negative_prompt: the negative prompt given (a guidance embedding ignores it: a warning).

    Raises:
        ValueError: a value the model cannot take (the message names it, the allowed range and the fix).
    """
    from . import family_adapter_class

    profile = family_adapter_class(configs.pipeline_class).generation_profile(configs)
    checkpoint = dict(configs.checkpoint_defaults)
    if checkpoint.get("distilled") is not None:  # the checkpoint says whether it samples without guidance
        profile = replace(profile, published=replace(profile.published, distilled=bool(checkpoint["distilled"])))
    published = profile.published
    own = configs.checkpoint_defaults_source or ""

    def given(name: str) -> tuple[Any, str]:
        return explicit.get(name), GIVEN

    def from_checkpoint(*keys: str) -> tuple[Any, str]:
        for key in keys:
            if checkpoint.get(key) is not None:
                return checkpoint[key], own
        return None, ""

    resolved: dict[str, tuple[Any, str]] = {
        "height": _first(given("height"), from_checkpoint("height", "resolution"), (profile.height, profile.size_why)),
        "width": _first(given("width"), from_checkpoint("width", "resolution"), (profile.width, profile.size_why)),
        "num_frames": _first(given("num_frames"), from_checkpoint("num_frames"),
                             (profile.num_frames, profile.frames_why)),
        "max_sequence_length": _first(given("max_sequence_length"), from_checkpoint("max_sequence_length"),
                                      (profile.text.default, profile.text.default_why)),
        "num_inference_steps": _first(given("num_inference_steps"), from_checkpoint("num_inference_steps"),
                                      (published.num_inference_steps, published.source)),
        "eval_num_inference_steps": _first(given("eval_num_inference_steps"),
                                           from_checkpoint("eval_num_inference_steps", "num_inference_steps"),
                                           (published.num_inference_steps, published.source)),
    }
    algorithm = (profile.cfg_off, cfg_free) if cfg_free and profile.guidance == "cfg" else (None, "")
    guidance = _first(given("guidance_scale"), algorithm, from_checkpoint("guidance_scale"),
                      (published.guidance_scale, published.source))
    resolved["guidance_scale"] = guidance
    follows = (guidance[0], "as guidance_scale")
    given_guidance = explicit.get("guidance_scale") is not None
    resolved["eval_guidance_scale"] = _first(given("eval_guidance_scale"),
                                             follows if given_guidance or algorithm[0] is not None else (None, ""),
                                             from_checkpoint("eval_guidance_scale"), follows)
    values = {name: (int(v) if name in _INTEGER_SETTINGS else float(v)) for name, (v, _) in resolved.items()}
    sources = {name: source for name, (_, source) in resolved.items()}
    own_values = {
        "height": _first(from_checkpoint("height", "resolution"), (profile.height, ""))[0],
        "width": _first(from_checkpoint("width", "resolution"), (profile.width, ""))[0],
        "max_sequence_length": _first(from_checkpoint("max_sequence_length"), (profile.text.default, ""))[0],
    }
    settings = GenerationSettings(configs, profile, {name: values[name] for name in GENERATION_SETTINGS},
                                  {name: sources[name] for name in GENERATION_SETTINGS}, own=own_values)
    settings.warnings = check_generation_settings(settings, guidance_scales=guidance_scales,
                                                  negative_prompt=negative_prompt)
    return settings


# --------------------------------------------------------------------------------------------------------------------
# checking
# --------------------------------------------------------------------------------------------------------------------

def impossible_value_message(name: str, value: Any, model: str, why: str, allowed: str, fix: str) -> str:
    """The one wording of every refused generation setting (the trainers, ``flowgrpo plan`` and ``flowgrpo
    evaluate`` alike): the setting and its value, the model, why it cannot take it, what it can take, and the fix."""
    return f"{name}={value!r} cannot be used with {model}: {why}. Allowed: {allowed}. {fix}"


def _size_fix(name: str, value: int, multiple: int, max_side: int | None, own: str | None) -> str:
    lower = value // multiple * multiple
    options = [v for v in (lower, lower + multiple) if v >= multiple and (max_side is None or v <= max_side)]
    if max_side is not None and value > max_side:
        options = [max_side // multiple * multiple]
    use = " or ".join(str(v) for v in options)
    if own is None:  # the model's own default is the value refused: the checkpoint needs its own size
        return (f"Set {name} (or resolution) to {use}, or give the checkpoint its own size in "
                f"{CHECKPOINT_DEFAULTS_FILES[0]}.")
    return f"Use {use} for {name} (or resolution), or leave it unset for the model's own {own}."


def check_generation_settings(settings: GenerationSettings, *, guidance_scales: Sequence[float] = (),
                              negative_prompt: str = "") -> list[str]:
    """Refuse the values of ``settings`` the model cannot take; return the warnings about guidance it ignores.

    Errors (``ValueError``, worded by :func:`impossible_value_message`): a side that is not a multiple of the VAE
    factor times the patch size or is beyond the transformer's positional range; a text length beyond what the
    pipeline and its encoder take (or not the one length a family needs); a frame count or size the family's VAE cannot
    make (the adapter's ``check_num_frames`` / ``check_video_settings``). Warnings: a guidance scale that a distilled
    model ignores or was distilled without; a negative prompt that a guidance embedding ignores.
    """
    from . import family_adapter_class

    profile, values, model = settings.profile, settings.values, settings.model
    # the family's own frame and size rules first: the trainer runs them before loading too, in these words
    adapter_cls = family_adapter_class(profile.pipeline_class)
    adapter_cls.check_num_frames(values["num_frames"])
    adapter_cls.check_video_settings(values["num_frames"], values["height"], values["width"],
                                     settings.configs.config("vae") or None)
    rule = profile.size
    own = settings.own
    allowed_size = f"multiples of {rule.multiple}" + (f" up to {rule.max_side}" if rule.max_side else "")
    for name in ("height", "width"):
        value = values[name]
        own_size = f"{own['height']} x {own['width']}" if settings.sources[name] == GIVEN else None
        if value < rule.multiple or value % rule.multiple:
            raise ValueError(impossible_value_message(
                name, value, model, f"sides must be multiples of {rule.multiple} ({rule.multiple_why})", allowed_size,
                _size_fix(name, value, rule.multiple, rule.max_side, own_size)))
        if rule.max_side is not None and value > rule.max_side:
            raise ValueError(impossible_value_message(
                name, value, model, f"{rule.max_why}, so sides end at {rule.max_side}", allowed_size,
                _size_fix(name, value, rule.multiple, rule.max_side, own_size)))
    text, length = profile.text, values["max_sequence_length"]
    if text.used:
        own_text = f"the model's own {own['max_sequence_length']}"
        if text.exact is not None and length != text.exact:
            raise ValueError(impossible_value_message(
                "max_sequence_length", length, model, text.exact_why, f"exactly {text.exact}",
                f"Set max_sequence_length: {text.exact}, or leave it unset ({own_text})."))
        if length < 1 or (text.limit is not None and length > text.limit):
            allowed = f"1 to {text.limit}" if text.limit is not None else "1 or more"
            why = f"{text.limit_why} is {text.limit}" if text.limit is not None else "a text length is at least 1"
            raise ValueError(impossible_value_message(
                "max_sequence_length", length, model, why, allowed,
                f"Set max_sequence_length to {text.limit} or less, or leave it unset ({own_text})."
                if text.limit is not None else f"Leave it unset ({own_text})."))
    return _guidance_warnings(settings, guidance_scales, negative_prompt)


def _guidance_warnings(settings: GenerationSettings, guidance_scales: Sequence[float],
                       negative_prompt: str) -> list[str]:
    profile, values, model = settings.profile, settings.values, settings.model
    scales = {"guidance_scale": values["guidance_scale"], "eval_guidance_scale": values["eval_guidance_scale"]}
    for k, scale in enumerate(guidance_scales):
        scales[f"eval_guidance_scales[{k}]"] = float(scale)
    notes: list[str] = []
    seen: set[float] = set()
    off = profile.cfg_off
    for name, scale in scales.items():
        if scale in seen or scale == off:
            continue
        seen.add(scale)
        if profile.guidance == "ignored":
            notes.append(f"{name}={scale:g} has no effect on {model}: {profile.guidance_why}. Leave it unset (the "
                         f"model's own: {profile.published.guidance_scale:g}).")
        elif profile.published.distilled and profile.guidance == "cfg" and (scale > off):
            notes.append(f"{name}={scale:g} samples {model} with classifier-free guidance (two passes a step), but it "
                         f"is distilled to sample without it ({profile.published.source}); the guidance it was "
                         f"distilled for is {off:g}. Leave it unset unless guidance is what you study.")
    if profile.guidance == "embedded" and negative_prompt:
        notes.append(f"negative_prompt={negative_prompt!r} is not used by {model}: it takes {profile.guidance_why}.")
    return notes


# --------------------------------------------------------------------------------------------------------------------
# the trainers' configuration
# --------------------------------------------------------------------------------------------------------------------

def explicit_settings(args: Any) -> dict[str, Any]:
    """The generation settings a configuration gives (``None``: the model's own)."""
    return {name: getattr(args, name, None) for name in GENERATION_SETTINGS}


def apply_generation_settings(args: Any, settings: GenerationSettings) -> None:
    """Write the resolved values into the configuration ``args`` (so that the saved configuration holds them; a
    square size also sets ``resolution``) and run its checks that depend on them again."""
    for name in GENERATION_SETTINGS:
        setattr(args, name, settings.values[name])
    if getattr(args, "resolution", None) is None and settings.values["height"] == settings.values["width"]:
        args.resolution = settings.values["height"]
    recheck = getattr(args, "_check_generation_settings", None)
    if recheck is not None:
        recheck()


def resolve_config_settings(configs: ModelConfigs, args: Any) -> GenerationSettings:
    """Resolve and check the generation settings of a trainer configuration ``args`` for the model of ``configs``,
    warn about guidance the model ignores, and write the values into ``args``."""
    settings = resolve_generation_settings(configs, explicit_settings(args),
                                           cfg_free=getattr(args, "_cfg_free_rollouts", None),
                                           guidance_scales=getattr(args, "eval_guidance_scales", None) or (),
                                           negative_prompt=getattr(args, "negative_prompt", "") or "")
    for note in settings.warnings:
        warnings.warn(note, UserWarning, stacklevel=3)
    apply_generation_settings(args, settings)
    return settings


def resolve_trainer_settings(model: Any, args: Any, index: Mapping[str, Any] | None = None,
                             pipeline_kwargs: Mapping[str, Any] | None = None) -> GenerationSettings | None:
    """The trainers' one call: resolve, check and write into ``args`` the generation settings for ``model`` (a hub id,
    a folder or a loaded ``DiffusionPipeline``), and log them in one INFO line.

    Called before loading, with the ``model_index.json`` the trainer could read (``index``; ``None`` when it could
    not, and then nothing is done and ``None`` returned), and once more right after loading with the pipeline when it
    returned ``None`` the first time. Nothing is loaded here.
    """
    from diffusers import DiffusionPipeline

    if isinstance(model, DiffusionPipeline):
        configs = configs_from_pipeline(model)
    elif index is None or not isinstance(model, (str, os.PathLike)):
        return None
    else:
        hub = {k: v for k, v in (pipeline_kwargs or {}).items() if k in ("revision", "cache_dir", "token")}
        configs = read_model_configs(model, **hub)
        if configs is None:
            return None
    settings = resolve_config_settings(configs, args)
    logger.info(settings.describe())
    return settings


__all__ = [
    "CHECKPOINT_DEFAULTS_FILES", "CHECKPOINT_DEFAULT_KEYS", "GENERATION_SETTINGS", "GenerationSettings",
    "apply_generation_settings", "check_generation_settings", "configs_from_pipeline", "explicit_settings",
    "generation_card_lines",
    "impossible_value_message", "read_checkpoint_defaults", "read_model_configs", "resolve_config_settings",
    "resolve_generation_settings", "resolve_trainer_settings",
]


def generation_card_lines(trainer: Any) -> list[str]:
    """The model card's line about the generation settings of ``trainer`` (empty when they were not resolved)."""
    settings = getattr(trainer, "generation_settings", None)
    return [settings.card_line()] if settings is not None else []
