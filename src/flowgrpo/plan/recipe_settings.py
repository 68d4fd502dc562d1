"""A recipe's generation settings as its training run would resolve them, without loading the model.

``flowgrpo plan`` plans the settings a run will use; a recipe that leaves one unset (``None``: the model's own) gets
it the way the trainer gets it (:mod:`flowgrpo.models.defaults`), from the model's component configs: the pipeline
folder, the Hugging Face cache, the tiny pipeline or toy world the recipe builds, else the packaged config of a known Hub id
(``flowgrpo/plan/model_configs``: transformer, VAE and scheduler configs, without the text encoders' and without a
checkpoint's own defaults). The same checks refuse what the model cannot take, with the trainer's words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models.defaults import GenerationSettings, read_model_configs, resolve_config_settings
from ..models.profile import ModelConfigs
from .model_specs import ModelSpec


def configs_from_spec(spec: ModelSpec, name: str) -> ModelConfigs:
    """The component configs a planner's :class:`~flowgrpo.plan.model_specs.ModelSpec` holds (no text encoder or
    tokenizer configs; a two-expert model's second transformer is the first's config)."""
    components: dict[str, dict[str, Any]] = {"transformer": dict(spec.transformer_config), "vae": dict(spec.vae_config),
                                             "scheduler": dict(spec.scheduler_config)}
    if spec.experts > 1:
        components["transformer_2"] = dict(spec.transformer_config)
    components.update({key: dict(config) for key, (_, config) in spec.components.items()})
    return ModelConfigs(pipeline_class=spec.pipeline_class, name=name, components=components,
                        pipeline_config=dict(spec.pipeline_config),
                        origin=f"packaged config {spec.name}" if spec.origin == "packaged" else spec.origin)


def recipe_model_configs(model_args: Any, spec: ModelSpec | None = None) -> ModelConfigs:
    """The component configs of a recipe's model, read as ``flowgrpo plan`` finds it (``spec``: the planner's sizes of
    it, looked up when not given)."""
    name = str(model_args.model_name_or_path)
    path = Path(name).expanduser()
    if (path / "model_index.json").is_file():
        return read_model_configs(path)
    family = getattr(model_args, "build_tiny_pipeline_if_missing", None)
    seed = getattr(model_args, "tiny_pipeline_seed", 0)
    if family == "toy":
        from ..toy.build import SHIPPED_PRESET, shipped_toy_world

        shipped = shipped_toy_world(SHIPPED_PRESET, seed)
        if shipped is not None:  # the world the recipe builds is the shipped one: its folder, own defaults included
            return read_model_configs(shipped)
    elif family:
        from ..testing import cached_tiny_pipeline_path

        return read_model_configs(cached_tiny_pipeline_path(family, seed=seed))
    if spec is None:  # a Hub id: its snapshot in the Hugging Face cache, else the packaged config (no download)
        from .model_specs import spec_for_model_args

        spec = spec_for_model_args(model_args)
    if spec.origin != "packaged" and spec.sources and (Path(spec.sources[0]) / "model_index.json").is_file():
        return read_model_configs(spec.sources[0])
    return configs_from_spec(spec, name)


def resolve_recipe_settings(script_args: Any, model_args: Any, training_args: Any,
                            spec: ModelSpec | None = None) -> GenerationSettings:
    """Resolve, check and write into ``training_args`` the generation settings of a parsed recipe, as its training run
    will (``spec``: the planner's sizes of the model, when already looked up). Raises ``ValueError`` with the trainer's
    words for a value the model cannot take."""
    return resolve_config_settings(recipe_model_configs(model_args, spec), training_args)


__all__ = ["configs_from_spec", "recipe_model_configs", "resolve_recipe_settings"]
