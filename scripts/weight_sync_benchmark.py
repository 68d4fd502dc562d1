#!/usr/bin/env python
"""Seconds per weight sync of the Ray backend's two transports (``weight_sync: object_store | collective``), the pair
measured in one run, alternating.

    python scripts/weight_sync_benchmark.py --repeats 7 --output outputs/weight_sync

Three states, as a trainer sends them: the toy world's LoRA (recipes/toy.yaml: r 32 on every attention and
feed-forward projection, float32), the toy world's whole transformer (full fine-tuning, float32), and a stand-in of
about 200 M parameters (16 blocks of four 1024 x 1024 and two 1024 x 4096 matrices, bfloat16, as a full fine-tuning
in bf16 sends them). The trainer's side is the backend's own `weight_sync.ObjectStoreSync` /
`weight_sync.CollectiveSync` (``publish``: the digest of the state, the transport, each worker's load into tensors it
already holds and its digest read back, the checks); each worker is a Ray actor holding tensors of the state's
layout, loading through the same functions as a `RolloutWorker` (`weights.load_policy_state`'s copy,
`collective.receive_state`). A local token-authenticated cluster, ``--workers`` workers of one CPU each. Per repeat,
every state is synced by both transports, the one that goes first alternating, after one unmeasured sync of each
(the group's formation, the first allocation). Reported: the median seconds per sync of each transport, the median
of the per-repeat ratios collective / object store, and the seconds of one digest of the state (a sync computes two:
the trainer's of what it sends, the worker's of what it then holds), the part the transports share.

Results: ``<output>/results.json`` and a markdown table on standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


class StateHolder:
    """A Ray actor standing for a rollout worker's policy: tensors of the state's layout, loaded and digested as a
    `RolloutWorker` does (`load_weights` over the object store, `join_group` and `receive_weights` over the group)."""

    def __init__(self, name: str, layout: dict, coordinator: str):
        import ray

        from flowgrpo.trainer.rollout.ray.session import NAMESPACE

        torch.set_num_threads(1)
        self.name = name
        self.live = {k: torch.zeros(shape, dtype=getattr(torch, dtype)) for k, (dtype, shape) in layout.items()}
        self.group = None
        self.loads = 0
        ray.get(ray.get_actor(coordinator, namespace=NAMESPACE).register.remote(name))

    def _answer(self, version: int) -> dict:
        from flowgrpo.trainer.rollout.ray.weights import state_digest

        self.loads += 1
        return {"name": self.name, "version": version, "digest": state_digest(self.live), "loads": self.loads}

    def load_weights(self, version: int, digest: str, state: dict) -> dict:
        from flowgrpo.trainer.rollout.ray.weights import check_layout

        check_layout(self.live, {k: (v.dtype, tuple(v.shape)) for k, v in state.items()})
        with torch.no_grad():
            for key, target in self.live.items():
                target.copy_(state[key])
        return self._answer(version)

    def join_group(self, rendezvous, rank: int) -> dict:
        from flowgrpo.trainer.rollout.ray.collective import join_group

        self.group = None
        self.group = (rendezvous.epoch, join_group(rendezvous, rank, "127.0.0.1", torch.device("cpu")))
        return {"name": self.name, "epoch": rendezvous.epoch}

    def receive_weights(self, version: int, digest: str, buckets: list, epoch: int) -> dict:
        from flowgrpo.trainer.rollout.ray.collective import receive_state

        with torch.no_grad():
            receive_state(self.group[1], buckets, self.live)
        return self._answer(version)


def toy_states() -> dict[str, dict[str, torch.Tensor]]:
    """The toy world's LoRA (the toy recipe's) and its whole transformer, as the trainer collects them."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model

    from flowgrpo.models import get_family_adapter
    from flowgrpo.toy.build import cached_toy_world

    world = cached_toy_world("full", seed=0, log=lambda *_: None)
    transformer = get_family_adapter(DiffusionPipeline.from_pretrained(str(world))).trainable_module()
    full = {f"policy/{k}": v.detach().float().clone() for k, v in transformer.named_parameters()}
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_out"]
    lora = get_peft_model(transformer, LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian",
                                                  target_modules=targets))
    adapter = {f"policy/{k}": v.detach().float().clone() for k, v in lora.named_parameters() if v.requires_grad}
    return {"toy LoRA (r 32)": adapter, "toy transformer (full)": full}


def stand_in(blocks: int = 16, width: int = 1024) -> dict[str, torch.Tensor]:
    """About 200 M bfloat16 parameters in a transformer's shapes."""
    gen = torch.Generator().manual_seed(0)
    state = {}
    for b in range(blocks):
        for name in ("q", "k", "v", "o"):
            state[f"policy/blocks.{b}.attn.{name}.weight"] = torch.randn(width, width, generator=gen).bfloat16()
        state[f"policy/blocks.{b}.ff.up.weight"] = torch.randn(4 * width, width, generator=gen).bfloat16()
        state[f"policy/blocks.{b}.ff.down.weight"] = torch.randn(width, 4 * width, generator=gen).bfloat16()
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--bucket_mb", type=float, default=256.0)
    parser.add_argument("--output", default="outputs/weight_sync")
    args = parser.parse_args()
    import ray

    from flowgrpo.trainer.rollout.ray.cluster import start_local_cluster
    from flowgrpo.trainer.rollout.ray.session import NAMESPACE, RaySession
    from flowgrpo.trainer.rollout.ray.weight_sync import CollectiveSync, ObjectStoreSync
    from flowgrpo.trainer.rollout.ray.weights import state_digest
    from flowgrpo.trainer.rollout.ray.worker import RolloutCoordinator, SingleProcessAccelerator
    from flowgrpo.trainer.rollout.ray.worker_set import WorkerSet

    torch.set_num_threads(1)
    states = {**toy_states(), "200M stand-in (bf16)": stand_in()}
    sizes = {name: (sum(t.numel() for t in s.values()), sum(t.numel() * t.element_size() for t in s.values()))
             for name, s in states.items()}
    connection = start_local_cluster(num_cpus=max(2, args.workers + 1), num_gpus=0, object_store_memory=2 << 30,
                                     namespace=NAMESPACE)
    rows = []
    try:
        config = SimpleNamespace(rollout_timeout_s=600.0, weight_sync_bucket_mb=args.bucket_mb,
                                 max_worker_restarts=0, weight_sync_steps=1)
        accelerator = SingleProcessAccelerator("cpu")
        session = RaySession(config, accelerator)
        version = 0
        for state_name, state in states.items():
            coordinator_name = f"bench-coordinator-{len(rows)}"
            coordinator = ray.remote(RolloutCoordinator).options(name=coordinator_name, namespace=NAMESPACE,
                                                                 num_cpus=0).remote()
            layout = {k.removeprefix(""): (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()}
            names = [f"bench-worker-{i}" for i in range(args.workers)]
            handles = [ray.remote(StateHolder).options(num_cpus=1, namespace=NAMESPACE).remote(n, layout,
                                                                                               coordinator_name)
                       for n in names]
            workers = WorkerSet(names, handles, config)
            workers.info = [{"device": "cpu"} for _ in names]
            metrics = defaultdict(list)
            syncs = {kind: cls(config, None, accelerator, session, workers, coordinator, (), metrics)
                     for kind, cls in (("object_store", ObjectStoreSync), ("collective", CollectiveSync))}
            for sync in syncs.values():  # unmeasured: the group's formation, the first allocation
                version += 1
                sync.publish(version, state)
            for repeat in range(args.repeats):
                order = list(syncs) if repeat % 2 == 0 else list(reversed(syncs))
                seconds = {}
                for kind in order:
                    version += 1
                    tic = time.perf_counter()
                    syncs[kind].publish(version, state)
                    seconds[kind] = time.perf_counter() - tic
                    syncs[kind].states.clear()
                tic = time.perf_counter()
                state_digest(state)  # the part both transports share, twice (the trainer's, a worker's read-back)
                seconds["digest"] = time.perf_counter() - tic
                rows.append({"state": state_name, "repeat": repeat, **seconds,
                             "ratio": seconds["collective"] / seconds["object_store"],
                             "load_average": os.getloadavg()[0]})
                print(json.dumps(rows[-1]), flush=True)
            for sync in syncs.values():
                sync.close()
            for handle in [*handles, coordinator]:
                ray.kill(handle)
    finally:
        connection.close()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"sizes": sizes, "workers": args.workers, "bucket_mb": args.bucket_mb,
                                                  "runs": rows}, indent=1))
    print("| state | parameters | MB | object store, s/sync | collective, s/sync | collective / object store | "
          "one digest, s |")
    print("|---|---|---|---|---|---|---|")
    for state_name, (count, size) in sizes.items():
        mine = [r for r in rows if r["state"] == state_name]
        med = {k: statistics.median(r[k] for r in mine) for k in ("object_store", "collective", "ratio", "digest")}
        print(f"| {state_name} | {count / 1e6:.1f} M | {size / 2**20:.0f} | {med['object_store']:.3f} | "
              f"{med['collective']:.3f} | {med['ratio']:.2f} | {med['digest']:.3f} |")
    loads = [r["load_average"] for r in rows]
    print(f"load average during the runs: {min(loads):.1f} to {max(loads):.1f}")


if __name__ == "__main__":
    main()
