"""`InFlightCheckpoint`: what a checkpoint of the Ray backend holds, and its replay on resume.

`save` writes ``rollout_backend.json`` (the workers' current version, the generations in flight with the version each
was sent with, the restarts) and ``rollout_backend_weights.safetensors`` (the weights of those versions, and of the
current one while the next generation still samples with it). A resumed run first sends the in-flight generations
again, each with the weights it was first sent with, then restores the version the workers held (`replay`): it
samples, scores and trains exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BACKEND_STATE_NAME", "BACKEND_WEIGHTS_NAME", "InFlightCheckpoint"]

BACKEND_STATE_NAME = "rollout_backend.json"
BACKEND_WEIGHTS_NAME = "rollout_backend_weights.safetensors"


class InFlightCheckpoint:
    """The checkpointed part of a run's rollouts (see the module docstring); ``rank``: this process's index (process
    0 keeps the weights)."""

    def __init__(self, weight_sync_steps: int, rank: int):
        self.weight_sync_steps = weight_sync_steps
        self.rank = rank
        #: what `load` read, until `replay` uses it
        self.pending: dict | None = None

    def save(self, folder: str, step: int, version: int | None, in_flight: dict[int, int],
             states: dict[int, dict[str, torch.Tensor]], restarts: int) -> None:
        """Write the backend's state of optimizer step ``step``: ``version`` held by the workers, ``in_flight``
        (generation -> the version it was sent with), ``states`` (the kept weights by version)."""
        if version is None:
            return
        keep = set(in_flight.values())
        if step - version < self.weight_sync_steps:  # the next generation still samples with it
            keep.add(version)
        state = {"format": 1, "version": version, "in_flight": {str(g): v for g, v in in_flight.items()},
                 "step": step, "restarts": restarts, "saved_versions": sorted(keep)}
        with open(os.path.join(folder, BACKEND_STATE_NAME), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1)
        if keep:
            from safetensors.torch import save_file

            missing = sorted(v for v in keep if v not in states)
            if missing:
                raise RuntimeError(f"The weights of versions {missing} are not kept; cannot checkpoint the rollouts.")
            save_file({f"{v}/{k}": t.contiguous() for v in keep for k, t in states[v].items()},
                      os.path.join(folder, BACKEND_WEIGHTS_NAME))

    def load(self, folder: str) -> None:
        path = os.path.join(folder, BACKEND_STATE_NAME)
        if not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        states: dict[int, dict[str, torch.Tensor]] = {}
        if state["saved_versions"] and self.rank == 0:
            from safetensors.torch import load_file

            for key, tensor in load_file(os.path.join(folder, BACKEND_WEIGHTS_NAME)).items():
                version, _, name = key.partition("/")
                states.setdefault(int(version), {})[name] = tensor
        self.pending = {"version": state["version"], "in_flight": {int(g): v for g, v in state["in_flight"].items()},
                        "states": states, "saved_versions": state["saved_versions"]}

    def replay(self, known: Callable[[int], bool], staleness_of: Callable[[int, int], int], max_staleness: int,
               current: Callable[[], int | None], publish: Callable[[int, Any], None],
               submit: Callable[[int, int], None]) -> None:
        """Send the generations that were in flight again, each with the weights it was first sent with, then restore
        the version the workers held. ``known(g)``: whether generation g's rows are known (read ahead);
        ``staleness_of(g, v)``; ``current()``: the workers' version now; ``publish(v, state)``: a sync of version v;
        ``submit(g, v)``: send generation g for version v."""
        resume, self.pending = self.pending, None
        if resume is None:
            return
        states = resume["states"]
        for gen_index, version in sorted(resume["in_flight"].items()):
            if not known(gen_index) or staleness_of(gen_index, version) > max_staleness:
                continue  # not read ahead (an epoch's end), or too old for this run's bound: sampled later, fresher
            if current() != version:
                publish(version, states.get(version))
            submit(gen_index, version)
        held = resume["version"]
        if held in resume["saved_versions"] and current() != held:
            publish(held, states.get(held))
