"""This process's side of a Ray cluster for one run (`RaySession`): the connection, agreed on by every process of a
launch, the run's name, the actors process 0 creates and the others find by name, bounded waits that name who did not
answer; and what every worker is given (its environment, its resources)."""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

from ..backend import RolloutWorkerError

__all__ = ["NAMESPACE", "RaySession", "actor_died", "resource_options", "worker_env"]

logger = logging.getLogger(__name__)

#: the Ray namespace of every actor flowgrpo names
NAMESPACE = "flowgrpo"
#: environment variables passed to the workers (besides FLOWGRPO_CPU_THREADS, set per worker)
_FORWARDED_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "DIFFUSERS_", "FLOWGRPO_", "TOKENIZERS_", "PYTHONPATH")


def actor_died(error: BaseException) -> bool:
    """Whether ``error`` says the actor died or became unreachable (as opposed to an exception it raised)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(error, (ActorDiedError, ActorUnavailableError, RayActorError))


def worker_env(threads: int | None) -> dict[str, str]:
    """The environment a worker runs with: the trainer's Hugging Face, flowgrpo and tokenizer variables and its
    ``PYTHONPATH``, and ``threads`` CPU threads."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES)}
    if threads:
        env["FLOWGRPO_CPU_THREADS"] = str(threads)
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def resource_options(resources: dict) -> dict:
    """``ray.remote(...).options`` arguments from a resources mapping (unset ones left out)."""
    return {k: v for k, v in resources.items() if v is not None}



class RaySession:
    """This process's connection to the cluster and the run's name (``flowgrpo-<8 hex>``), agreed on by all
    processes of a launch: process 0 connects first (starting a local cluster with token authentication unless
    ``ray_address`` / ``RAY_ADDRESS`` names one) and broadcasts the address, the token file and the run's name."""

    def __init__(self, args: Any, accelerator: Any):
        self.args = args
        self.accelerator = accelerator
        self.connection = None
        self.run = None
        self._connected_here = False

    @property
    def is_main(self) -> bool:
        return self.accelerator.process_index == 0

    def broadcast(self, value: Any) -> Any:
        if self.accelerator.num_processes == 1:
            return value
        from accelerate.utils import broadcast_object_list

        holder = [value]
        broadcast_object_list(holder, from_process=0)
        return holder[0]

    def barrier(self) -> None:
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()

    def open(self) -> None:
        if self.connection is not None:
            return
        from .cluster import connect_ray, enable_token_auth, ray_is_connected

        was_connected = ray_is_connected()
        info = None
        if self.is_main:
            self.connection = connect_ray(self.args.ray_address, namespace=NAMESPACE,
                                          start_timeout_s=self.args.ray_start_timeout_s)
            info = (self.connection.address, self.connection.token_path, f"flowgrpo-{uuid.uuid4().hex[:8]}")
        address, token_path, self.run = self.broadcast(info)
        if not self.is_main:
            if token_path:  # the token file of the cluster process 0 started (or joined with), on this node
                enable_token_auth(token_path)
            self.connection = connect_ray(address, namespace=NAMESPACE, probe_auth=False)
        self._connected_here = not was_connected
        logger.info("Ray: %s the cluster at %s (run %s)",
                    "started" if self.connection.started_here else "joined", self.connection.address, self.run)

    def close(self) -> None:
        if self.connection is not None and self._connected_here:
            self.connection.close()
        self.connection = None

    def create_or_find(self, name: str, make) -> Any:
        """Process 0 creates the actor (``make(name)``); the others find it by name once it exists."""
        import ray

        handle = make(name) if self.is_main else None
        self.barrier()
        if handle is None:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        return handle

    def wait(self, refs: list, timeout_s: float, what: str, names: list[str]) -> list:
        """``ray.get`` of ``refs`` within ``timeout_s``; a `RolloutWorkerError` naming the workers that did not
        answer (``names[i]`` for ``refs[i]``)."""
        import ray

        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        if pending:
            late = [names[i] for i, ref in enumerate(refs) if ref in pending]
            raise RolloutWorkerError(f"{', '.join(late)} did not answer {what} within {timeout_s:g} s "
                                     "(rollout_timeout_s / rollout_startup_timeout_s).", worker=late[0])
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except Exception as err:
                raise RolloutWorkerError(f"{names[i]} failed {what}: {type(err).__name__}: {err}",
                                         worker=names[i]) from err
        return out
