"""flowgrpo keeps TRL's conventions (docs/architecture.md, "Why trl is a dependency"): the recipe's model fields have
the names of TRL's ModelConfig (TrlParser's ``--config PATH`` is tested with the recipes, tests/cli/test_cli.py)."""

from __future__ import annotations

import dataclasses

import pytest

from flowgrpo.cli import ModelArguments

TRL_MODEL_FIELDS = ("model_name_or_path", "model_revision", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
                    "lora_target_modules")


def test_model_fields_have_trls_names():
    trl = pytest.importorskip("trl")
    trl_fields = {f.name for f in dataclasses.fields(trl.ModelConfig)}
    ours = {f.name for f in dataclasses.fields(ModelArguments)}
    for name in TRL_MODEL_FIELDS:
        assert name in trl_fields, f"TRL's ModelConfig no longer has {name}: update docs/architecture.md"
        assert name in ours
    assert "dtype" in trl_fields  # ours is a field of the trainer's configuration, under the same recipe key

