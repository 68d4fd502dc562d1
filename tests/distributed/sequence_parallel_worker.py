"""Sequence-parallel training runs for tests/distributed/test_sequence_parallel.py: several launches, one start-up.

    python tests/distributed/sequence_parallel_worker.py --pipelines JSON --output_dir DIR --phases JSON

Each phase is one launch of N gloo processes on the CPU, with the environment ``accelerate launch`` gives its ranks
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``, ``ACCELERATE_USE_CPU``); the ranks are forked from this process
after it has imported torch, diffusers, transformers and the trainers, which is most of a rank's start-up on a CPU.
Each run of a phase is one trainer (`RUNS`: a tiny family, an algorithm; with a ``sequence_parallel_size``) trained
for two optimizer steps with SGD (so that equal gradients give equal weights; Adam's first steps amplify float
rounding in coordinates whose gradient is near zero). Every rank records into ``DIR/world<N>/<run>-sp<S>/rank<r>.pt``:
the frames its adapter decoded (float32, before any rounding to pixels), each rollout micro-batch's recorded tensors
(log-probs, latents), the logged metrics, its trainable weights after the last step, and an evaluation of three
prompts after training. The test runs the same runs
without sequence parallelism (in its own process, or as two data-parallel ranks of a phase) and compares; `run` is
what both call.

A phase's ``fsdp2: S`` adds a check without a trainer: the tiny Wan transformer with a LoRA, sharded by FSDP2's
``fully_shard`` over the whole launch (the flattened data-parallel x sequence-parallel mesh) and split by Ulysses
over S processes, takes one gradient of a loss scaled by S; its gathered gradient must equal the mean over replicas of
each replica's whole gradient, which every rank first computes on an unsharded, unsplit copy
(``DIR/world<N>/fsdp2/rank<r>.json``). A phase's ``families`` checks diffusers' plans of the image families (and Wan
2.2 TI2V's per-token timesteps) on one transformer call each: the split velocity equals the whole one and the
processes' gradients sum to the whole gradient (`family_check`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared support package

#: run name -> (family, trainer registry name, its settings besides the common ones)
RUNS = {
    # 16 x 48 px, 9 frames: 3 x 1 x 3 = 9 video tokens, which 2 processes split 5 + 4
    "wan": ("wan", "flow_grpo", dict(height=16, width=48, num_frames=9, save_strategy="steps", save_steps=1)),
    "wan_resumed": ("wan", "flow_grpo", dict(height=16, width=48, num_frames=9)),
    "wan_nft": ("wan", "diffusion_nft", dict(height=16, width=48, num_frames=9)),
    # 768 video tokens and 5 sound tokens (split 3 + 2), with a reward that scores the sound; gradient checkpointing
    # (the blocks' all-to-alls run again in the backward pass), as the 720p recipes train
    "ltx2": ("ltx2", "flow_grpo", dict(resolution=32, num_frames=5, activation_checkpointing=True)),
    "hunyuanvideo15": ("hunyuanvideo15", "flow_grpo", dict(resolution=32, num_frames=5, activation_checkpointing=True)),
}


def loudness_reward(prompts, images, audio=None, **columns):
    """Mean absolute amplitude of each sample's sound (LTX-2's audio column)."""
    return [float(abs(wave).mean()) for wave in audio]


loudness_reward.accepts_audio = True


def _tensors(value):
    return value.detach().float().cpu().clone()


def run_folder(name: str, sequence_parallel_size: int) -> str:
    """Where a run writes (its output folder and records), under the launch's folder."""
    return f"{name}-sp{sequence_parallel_size}"


def run(name: str, paths: dict[str, str], output_dir: str | Path, sequence_parallel_size: int,
        resume_from: str | None = None) -> dict:
    """Train run ``name`` for two optimizer steps; returns this process's record (also saved as ``rank<r>.pt``)."""
    from datasets import Dataset
    from peft import LoraConfig
    from support.family_cases import PROMPTS, brightness_reward
    from transformers import TrainerCallback

    from flowgrpo.trainer.registry import config_class, trainer_class

    family, kind, own = RUNS[name]
    out = Path(output_dir) / run_folder(name, sequence_parallel_size)
    settings = dict(report_to=[], per_device_train_batch_size=2, num_generations=2, num_inference_steps=3,
                    eval_num_inference_steps=3, guidance_scale=1.0, max_steps=2, learning_rate=1.0, optim="sgd", beta=0.0,
                    max_sequence_length=16, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
                    log_images_steps=0, dtype="float32", use_cpu=True, sequence_parallel_size=sequence_parallel_size)
    if kind == "flow_grpo":
        settings["noise_level"] = 1.0
    settings.update(own)
    rewards = [brightness_reward] + ([loudness_reward] if family == "ltx2" else [])
    args = config_class(kind)(output_dir=str(out), **settings)
    trainer = trainer_class(kind)(model=paths[family], reward_funcs=rewards, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                  peft_config=LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian"))
    record = {"frames": [], "rollouts": [], "logs": [], "rank": trainer.accelerator.process_index,
              "world_size": trainer.accelerator.num_processes}
    decode = trainer.adapter.decode

    def recording_decode(latents, height, width):
        frames = decode(latents, height, width)
        record["frames"].append(_tensors(frames))
        return frames

    trainer.adapter.decode = recording_decode

    class Recorder(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            record["rollouts"].append([{k: _tensors(v) for k, v in r.items()
                                        if k in ("log_probs", "latents", "next_latents", "x0")}
                                       for r in trainer.buffer])

        def on_log(self, args, state, control, logs=None, **kwargs):
            record["logs"].append({k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    trainer.add_callback(Recorder())
    trainer.train(resume_from_checkpoint=resume_from)
    trainer.save_model()
    trainer.adapter.decode = decode  # the training's frames only (evaluation decodes on the leaders alone)
    # evaluation splits its prompts over replicas; the leaders decode and score
    record["eval"] = {k: float(v) for k, v in trainer.evaluate(PROMPTS[:3]).items() if isinstance(v, (int, float))}
    trainer.reward_set.close()
    model = trainer.accelerator.unwrap_model(trainer.model)
    record["weights"] = {n: _tensors(p) for n, p in model.named_parameters() if p.requires_grad}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"rank{record['rank']}.pt")
    return record


def fsdp2_check(output_dir: Path, sequence_parallel_size: int, wan_path: str) -> None:
    """FSDP2 over the whole launch with Ulysses inside each replica: the gradient of one step (see the docstring)."""
    import copy

    import torch.distributed as dist
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import fully_shard

    from flowgrpo.models import get_family_adapter
    from flowgrpo.trainer.sequence_parallel import (
        SequenceParallelLayout,
        enable_sequence_parallel,
        sequence_parallel_loss_scale,
        sequence_parallel_mesh,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = SequenceParallelLayout(sequence_parallel_size, rank, world)
    pipe = DiffusionPipeline.from_pretrained(wan_path)
    adapter = get_family_adapter(pipe, num_frames=9)
    device = torch.device("cpu")
    torch.manual_seed(0)
    model = get_peft_model(pipe.transformer.requires_grad_(False),
                           LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian",
                                      target_modules=list(adapter.default_lora_target_modules)))
    with torch.no_grad():
        embeds = adapter.encode_prompts(["a red circle", "a cat"], 16, device)
    adapter.set_timesteps(pipe.scheduler, 3, 16, 48, device)
    t = pipe.scheduler.timesteps[:1].expand(2)

    def replica_loss(module, replica: int) -> torch.Tensor:
        x = adapter.prepare_latents(2, 16, 48, torch.Generator().manual_seed(100 + replica), device, torch.float32)
        v = adapter.predict_velocity(module, x, t, embeds, 1.0, None, 16, 48)
        return (v * torch.linspace(-1, 1, v[0].numel()).reshape(v[0].shape)).pow(2).mean()

    reference = copy.deepcopy(model)
    expected = {}
    for replica in range(layout.data_parallel_size):  # the mean over replicas of each one's whole gradient
        reference.zero_grad()
        (replica_loss(reference, replica) / layout.data_parallel_size).backward()
        for n, p in reference.named_parameters():
            if p.grad is not None:
                expected[n] = expected.get(n, 0) + p.grad.clone()

    mesh = sequence_parallel_mesh(layout, device)
    enable_sequence_parallel(pipe.transformer, adapter.context_parallel_plan(pipe.transformer), mesh, device)
    for block in pipe.transformer.blocks:
        fully_shard(block)
    fully_shard(pipe.transformer)
    fully_shard(model)  # over the default mesh: every process of the launch, data x sequence parallel
    loss = replica_loss(model, layout.data_parallel_rank) * sequence_parallel_loss_scale(layout)
    loss.backward()
    worst = 0.0
    sharded = 0
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        sharded += hasattr(p.grad, "full_tensor")
        worst = max(worst, float((grad - expected[n]).abs().max() / expected[n].abs().max().clamp_min(1e-12)))
    folder = output_dir / "fsdp2"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.json").write_text(json.dumps({"worst_relative_difference": worst,
                                                          "sharded_gradients": sharded, "world_size": world,
                                                          "compared": len(expected)}))


#: image families whose tokens split with diffusers' own plans (``family_check``): (tiny family, variant, frames, size)
PLAN_FAMILIES = {"flux": ("flux", None, 1, 32), "flux_kontext": ("flux_kontext", None, 1, 32),
                 "flux2_klein": ("flux2_klein", None, 1, 32), "qwenimage_edit_plus": ("qwenimage_edit_plus", None, 1, 32),
                 "wan_i2v_ti2v": ("wan_i2v", "ti2v", 5, 32)}


def _velocity_and_gradients(adapter, latents, t, embeds, size: int):
    """One call's velocity, and the gradients of every transformer parameter of a weighted square of it."""
    modules = adapter.transformers()
    for module in modules:
        module.requires_grad_(True).zero_grad()
    v = adapter.predict_velocity(adapter.trainable_module(), latents, t, embeds, 1.0, None, size, size)
    (v * torch.linspace(-1, 1, v[0].numel()).reshape(v[0].shape)).pow(2).sum().backward()
    return v.detach(), {f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules)
                        for n, p in m.named_parameters() if p.grad is not None}


def family_check(output_dir: Path, names: list[str], paths: dict[str, str]) -> None:
    """For each family of ``names`` (`PLAN_FAMILIES`): the velocity and the parameter gradients of one call on
    this rank's own copy, whole, then split over the launch with the family's plan; records the largest
    difference of the velocity and of the gradients summed over the processes (``<family>/rank<r>.json``)."""
    import torch.distributed as dist
    from diffusers import DiffusionPipeline
    from support.family_cases import source_image

    from flowgrpo.models import get_family_adapter
    from flowgrpo.trainer.policy.loading import import_own_components, read_pipeline_index
    from flowgrpo.trainer.sequence_parallel import (
        SequenceParallelLayout,
        enable_sequence_parallel,
        sequence_parallel_mesh,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    mesh = sequence_parallel_mesh(SequenceParallelLayout(world, rank, world), device)
    for name in names:
        _, _, frames, size = PLAN_FAMILIES[name]
        import_own_components(read_pipeline_index(paths[name], {}))  # the tiny Qwen-Image-Edit processor
        pipe = DiffusionPipeline.from_pretrained(paths[name])
        adapter = get_family_adapter(pipe, num_frames=frames)
        images = None
        if adapter.accepts_images:
            images = [source_image(0), source_image(1)]
            if name == "qwenimage_edit_plus":
                images = [[source_image(0), source_image(1)], [source_image(2), source_image(3)]]
        with torch.no_grad():
            embeds = adapter.encode_prompts(["a red circle", 'a sign that says "hi"'], 16, device, images=images,
                                            height=size, width=size)
        latents = adapter.prepare_latents(2, size, size, torch.Generator().manual_seed(0), device, torch.float32)
        adapter.set_timesteps(pipe.scheduler, 4, size, size, device)
        t = pipe.scheduler.timesteps[1:2].expand(2)
        whole, whole_grads = _velocity_and_gradients(adapter, latents, t, embeds, size)
        for module in adapter.transformers():
            adapter.prepare_sequence_parallel(module)
            enable_sequence_parallel(module, adapter.context_parallel_plan(module), mesh, device)
        split, grads = _velocity_and_gradients(adapter, latents, t, embeds, size)
        worst = 0.0
        for key, grad in grads.items():
            dist.all_reduce(grad)
            scale = float(whole_grads[key].abs().max())
            if scale > 1e-4:  # a gradient that is zero in exact arithmetic (a key bias) has no relative size
                worst = max(worst, float((grad - whole_grads[key]).abs().max()) / scale)
        folder = output_dir / "families" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.json").write_text(json.dumps({
            "velocity_max_abs_diff": float((split - whole).abs().max()), "velocity_max_abs": float(whole.abs().max()),
            "gradient_max_relative_diff": worst, "gradients": len(grads), "missing": len(set(whole_grads) - set(grads))}))


def rank_main(phase: dict, paths: dict[str, str], out: Path) -> None:
    """One process of a launch: its runs in order, then the FSDP2 check and the family checks if asked."""
    for name, size in phase["runs"]:
        resume = str(out / run_folder("wan", size) / "checkpoint-1") if name == "wan_resumed" else None
        run(name, paths, out, size, resume_from=resume)
    if phase.get("fsdp2"):
        fsdp2_check(out, phase["fsdp2"], paths["wan"])
    if phase.get("families"):
        family_check(out, phase["families"], paths)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forked_launch(processes: int, target, *args) -> None:
    """Run ``target(*args)`` in ``processes`` forked ranks of one gloo launch (the environment ``accelerate launch``
    gives its ranks on a CPU), and wait for them; any rank's failure fails the launch. Forking shares the parent's
    imports, which are most of a rank's start-up time on a CPU."""
    port = str(_free_port())
    children = []
    for rank in range(processes):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes),
                                  LOCAL_WORLD_SIZE=str(processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                  ACCELERATE_USE_CPU="true")
                target(*args)
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    failed = [rank for rank, pid in enumerate(children) if os.waitpid(pid, 0)[1] != 0]
    if failed:
        raise SystemExit(f"ranks {failed} of a {processes}-process launch failed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipelines", required=True, help="JSON {family: tiny pipeline folder}")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--phases", required=True,
                        help='JSON list of launches: {"processes": N, "runs": [[run name, sequence_parallel_size], '
                             '...], "fsdp2": S or 0, "families": [PLAN_FAMILIES names]}')
    cli = parser.parse_args()
    paths = json.loads(cli.pipelines)
    out = Path(cli.output_dir)
    torch.set_num_threads(1)
    # what every rank imports, once, before the ranks are forked
    import datasets  # noqa: F401
    import peft  # noqa: F401
    from diffusers import HunyuanVideo15Pipeline, LTX2Pipeline, WanPipeline  # noqa: F401

    from flowgrpo.trainer.registry import trainer_class

    for kind in ("flow_grpo", "diffusion_nft"):
        trainer_class(kind)
    for phase in json.loads(cli.phases):
        forked_launch(phase["processes"], rank_main, phase, paths, out / f"world{phase['processes']}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
