"""Model sizes for planning: the families' public configs, shipped as one small JSON file per model in
``flowgrpo/plan/model_configs/``, or read from a local pipeline folder / the Hugging Face cache when present.

A model file holds (see ``sd3.5-medium.json``)::

    {"name": ..., "names": [hub ids], "family": adapter family, "pipeline_class": ...,
     "transformer": {"class_name": ..., "config": {...}}, "experts": 1 (2: Wan 2.2 A14B's two transformers),
     "vae": {"class_name": ..., "config": {...}}, "scheduler": {"class_name": ..., "config": {...}},
     "text_encoders": {name: {"params": N, "source": ...}}, "sources": [urls of the config files],
     "components": {pipeline argument: {"class_name": ..., "config": {...}}} (optional: further modules the family's
     adapter reads, e.g. LTX-2's audio VAE; built on the meta device, their weights counted),
     "pipeline_config": {...} (optional: the non-component entries of its model_index.json that decide the
     family's defaults, e.g. Wan 2.2 TI2V's expand_timesteps)}

Adding a model is adding one such file. No weights are read: a local folder contributes its ``config.json`` files and
the parameter counts in the safetensors headers (the first few KB of each file) of its text encoders.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).with_name("model_configs")

def family_of_pipeline() -> dict[str, str]:
    """Diffusers pipeline class -> adapter family, from the family table (``flowgrpo.models.FAMILIES``), for models
    read from a folder whose model_index names the class."""
    from ..models import adapter_classes

    return {name: cls.family for cls in adapter_classes() for name in cls.pipeline_class_names}


@dataclass
class ModelSpec:
    """Everything the planner needs about one pipeline's sizes."""

    name: str
    family: str
    pipeline_class: str
    transformer_class: str
    transformer_config: dict[str, Any]
    vae_class: str
    vae_config: dict[str, Any]
    scheduler_class: str
    scheduler_config: dict[str, Any]
    text_encoder_params: dict[str, int]
    experts: int = 1
    sources: list[str] = field(default_factory=list)
    components: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)  # name -> (class, config)
    pipeline_config: dict[str, Any] = field(default_factory=dict)  # model_index.json's non-component entries
    origin: str = "packaged"          # "packaged" | "local folder <path>" | "hub cache <path>"

    @property
    def text_encoder_total(self) -> int:
        return sum(self.text_encoder_params.values())


def packaged_specs() -> dict[str, dict[str, Any]]:
    """Every shipped model file, by its file name (without ``.json``)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(CONFIG_DIR.glob("*.json"))}


def spec_from_packaged(raw: dict[str, Any]) -> ModelSpec:
    return ModelSpec(
        name=raw["name"], family=raw["family"], pipeline_class=raw["pipeline_class"],
        transformer_class=raw["transformer"]["class_name"], transformer_config=dict(raw["transformer"]["config"]),
        vae_class=raw["vae"]["class_name"], vae_config=dict(raw["vae"]["config"]),
        scheduler_class=raw["scheduler"]["class_name"], scheduler_config=dict(raw["scheduler"]["config"]),
        text_encoder_params={k: int(v["params"]) for k, v in raw.get("text_encoders", {}).items()},
        experts=int(raw.get("experts", 1)), sources=list(raw.get("sources", [])),
        components={k: (v["class_name"], dict(v["config"])) for k, v in raw.get("components", {}).items()},
        pipeline_config=dict(raw.get("pipeline_config", {})))


def _safetensors_params(folder: Path) -> int:
    """Parameters of the safetensors files in ``folder``, from their headers only (no tensor data is read)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            total += count
    return total


def _config(folder: Path) -> dict[str, Any]:
    for name in ("config.json", "scheduler_config.json"):
        if (folder / name).is_file():
            raw = json.loads((folder / name).read_text())
            return {k: v for k, v in raw.items() if not k.startswith("_")}
    raise FileNotFoundError(f"no config.json in {folder}")


def _class_name(folder: Path) -> str:
    for name in ("config.json", "scheduler_config.json"):
        if (folder / name).is_file():
            return json.loads((folder / name).read_text())["_class_name"]
    raise FileNotFoundError(f"no config.json in {folder}")


def _from_folder(folder: Path, origin: str, fallback: dict[str, Any] | None) -> ModelSpec:
    index = json.loads((folder / "model_index.json").read_text())
    pipeline_class = index["_class_name"]
    known = family_of_pipeline()
    family = known.get(pipeline_class) or (fallback or {}).get("family")
    if family is None:
        raise ValueError(f"{folder}: pipeline {pipeline_class} is not a family the planner knows "
                         f"({', '.join(sorted(known))}).")
    encoders = {}
    for key in sorted(index):
        if key.startswith("text_encoder") and index[key] and index[key][0] is not None:
            params = _safetensors_params(folder / key)
            if not params and fallback:  # a folder without weights: the packaged count of the same encoder
                params = list(fallback["text_encoders"].values())[len(encoders) % len(fallback["text_encoders"])][
                    "params"]
            encoders[key] = params
    experts = 2 if index.get("transformer_2") and index["transformer_2"][0] is not None else 1
    return ModelSpec(
        name=str(folder), family=family, pipeline_class=pipeline_class,
        transformer_class=_class_name(folder / "transformer"), transformer_config=_config(folder / "transformer"),
        vae_class=_class_name(folder / "vae"), vae_config=_config(folder / "vae"),
        scheduler_class=_class_name(folder / "scheduler"), scheduler_config=_config(folder / "scheduler"),
        text_encoder_params=encoders, experts=experts, sources=[str(folder)], origin=origin,
        components={name: (_class_name(folder / name), _config(folder / name)) for name in (fallback or {}).get(
            "components", {}) if (folder / name).is_dir()})


def _hub_cache_snapshot(repo_id: str) -> Path | None:
    """The newest snapshot of ``repo_id`` in the local Hugging Face cache holding a ``model_index.json``."""
    cache = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" /
                                                                       "huggingface")) / "hub")
    snapshots = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    if not snapshots.is_dir():
        return None
    found = [s for s in snapshots.iterdir() if (s / "model_index.json").is_file()
             and (s / "transformer" / "config.json").is_file()]
    return max(found, key=lambda s: s.stat().st_mtime) if found else None


def load_model_spec(model_name_or_path: str) -> ModelSpec:
    """The sizes of ``model_name_or_path``: a local pipeline folder, else a Hub id found in the local cache, else the
    packaged file whose ``names`` (or file name) match. An unknown model lists the packaged ones."""
    packaged = packaged_specs()
    by_name = {}
    for stem, raw in packaged.items():
        for alias in [stem, raw["name"], *raw.get("names", [])]:
            by_name[alias.lower()] = raw
    fallback = by_name.get(str(model_name_or_path).lower())
    path = Path(str(model_name_or_path)).expanduser()
    if (path / "model_index.json").is_file():
        return _from_folder(path, f"local folder {path}", fallback)
    snapshot = _hub_cache_snapshot(str(model_name_or_path)) if "/" in str(model_name_or_path) else None
    if snapshot is not None:
        return _from_folder(snapshot, f"hub cache {snapshot}", fallback)
    if fallback is not None:
        return spec_from_packaged(fallback)
    raise ValueError(f"model_name_or_path={model_name_or_path!r}: no local pipeline folder, no Hugging Face cache entry "
                     f"and no packaged config of that name. Packaged models: "
                     f"{', '.join(sorted(n for r in packaged.values() for n in r.get('names', [])))}. Add a JSON file to "
                     f"{CONFIG_DIR} or point model_name_or_path at a folder saved with save_pretrained.")


__all__ = ["CONFIG_DIR", "ModelSpec", "load_model_spec", "packaged_specs", "spec_for_model_args", "spec_from_packaged",
           "toy_world_spec"]


def spec_for_model_args(model_args: Any) -> ModelSpec:
    """The model's sizes; a recipe that builds a tiny pipeline is planned on that pipeline (built offline, cached)."""
    path = Path(str(model_args.model_name_or_path)).expanduser()
    family = model_args.build_tiny_pipeline_if_missing
    if family and not (path / "model_index.json").is_file():
        if family == "toy":
            return toy_world_spec()
        else:
            from ..testing import cached_tiny_pipeline_path

            path = Path(cached_tiny_pipeline_path(family, seed=model_args.tiny_pipeline_seed))
    return load_model_spec(str(path) if (path / "model_index.json").is_file() else str(model_args.model_name_or_path))


def toy_world_spec() -> ModelSpec:
    """The toy world's sizes (``flowgrpo.toy``'s "full" preset) without training it: its transformer and VAE built on
    the meta device from the preset, the tiny SD3 pipeline's text encoders, and the preset's schedule shift."""
    import dataclasses

    import torch

    from ..testing import cached_tiny_pipeline_path
    from ..toy.build import PRESETS, _make_transformer, _make_vae
    tiny = load_model_spec(str(cached_tiny_pipeline_path("sd3", seed=0)))
    preset = PRESETS["full"]
    with torch.device("meta"):
        transformer = _make_transformer(preset, tiny.transformer_config["joint_attention_dim"],
                                        tiny.transformer_config["pooled_projection_dim"])
        vae = _make_vae(preset)
    strip = lambda config: {k: v for k, v in dict(config).items() if not k.startswith("_")}  # noqa: E731
    return dataclasses.replace(tiny, name="toy world (full preset)", transformer_config=strip(transformer.config),
                               vae_config=strip(vae.config),
                               scheduler_config=dict(tiny.scheduler_config, shift=preset.scheduler_shift),
                               origin="flowgrpo.toy preset 'full' (architecture only)")
