"""The launch script's machinery, importable: recipe parsing, prompt datasets, LoRA config, the training run.

    from flowgrpo.cli import parse_recipe, load_prompt_dataset, build_peft_config
    script_args, model_args, training_args = parse_recipe("recipes/tiny_cpu.yaml", overrides={"max_steps": 2})
    train_ds, eval_ds = load_prompt_dataset(script_args)

``src/train.py`` is ``flowgrpo.cli.main()``.
"""

from .arguments import DEFAULT_LORA_TARGET_MODULES, LORA_INITS, ModelArguments, ScriptArguments
from .parser import RecipeError, load_recipe, parse_recipe

__all__ = [
    "DEFAULT_LORA_TARGET_MODULES",
    "LORA_INITS",
    "ModelArguments",
    "RecipeError",
    "ScriptArguments",
    "build_peft_config",
    "load_prompt_dataset",
    "load_recipe",
    "main",
    "make_ocr_prompts",
    "parse_recipe",
    "run",
    "write_ocr_prompt_files",
]


def __getattr__(name: str):
    # The data and training modules import datasets / diffusers: load them on first use.
    if name in ("load_prompt_dataset", "read_prompt_file"):
        from . import data

        return getattr(data, name)
    if name in ("make_ocr_prompts", "write_ocr_prompt_files"):
        from . import ocr_prompts

        return getattr(ocr_prompts, name)
    if name == "build_peft_config":
        from .lora import build_peft_config

        return build_peft_config
    if name in ("main", "run"):
        from . import train

        return getattr(train, name)
    raise AttributeError(f"module 'flowgrpo.cli' has no attribute {name!r}")
