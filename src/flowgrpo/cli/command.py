"""The ``flowgrpo`` command: one entry point for the project's tools, each a subcommand with its own ``--help``.

    flowgrpo train recipes/ocr.yaml --max_steps 100      # training from a recipe (what src/train.py runs)
    flowgrpo evaluate --benchmark geneval --lora you/sd35m-geneval --output results/geneval
    flowgrpo reward-server --rewards ocr --port 8000     # rewards over HTTP (also flowgrpo-reward-server)
    flowgrpo plan recipes/ocr.yaml                       # plan a recipe's memory and time without a GPU

``python -m flowgrpo`` is the same command. Each subcommand's module is imported only when it runs, so
``flowgrpo --help`` and one subcommand's ``--help`` load no model library they do not need. Under ``accelerate
launch``, give the subcommand's module: ``accelerate launch src/train.py ...`` or ``accelerate launch -m
flowgrpo.evaluate ...`` (``accelerate launch -m flowgrpo train ...`` works too).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SUBCOMMANDS", "Subcommand", "main"]


@dataclass(frozen=True)
class Subcommand:
    """A subcommand: the module and function that run it (``function(argv)``) and one line of help."""

    name: str
    module: str
    function: str
    summary: str


SUBCOMMANDS: dict[str, Subcommand] = {s.name: s for s in (
    Subcommand("train", "flowgrpo.cli.train", "main",
               "train from a YAML recipe; --key value flags override it (what src/train.py runs)"),
    Subcommand("evaluate", "flowgrpo.evaluate.cli", "main",
               "generate a benchmark (geneval, ocr, pickscore, toy) under its protocol and score it"),
    Subcommand("reward-server", "flowgrpo.rewards.server", "main",
               "serve registered rewards over HTTP for the `remote` reward (also flowgrpo-reward-server)"),
    Subcommand("plan", "flowgrpo.plan", "main",
               "plan a recipe's memory and step time on the GPUs it names, without a GPU"),
)}


def _usage() -> str:
    from .. import __version__

    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"usage: flowgrpo <command> [options]   (flowgrpo {__version__})", "",
             "Online RL for flow-matching image generators (Flow-GRPO and family).", "", "commands:"]
    lines += [f"  {s.name:<{width}}  {s.summary}" for s in SUBCOMMANDS.values()]
    lines += ["", "`flowgrpo <command> --help` shows a command's options."]
    return "\n".join(lines)


def _load(sub: Subcommand) -> Any:
    """The subcommand's function; a missing module (not installed in this version) is a clear error."""
    try:
        module = importlib.import_module(sub.module)
    except ModuleNotFoundError as err:
        if err.name is not None and (sub.module == err.name or sub.module.startswith(err.name + ".")):
            raise SystemExit(f"flowgrpo {sub.name}: this installation has no {sub.module} module, so `flowgrpo "
                             f"{sub.name}` is not available; update flowgrpo (pip install -U flowgrpo, or pull the "
                             "repository and reinstall).") from err
        raise
    function = getattr(module, sub.function, None)
    if function is None:
        raise SystemExit(f"flowgrpo {sub.name}: {sub.module} has no {sub.function}() to run.")
    return function


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``flowgrpo <command> ...``; returns the exit status."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"flowgrpo {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name == "train" and from_command_line:  # this process trains (flowgrpo.process_gc)
        from ..process_gc import pause_until_training

        pause_until_training()
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        print(f"flowgrpo: {name!r} is not a command.{hint} Commands: {', '.join(SUBCOMMANDS)}; `flowgrpo --help` "
              "describes them.", file=sys.stderr)
        return 2
    function = _load(sub)
    # argparse and HfArgumentParser name the program after sys.argv[0]: show `flowgrpo <command>` in usage lines.
    saved = sys.argv
    sys.argv = [f"flowgrpo {name}", *rest]
    try:
        if sub.name == "evaluate":
            status = function(rest, prog="flowgrpo evaluate")
        else:
            status = function(rest)
    finally:
        sys.argv = saved
    return status if isinstance(status, int) else 0
