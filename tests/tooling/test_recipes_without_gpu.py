"""GPU recipes parse, validate and show ``--help`` on a machine without a GPU; only training refuses bf16 there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowgrpo.cli.parser import BF16_UNSUPPORTED_MESSAGE, RecipeError, check_training_hardware, parse_recipe

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
NO_BF16_GPU = not (torch.cuda.is_available() and torch.cuda.is_bf16_supported())


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_parses_without_a_gpu(recipe):
    import yaml

    written = yaml.safe_load((REPO / "recipes" / recipe).read_text())
    _, model_args, args = parse_recipe(str(REPO / "recipes" / recipe))
    assert model_args.model_name_or_path == written["model_name_or_path"]
    assert args.bf16 == bool(written.get("bf16", False))  # the recipe's precision is kept, not switched off


@pytest.mark.skipif(not NO_BF16_GPU, reason="the refusal is for machines without a bf16 GPU")
def test_training_a_bf16_recipe_refuses_with_transformers_message(capsys):
    from flowgrpo.cli.train import main

    _, _, args = parse_recipe(str(REPO / "recipes" / "ocr.yaml"))
    assert args.bf16 and not args.use_cpu
    with pytest.raises(RecipeError, match="doesn't support bf16/gpu"):
        check_training_hardware(args)
    with pytest.raises(SystemExit) as exit_info:
        main([str(REPO / "recipes" / "ocr.yaml")])
    assert exit_info.value.code == 2
    assert BF16_UNSUPPORTED_MESSAGE in capsys.readouterr().err


def test_cpu_training_of_a_bf16_recipe_is_not_refused():
    _, _, args = parse_recipe([str(REPO / "recipes" / "ocr.yaml"), "--use_cpu", "true"])
    check_training_hardware(args)  # use_cpu: the user asked for CPU training
    _, _, args = parse_recipe([str(REPO / "recipes" / "ocr.yaml"), "--bf16", "false"])
    check_training_hardware(args)


def test_other_training_argument_checks_still_run():
    with pytest.raises(RecipeError, match="fp16 and bf16"):
        parse_recipe([str(REPO / "recipes" / "ocr.yaml"), "--fp16", "true"])


def test_help_of_a_gpu_recipe_without_a_gpu(capsys):
    from flowgrpo.cli.train import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(REPO / "recipes" / "ocr.yaml"), "--help"])
    assert exit_info.value.code == 0
    assert "--num_generations" in capsys.readouterr().out
