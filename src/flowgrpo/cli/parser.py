"""Recipes: one YAML file sets every argument of a run; ``--key value`` flags on the command line override it.

    python src/train.py recipes/ocr.yaml --max_steps 100 --output_dir runs/ocr
    accelerate launch --config_file accelerate_configs/fsdp8.yaml src/train.py recipes/ocr.yaml

A recipe is a flat YAML mapping whose keys are the fields of :class:`ScriptArguments`, :class:`ModelArguments` and
the configuration of the trainer it names with ``trainer:`` (a name of the trainer registry,
``flowgrpo.trainer.registry``: ``flow_grpo``, the default, :class:`~flowgrpo.FlowGRPOConfig`; ``diffusion_nft``,
:class:`~flowgrpo.DiffusionNFTConfig`; ... and any plugin's; ``src/train.py --help`` lists Flow-GRPO's settings,
``--trainer NAME --help`` another trainer's), plus an optional ``env`` mapping of environment variables set before
anything else (as in TRL's recipes). The same parsing is importable::

    from flowgrpo.cli import parse_recipe
    script_args, model_args, training_args = parse_recipe("recipes/tiny_cpu.yaml", overrides={"max_steps": 2})

Precedence: the recipe, then ``overrides``, then command-line flags. Unknown keys, in the recipe, in ``overrides``
or on the command line, fail at once with the closest valid names; so does an unreadable recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..trainer.registry import DEFAULT_TRAINER, TRAINERS, check_trainer_name, config_class, trainer_names, trainer_table
from .arguments import LORA_INITS, TINY_PIPELINE_FAMILIES, ModelArguments, ScriptArguments

RECIPE_SUFFIXES = (".yaml", ".yml")
#: Recipe keys that are not argument fields.
SPECIAL_KEYS = ("env",)


class RecipeError(ValueError):
    """A recipe or command line that cannot be turned into arguments (the message says what to change)."""


def _suggest(name: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    return "run `python src/train.py --help` for the valid keys."


def _other_trainer_epilog(trainer: str) -> str:
    """The end of ``--help``: the settings of other trainers this one refuses (its spec's ``refused_settings``) and
    every other trainer of the registry: what it is and the settings it has beyond this one's."""
    import dataclasses

    spec = TRAINERS[trainer]
    own = {f.name for f in dataclasses.fields(spec.config_class())}
    lines = []
    if spec.refused_settings:
        lines.append(f"Settings of other trainers that {spec.title} does not accept: "
                     + ", ".join(spec.refused_settings) + ".")
    others = []
    for name, title, summary in trainer_table():
        if name == trainer:
            continue
        try:
            extra = [f"--{f.name}" for f in dataclasses.fields(config_class(name)) if f.name not in own]
        except ImportError:  # a broken plugin: listed with its error
            extra = []
        others.append(f"trainer: {name} ({title}: {summary}" + (f"; adds {', '.join(extra)}" if extra else "") + ")")
    lines.append("The other trainers: " + "; ".join(others) + ". `--trainer NAME --help` lists a trainer's settings "
                 "with their help and defaults.")
    return " ".join(lines)


def build_parser(trainer: str = DEFAULT_TRAINER):
    """The argument parser over the three argument groups (``HfArgumentParser``, no abbreviations): the script's, the
    model's and the configuration of ``trainer`` (a name of the trainer registry)."""
    from transformers import HfArgumentParser

    spec = TRAINERS[check_trainer_name(trainer)]
    return HfArgumentParser((ScriptArguments, ModelArguments, spec.config_class()), allow_abbrev=False,
                            description=f"{spec.title} training of a flow-matching text-to-image pipeline from a YAML "
                                        "recipe; --key value flags override the recipe. The recipe key trainer "
                                        f"({' | '.join(trainer_names())}) picks the algorithm.",
                            epilog=_other_trainer_epilog(trainer),
                            usage="%(prog)s [RECIPE.yaml] [--key value ...]")


def _field_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> the action that parses it (the positive flag for booleans, not ``--no_*``)."""
    actions: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest in (argparse.SUPPRESS, "help") or not action.option_strings:
            continue
        if all(opt.startswith("--no_") for opt in action.option_strings) and action.dest in actions:
            continue
        actions.setdefault(action.dest, action)
    return actions


def load_recipe(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML recipe into a dict; a missing, unreadable or malformed file is a :class:`RecipeError`."""
    import yaml

    path = Path(path)
    if not path.exists():
        hint = ""
        if not path.is_absolute():
            hint = f" (looked in {Path.cwd()}; recipes ship in the repository's recipes/ folder, e.g. " \
                   "recipes/tiny_cpu.yaml)"
        raise RecipeError(f"Recipe file not found: {str(path)!r}{hint}.")
    if path.is_dir():
        raise RecipeError(f"Recipe {str(path)!r} is a directory; pass a YAML file such as recipes/tiny_cpu.yaml.")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"Cannot read recipe {str(path)!r}: {err}.") from err
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise RecipeError(f"Recipe {str(path)!r} is not valid YAML: {err}") from err
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise RecipeError(f"Recipe {str(path)!r} must be a YAML mapping of 'key: value' lines, got a "
                          f"{type(config).__name__}.")
    bad = [k for k in config if not isinstance(k, str)]
    if bad:
        raise RecipeError(f"Recipe {str(path)!r} has non-string keys {bad}; keys are argument names such as "
                          "'learning_rate'.")
    return config


def _coerce(action: argparse.Action, key: str, value: Any, source: str) -> Any:
    """Convert a YAML/override value with the flag's own type (YAML reads 3e-4 as a string, for example)."""
    if value is None:
        return None
    convert = action.type if callable(action.type) else None

    def one(v: Any) -> Any:
        if convert is None or v is None:
            return v
        if isinstance(v, str) or (convert is float and isinstance(v, int) and not isinstance(v, bool)):
            try:
                return convert(v)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
                raise RecipeError(f"{source}: {key}={v!r} is not a valid {getattr(convert, '__name__', 'value')} "
                                  f"({err}).") from err
        return v

    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{source}: {key} takes a list, got {value!r}.")
        value = [one(v) for v in value]
        if action.choices is not None:
            for v in value:
                if v not in action.choices:
                    raise RecipeError(f"{source}: {key} has {v!r}; choose from {list(action.choices)}.")
        return value
    value = one(value)
    if action.choices is not None and value not in action.choices:
        raise RecipeError(f"{source}: {key}={value!r} is not valid; choose one of {list(action.choices)}.")
    return value


def _other_trainer_setting(name: str, trainer: str) -> str | None:
    """Why ``name`` is not a setting of ``trainer`` when it is one of another trainer's (the first in the registry's
    order that has it), with the reason the trainer's spec gives when it refuses it; else None."""
    import dataclasses

    spec = TRAINERS[trainer]
    if name in {f.name for f in dataclasses.fields(spec.config_class())}:
        return None
    owner = None
    for other in trainer_names():
        if other == trainer:
            continue
        try:
            if name in {f.name for f in dataclasses.fields(config_class(other))}:
                owner = TRAINERS[other]
                break
        except ImportError:  # a broken plugin: not a hint worth failing for
            continue
    if name in spec.refused_settings:
        whose = f"a {owner.title} setting" if owner is not None else "a setting"
        return f"{whose} that {spec.title} does not use: {spec.refused_settings[name]}; remove it."
    if owner is not None:
        return f"a {owner.title} setting: add trainer: {owner.name} to the recipe (or --trainer {owner.name})."
    return None


def _unknown_key_line(key: str, valid: Sequence[str], trainer: str) -> str:
    return f"  {key!r}: {_other_trainer_setting(key.lstrip('-'), trainer) or _suggest(key, valid)}"


def _apply_defaults(actions: dict[str, argparse.Action], values: Mapping[str, Any], source: str,
                    trainer: str = DEFAULT_TRAINER) -> None:
    unknown = [k for k in values if k not in actions]
    if unknown:
        valid = sorted(actions)
        lines = [_unknown_key_line(k, valid, trainer) for k in unknown]
        raise RecipeError(f"{source} has unknown key(s):\n" + "\n".join(lines))
    for key, value in values.items():
        action = actions[key]
        action.default = _coerce(action, key, value, source)
        action.required = False


def _split_argv(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """Take the recipe path out of ``argv``: a leading positional argument or ``--config PATH``."""
    argv = list(argv)
    recipe = None
    for flag in ("--config", "--recipe"):
        for i, arg in enumerate(argv):
            if arg == flag:
                if i + 1 >= len(argv):
                    raise RecipeError(f"{flag} needs a path, e.g. {flag} recipes/tiny_cpu.yaml.")
                recipe = argv[i + 1]
                del argv[i:i + 2]
                break
            if arg.startswith(flag + "="):
                recipe = arg.split("=", 1)[1]
                del argv[i]
                break
    if argv and not argv[0].startswith("-"):
        if recipe is not None:
            raise RecipeError(f"Two recipes given ({recipe!r} and {argv[0]!r}); pass one.")
        recipe = argv.pop(0)
    return recipe, argv


def _unknown_cli(remaining: list[str], actions: dict[str, argparse.Action], parser,
                 trainer: str = DEFAULT_TRAINER) -> None:
    if not remaining:
        return
    options = sorted({opt for a in parser._actions for opt in a.option_strings
                      if opt.startswith("--") and "-" not in opt[2:]})
    lines = []
    for arg in remaining:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            lines.append(_unknown_key_line(flag, options, trainer))
        elif arg.startswith("-"):
            lines.append(f"  {arg!r}: flags are written --key value.")
    if not lines:
        lines = [f"  unexpected value(s) {remaining}: give the recipe first and every setting as --key value."]
    raise RecipeError("Unknown command-line argument(s):\n" + "\n".join(lines))


def check_arguments(script_args: ScriptArguments, model_args: ModelArguments) -> None:
    """Cheap consistency checks of the script and model arguments (nothing is loaded)."""
    if not script_args.dataset_name:
        raise RecipeError("No prompts: set dataset_name (a Hub dataset id, a .txt/.jsonl/.json/.csv/.parquet file or "
                          "a folder with train/test files), e.g. --dataset_name data/ocr_synthetic.")
    if not script_args.reward_funcs:
        raise RecipeError("No reward: set reward_funcs, e.g. --reward_funcs ocr (flowgrpo.rewards.list_rewards() "
                          "lists the built-in names; 'package.module:function' paths work too).")
    if not model_args.model_name_or_path:
        raise RecipeError("No model: set model_name_or_path, e.g. --model_name_or_path "
                          "stabilityai/stable-diffusion-3.5-medium.")
    if model_args.lora_init.lower() not in LORA_INITS:
        raise RecipeError(f"lora_init={model_args.lora_init!r} is not valid; choose one of {list(LORA_INITS)} "
                          f"({_suggest(model_args.lora_init.lower(), list(LORA_INITS))}).")
    family = model_args.build_tiny_pipeline_if_missing
    if family is not None and family not in TINY_PIPELINE_FAMILIES:
        raise RecipeError(f"build_tiny_pipeline_if_missing={family!r} is not a tiny pipeline family; choose one of "
                          f"{list(TINY_PIPELINE_FAMILIES)}, or leave it unset for real models.")
    for name in ("max_train_samples", "max_eval_samples"):
        value = getattr(script_args, name)
        if value is not None and value < 1:
            raise RecipeError(f"{name}={value} must be a positive number of prompts (or unset for all).")
    if model_args.use_peft and (model_args.lora_r < 1 or model_args.lora_alpha <= 0):
        raise RecipeError(f"lora_r={model_args.lora_r} and lora_alpha={model_args.lora_alpha} must be positive.")
    if not 0 <= model_args.lora_dropout < 1:
        raise RecipeError(f"lora_dropout={model_args.lora_dropout} must be in [0, 1).")
    check_reward_names(script_args.reward_funcs)


def check_reward_names(reward_funcs: Sequence[str]) -> None:
    """Registry names must exist (closest names suggested); ``module:function`` paths are imported later."""
    try:
        from ..rewards import has_reward, list_rewards
    except ImportError:  # the registry is optional at parse time; the trainer resolves the names again
        return
    for name in reward_funcs:
        if ":" in name or "." in name or has_reward(name):  # a name: found by its entry point, nothing imported
            continue
        known = list(list_rewards())  # a miss: every name, for the suggestion
        raise RecipeError(f"reward_funcs: unknown reward {name!r}; {_suggest(name, known)} Registered: "
                          f"{', '.join(sorted(known))}; or give a 'package.module:function' path.")


def _weights_follow_replaced_rewards(actions: dict[str, argparse.Action], overrides: Mapping[str, Any] | None,
                                     cli: Sequence[str]) -> None:
    """A recipe's ``reward_weights`` belong to the recipe's ``reward_funcs``: when the overrides or the command line
    replace the rewards by a different number of them and give no weights, the recipe's weights are dropped (every
    reward weighs 1) instead of refused."""
    def given(name: str) -> bool:
        return name in (overrides or {}) or any(a == f"--{name}" or a.startswith(f"--{name}=") for a in cli)

    funcs, weights = actions.get("reward_funcs"), actions.get("reward_weights")
    if funcs is None or weights is None or weights.default is None or not given("reward_funcs") or \
            given("reward_weights"):
        return
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    probe.add_argument("--reward_funcs", nargs="+", default=None)
    new = probe.parse_known_args(list(cli))[0].reward_funcs or (overrides or {}).get("reward_funcs")
    new = [new] if isinstance(new, str) else list(new or [])
    if len(new) != len(weights.default):
        weights.default = None


def parse_recipe(recipe_or_argv: str | os.PathLike | Sequence[str] | None = None,
                 overrides: Mapping[str, Any] | None = None):
    """Parse a recipe and command-line flags into ``(script_args, model_args, training_args)``.

    Args:
        recipe_or_argv: a recipe path, or a command line (``["recipes/ocr.yaml", "--max_steps", "10"]``; the recipe
            may also be given as ``--config PATH``). ``None`` reads ``sys.argv[1:]``.
        overrides: ``{key: value}`` applied on top of the recipe (command-line flags still win).

    Returns:
        ``(ScriptArguments, ModelArguments, config)`` with ``config`` a ``FlowGRPOConfig`` or, for ``trainer:
        diffusion_nft``, a ``DiffusionNFTConfig``.

    Raises:
        RecipeError: unreadable recipe, unknown key (with the closest valid ones), bad value, missing dataset,
            model or reward.
    """
    if recipe_or_argv is None:
        argv = sys.argv[1:]
    elif isinstance(recipe_or_argv, (str, os.PathLike)):
        argv = [os.fspath(recipe_or_argv)]
    else:
        argv = [os.fspath(a) for a in recipe_or_argv]
    recipe_path, cli = _split_argv(argv)

    config: dict[str, Any] = {}
    if recipe_path is not None:
        config = load_recipe(recipe_path)
        env = config.pop("env", None) or {}
        if not isinstance(env, dict):
            raise RecipeError(f"Recipe {recipe_path!r}: 'env' must be a mapping of environment variables, got "
                              f"{env!r}.")
        for key, value in env.items():
            os.environ[str(key)] = str(value)
    trainer = _select_trainer(config, overrides, cli)
    parser = build_parser(trainer)
    actions = _field_actions(parser)
    if recipe_path is not None:
        _apply_defaults(actions, config, f"Recipe {recipe_path!r}", trainer)
    if overrides:
        _apply_defaults(actions, dict(overrides), "overrides", trainer)
    _default_to_cpu_ranks(actions, config, overrides)
    _weights_follow_replaced_rewards(actions, overrides, cli)

    # Unknown flags first: building the dataclasses runs TrainingArguments.__post_init__ (device set-up).
    _, remaining = parser.parse_known_args(args=cli)
    _unknown_cli(remaining, actions, parser, trainer)
    try:
        with bf16_hardware_check_deferred():
            script_args, model_args, training_args = parser.parse_args_into_dataclasses(
                args=cli, look_for_args_file=False)
    except (TypeError, ValueError) as err:  # __post_init__ checks of the trainer's configuration
        raise RecipeError(f"Invalid training arguments: {err}") from err
    check_arguments(script_args, model_args)
    _drop_replaced_rewards_weights(script_args, training_args, cli, overrides)
    check_reward_weights(script_args, training_args)
    _check_world(training_args)
    return script_args, model_args, training_args


def _given(name: str, cli: Sequence[str], overrides: Mapping[str, Any] | None) -> bool:
    flags = (f"--{name}", f"--{name.replace('_', '-')}")
    return any(a in flags or a.startswith(tuple(f + "=" for f in flags)) for a in cli) or name in (overrides or {})


def _drop_replaced_rewards_weights(script_args: ScriptArguments, training_args: Any, cli: Sequence[str],
                                   overrides: Mapping[str, Any] | None) -> None:
    """A recipe's ``reward_weights`` belong to its ``reward_funcs``: when the command line (or ``overrides``) replaces
    the rewards by a different number of them without giving weights, the recipe's weights are dropped (the rewards
    are then weighted equally), with a notice. Weights given with the new rewards are checked as always."""
    weights = getattr(training_args, "reward_weights", None)
    if weights is None or len(weights) == len(script_args.reward_funcs):
        return
    if _given("reward_funcs", cli, overrides) and not _given("reward_weights", cli, overrides):
        print(f"flowgrpo: reward_funcs {list(script_args.reward_funcs)} replace the recipe's rewards; its "
              f"reward_weights {list(weights)} are dropped (equal weights).", file=sys.stderr)
        training_args.reward_weights = None


#: transformers' own words when bf16 is asked for on a machine without a bf16 GPU (kept for training's refusal).
BF16_UNSUPPORTED_MESSAGE = ("Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to train the "
                            "model on CPU.")


@contextlib.contextmanager
def bf16_hardware_check_deferred():
    """Build training arguments without transformers' bf16 hardware check (``TrainingArguments.__post_init__`` raises
    "Your setup doesn't support bf16/gpu" on a machine without a bf16 GPU), so that a GPU recipe parses, validates and
    plans on a laptop. Every other check of ``__post_init__`` still runs; :func:`check_training_hardware` applies the
    deferred one when training starts."""
    import transformers.training_args as training_args_module

    original = training_args_module.is_torch_bf16_gpu_available
    training_args_module.is_torch_bf16_gpu_available = lambda: True
    try:
        yield
    finally:
        training_args_module.is_torch_bf16_gpu_available = original


def check_training_hardware(training_args: Any) -> None:
    """Refuse to train in bf16 without a bf16 GPU (or ``use_cpu``), with the error transformers gives: the check that
    :func:`parse_recipe` defers so that parsing and planning work without a GPU."""
    if not (getattr(training_args, "bf16", False) or getattr(training_args, "bf16_full_eval", False)):
        return
    if getattr(training_args, "use_cpu", False):
        return
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_cuda_available, is_torch_xla_available

    if is_torch_bf16_gpu_available() or is_torch_xla_available():
        return
    message = BF16_UNSUPPORTED_MESSAGE
    if is_torch_cuda_available():
        message += " You need Ampere+ GPU with cuda>=11.0."
    raise RecipeError(f"Invalid training arguments: {message} (The recipe itself is valid: `python -m flowgrpo.plan "
                      "RECIPE` plans it on this machine.)")


def _select_trainer(config: Mapping[str, Any], overrides: Mapping[str, Any] | None, cli: Sequence[str]) -> str:
    """The trainer named by the command line (``--trainer NAME``), else ``overrides``, else the recipe, else
    ``flow_grpo``; a name that is no trainer is a :class:`RecipeError`."""
    name, source = config.get("trainer", DEFAULT_TRAINER), "recipe"
    if overrides and "trainer" in overrides:
        name, source = overrides["trainer"], "overrides"
    for i, arg in enumerate(cli):
        if arg == "--trainer" and i + 1 < len(cli):
            name, source = cli[i + 1], "command line"
        elif arg.startswith("--trainer="):
            name, source = arg.split("=", 1)[1], "command line"
    try:
        check_trainer_name(name)
    except ValueError as err:
        raise RecipeError(f"{source}: {err}") from None
    return str(name)


def _launched_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _default_to_cpu_ranks(actions: dict[str, argparse.Action], config: Mapping[str, Any],
                          overrides: Mapping[str, Any] | None) -> None:
    """Under a multi-process launcher on a machine without CUDA, default ``use_cpu`` to true: otherwise accelerate
    sets up no process group and every process silently trains on its own."""
    if _launched_world_size() <= 1 or "use_cpu" in config or (overrides and "use_cpu" in overrides):
        return
    import torch

    if not torch.cuda.is_available():
        actions["use_cpu"].default = True


def _check_world(training_args: Any) -> None:
    launched = _launched_world_size()
    if launched > 1 and training_args.world_size != launched:
        raise RecipeError(
            f"The launcher started {launched} processes (WORLD_SIZE={launched}) but the training arguments see "
            f"world_size={training_args.world_size}: the processes would train independently. On CPU set "
            "use_cpu: true (accelerate_configs/cpu_ddp.yaml + a CPU recipe); on GPUs check the accelerate config.")


def check_reward_weights(script_args: ScriptArguments, training_args: Any) -> None:
    weights = getattr(training_args, "reward_weights", None)
    if weights is not None and len(weights) != len(script_args.reward_funcs):
        raise RecipeError(f"reward_weights has {len(weights)} value(s) {list(weights)} for {len(script_args.reward_funcs)} "
                          f"reward(s) {list(script_args.reward_funcs)}; give one weight per reward.")


__all__ = ["BF16_UNSUPPORTED_MESSAGE", "RecipeError", "bf16_hardware_check_deferred", "build_parser",
           "check_arguments", "check_training_hardware", "load_recipe", "parse_recipe"]
