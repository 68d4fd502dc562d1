r"""Planning ``rollout_backend: ray``: the memory of a rollout worker and of the trainer processes, each on its own
GPUs, and the step time with and without overlap.

A worker (one GPU: ``rollout_worker_resources``' ``num_gpus``, the same GPU model as the trainer's) holds what a
rollout needs and nothing a backward pass needs:

=================  =================================================================================================
term               how it is counted
=================  =================================================================================================
weights            the frozen transformer (``b`` bytes a parameter, or NF4 / int8 with ``quantization``), the trained
                   tensors (LoRA: float32; full fine-tuning: ``b``), the text encoders unless
                   ``offload_text_encoders``, the VAE and the pipeline's other components
copies             the old policy when the algorithm samples with it (DiffusionNFT; AWM off-policy): LoRA float32,
                   full fine-tuning a frozen copy at ``b``; the records of one process's share of a generation
rollout            the larger of one sampling step's and one decode slice's transient peak (measured, as the trainer's
                   rollout phase)
overhead           CUDA context, and 10% of the transient for the caching allocator
=================  =================================================================================================

The trainer processes keep the plan of ``flowgrpo plan`` (their rollout phase is evaluation's sampling now) plus the
records of the ``max_staleness`` generations that arrive ahead of training.

Time per optimizer step (``A`` = gradient accumulation steps, ``N`` training processes, ``W`` workers): a process's
share is sampled by one worker, so a generation takes ``ceil(N / W)`` shares' time,
``t_rollout = ceil(N / W) * A * (rollout + decode FLOPs) / (MFU * peak)``; ``t_train = A * training FLOPs / (MFU *
peak) + communication``; the sync sends the state once through the object store and every worker reads it,
``t_sync = state bytes / OBJECT_STORE_GBS + W * state bytes / HOST_TO_HOST_GBS``. Without overlap (``max_staleness:
0``) a step is ``t_rollout + t_train + t_sync``; with it (``max_staleness >= 1``) ``max(t_rollout, t_train) +
t_sync``. Rewards scored in the trainer (``reward_backend: local``) overlap the next rollout in both cases and are not
counted.
"""

from __future__ import annotations

import math
from typing import Any

from .planner import CUDA_CONTEXT_GB, FRAGMENTATION, GB, Plan, frozen_weight_bytes, other_weight_bytes

__all__ = ["HOST_TO_HOST_GBS", "OBJECT_STORE_GBS", "plan_rollout_backend"]

#: assumed bandwidths (GB/s) of a weight sync: the put into the local object store (a host memory copy) and a
#: worker's read of it on another node (a 100 Gb/s link); a worker on the trainer's node reads shared memory instead
OBJECT_STORE_GBS = 5.0
HOST_TO_HOST_GBS = 12.5


def _sig(seconds: float) -> float:
    """Four significant digits (tiny test models take microseconds)."""
    return float(f"{seconds:.4g}")


def plan_rollout_backend(plan: Plan, training_args: Any) -> dict[str, Any]:
    """The worker's memory, the trainer's added records and the step times of ``plan`` on the Ray backend."""
    from .calibration import MFU

    inputs = plan.inputs
    measure = plan.measure
    spec, s, gpu = inputs.spec, inputs.settings, inputs.gpu
    b = s.dtype.itemsize
    params = {k: v * spec.experts for k, v in measure.params.items()}
    trainable, frozen, linear = params["trainable"], params["frozen"], params["linear"]
    frozen_bytes = frozen_weight_bytes(frozen, linear, b, inputs.quantization)
    trained_bytes = trainable * (4 if s.use_lora else b)
    other = other_weight_bytes(spec, b, inputs.offload_text_encoders)
    samples_with_old = s.samples_with_copy  # the algorithm's rollouts are sampled by a copy (its spec's workers)
    old_copy = (trainable * 4 if s.use_lora else params["total"] * b) if samples_with_old else 0.0
    ga = inputs.gradient_accumulation_steps
    trajectories = ga * measure.latent_bytes * (2 * s.trained_steps + 1)
    transient = max(measure.rollout_bytes, measure.decode_bytes)
    overhead = CUDA_CONTEXT_GB * GB + FRAGMENTATION * transient
    worker = {"weights": frozen_bytes + trained_bytes + other, "copies": old_copy + trajectories,
              "rollout": transient, "overhead": overhead}
    worker_gb = {k: round(v / GB, 3) for k, v in worker.items()}
    worker_peak = sum(worker.values()) / GB

    staleness = int(training_args.max_staleness)
    trainer_extra = staleness * trajectories / GB
    trainer_peak = plan.peak_gb + trainer_extra

    workers = int(training_args.rollout_workers)
    processes = inputs.parallel.world_size
    speed = MFU * gpu.bf16_tflops * 1e12
    decode = measure.decode_flops * math.ceil(s.micro_batch / max(1, s.decode_batch))
    rollout_s = math.ceil(processes / workers) * ga * (measure.rollout_flops + decode) / speed
    train_s = ga * measure.training_flops / speed + plan.comm_time_s
    state_bytes = trained_bytes + old_copy
    # one sync every weight_sync_steps steps, spread over them
    sync_s = (state_bytes / (OBJECT_STORE_GBS * 1e9) + workers * state_bytes / (HOST_TO_HOST_GBS * 1e9)) / max(
        1, int(training_args.weight_sync_steps))
    return {
        "workers": workers,
        "worker_resources": dict(training_args.rollout_worker_resources or {"num_cpus": 1, "num_gpus": 1}),
        "max_staleness": staleness,
        "weight_sync_steps": int(training_args.weight_sync_steps),
        "worker_breakdown_gb": worker_gb,
        "worker_peak_gb": round(worker_peak, 3),
        "worker_fits": bool(worker_peak <= gpu.memory_gb),
        "trainer_peak_gb": round(trainer_peak, 3),
        "trainer_extra_records_gb": round(trainer_extra, 3),
        "trainer_fits": bool(trainer_peak <= gpu.memory_gb),
        "sync_bytes": float(state_bytes),
        "rollout_s": _sig(rollout_s),
        "training_s": _sig(train_s),
        "sync_s": _sig(sync_s),
        "step_time_sequential_s": _sig(rollout_s + train_s + sync_s),
        "step_time_overlapped_s": _sig(max(rollout_s, train_s) + sync_s),
    }
