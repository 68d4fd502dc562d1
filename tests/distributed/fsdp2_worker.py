"""FSDP2 on CPU for tests/distributed/test_distributed.py: two gloo processes, ``torch.distributed.fsdp.fully_shard``.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/fsdp2_worker.py --output_dir DIR

accelerate has no FSDP on CPU (it falls back to DDP), so this drives ``fully_shard`` directly with the wrapping of
``accelerate_configs/fsdp8.yaml``: every transformer block a unit, the diffusers transformer a unit, the PeftModel
the root. Each rank takes one step on its own samples, of a Flow-GRPO policy-gradient loss (the clipped-ratio loss of
``flowgrpo.trainer`` on one SDE step) plus a reward-gradient loss (the reward backpropagated through two sampling
steps, each checkpointed around the sharded model as the reward-gradient trainer checkpoints them), calls the pipeline
with the sharded transformer, gathers the full state dict and rank 0 exports the LoRA in diffusers format.
``reference_step`` is the same step without sharding, for the test to compare against. Then (`replay_gathers`) a tiny
FlowGRPOTrainer's own ``_train_on_batch`` replays a recorded micro-batch on its sharded transformer at several
``train_timesteps_per_pass``, counting FSDP2's weight all-gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

PROMPTS = ['a sign that says "hi"', "a red circle"]
SIZE = 32
STEPS = 2
LEARNING_RATE = 50.0
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def build(seed: int = 0):
    """The tiny SD3 pipeline and its transformer wrapped in a LoRA PeftModel (identical on every rank)."""
    from peft import LoraConfig, get_peft_model

    from flowgrpo.testing import build_tiny_pipeline

    pipe = build_tiny_pipeline("sd3", seed=0)
    for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.vae, pipe.transformer):
        module.requires_grad_(False).eval()
    torch.manual_seed(seed)
    peft_model = get_peft_model(pipe.transformer, LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian",
                                                             target_modules=LORA_TARGETS))
    return pipe, peft_model


def rank_loss(pipe, model, rank: int) -> torch.Tensor:
    """Clipped-ratio policy loss of one SDE step on this rank's own samples (different noise per rank)."""
    from flowgrpo.models import get_family_adapter
    from flowgrpo.schedulers import sde_step_from_sigmas

    adapter = get_family_adapter(pipe)
    generator = torch.Generator().manual_seed(1000 + rank)
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS, 8, torch.device("cpu"))
    adapter.set_timesteps(pipe.scheduler, STEPS, SIZE, SIZE, torch.device("cpu"))
    sigmas = pipe.scheduler.sigmas.float()
    t = pipe.scheduler.timesteps[:1].expand(len(PROMPTS))
    x = adapter.prepare_latents(len(PROMPTS), SIZE, SIZE, generator, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        v_old = adapter.predict_velocity(model, x, t, embeds, 1.0, None, SIZE, SIZE)
        old = sde_step_from_sigmas(v_old, x, sigmas[0], sigmas[1], noise_level=0.7, generator=generator)
    v = adapter.predict_velocity(model, x, t, embeds, 1.0, None, SIZE, SIZE)
    new = sde_step_from_sigmas(v, x, sigmas[0], sigmas[1], prev_sample=old.prev_sample, noise_level=0.7)
    advantages = torch.tensor([1.0, -1.0]) * (1.0 if rank == 0 else -0.5)
    ratio = torch.exp(new.log_prob - old.log_prob)
    clipped = torch.clamp(ratio, 1 - 1e-3, 1 + 1e-3)
    return torch.maximum(-advantages * ratio, -advantages * clipped).mean()


def rank_reward_gradient_loss(pipe, model, rank: int, checkpointed: bool) -> torch.Tensor:
    """The reward-gradient trainer's step on this rank's own noise: both sampling steps with gradient, each
    checkpointed around the (sharded) model as the trainer does when nothing wraps it, the decoded images' mean
    brightness the reward; ``checkpointed=False`` is the plain unrolled chain of the reference."""
    from torch.utils.checkpoint import checkpoint

    from flowgrpo.models import get_family_adapter
    from flowgrpo.trainer.algorithms.reward_backprop_loss import unrolled_euler

    adapter = get_family_adapter(pipe)
    with torch.no_grad():
        embeds = adapter.encode_prompts(PROMPTS, 8, torch.device("cpu"))
    adapter.set_timesteps(pipe.scheduler, STEPS, SIZE, SIZE, torch.device("cpu"))
    sigmas, timesteps = pipe.scheduler.sigmas.float(), pipe.scheduler.timesteps
    x = adapter.prepare_latents(len(PROMPTS), SIZE, SIZE, torch.Generator().manual_seed(2000 + rank),
                                torch.device("cpu"), torch.float32)

    def forward(net, state, i):
        return adapter.predict_velocity(net, state, timesteps[i].expand(len(PROMPTS)), embeds, 1.0, None, SIZE, SIZE)

    def velocity(state, i):
        return checkpoint(forward, model, state, i, use_reentrant=False) if checkpointed else forward(model, state, i)

    final = unrolled_euler(velocity, x, sigmas, 0, STEPS)
    return -adapter.decode(final, SIZE, SIZE).mean()


def reference_step(world_size: int = 2):
    """The same optimizer step without sharding: gradients of the mean of the ranks' losses."""
    pipe, peft_model = build()
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    loss = sum(rank_loss(pipe, peft_model, r) + rank_reward_gradient_loss(pipe, peft_model, r, checkpointed=False)
               for r in range(world_size)) / world_size
    loss.backward()
    optimizer.step()
    return pipe, peft_model


def replay_gathers(rank: int, output_dir: Path) -> dict:
    """The trainer's own replay (``OnlineRLTrainer._train_on_batch``) of one recorded micro-batch of Flow-GRPO (a
    window of REPLAY_STEPS SDE steps) on the transformer sharded by ``fully_shard`` as above, at each
    ``train_timesteps_per_pass`` of REPLAY_SETTINGS: the weight all-gathers each FSDP unit issued (a counting
    all-gather set on every unit with ``set_custom_all_gather``) and this rank's shard of the LoRA gradients."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support.trainer_cases import make_trainer, redness_reward
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    from flowgrpo.testing import cached_tiny_pipeline_path
    from flowgrpo.trainer.data.datasets import INDEX_COLUMN

    class CountingAllGather(DefaultAllGather):
        """FSDP2's own all-gather, counted."""

        def __init__(self):
            self.calls = 0

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return super().__call__(*args, **kwargs)

    trainer = make_trainer(cached_tiny_pipeline_path("sd3", seed=0), output_dir / f"replay{rank}", kind="flow_grpo",
                           reward=redness_reward, resolution=SIZE, per_device_train_batch_size=4, num_generations=2,
                           max_sequence_length=8, sde_window_size=REPLAY_STEPS, sde_window_range=[0, 1], seed=rank)
    prompts = [{"prompt": PROMPTS[i // 2], INDEX_COLUMN: i // 2} for i in range(4)]
    record = trainer._generate(prompts)[0]  # sampled before sharding; every rank its own noise
    model = trainer.model
    inner = model.base_model.model
    units = {"block": inner.transformer_blocks[0], "transformer": inner, "root": model}
    for block in inner.transformer_blocks:
        fully_shard(block)
    fully_shard(inner)
    fully_shard(model)
    counters = {name: CountingAllGather() for name in units}
    for name, unit in units.items():
        unit.set_custom_all_gather(counters[name])
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before a micro-batch
    out = {"recorded_steps": int(record["latents"].shape[1]), "gathers": {}, "grad_diff": {}, "grad_max": 0.0}
    grads = {}
    for setting in REPLAY_SETTINGS:
        trainer.args.train_timesteps_per_pass = setting
        model.zero_grad(set_to_none=True)
        for counter in counters.values():
            counter.calls = 0
        trainer._train_on_batch(model, record, True)
        out["gathers"][str(setting)] = {name: counter.calls for name, counter in counters.items()}
        grads[setting] = [p.grad.to_local().detach().clone() for p in model.parameters() if p.grad is not None]
    first = grads[REPLAY_SETTINGS[0]]
    out["grad_max"] = max(float(g.abs().max()) for g in first)
    for setting in REPLAY_SETTINGS[1:]:
        out["grad_diff"][str(setting)] = max(float((a - b).abs().max()) for a, b in zip(first, grads[setting]))
    return out


#: the trainer's replay on the sharded model: recorded steps per micro-batch and the settings compared
REPLAY_STEPS = 3
REPLAY_SETTINGS = (1, 2, "all")


def main() -> None:
    import torch.distributed as dist
    from diffusers import StableDiffusion3Pipeline
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from flowgrpo.trainer.outputs.lora_export import save_diffusers_lora

    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    pipe, peft_model = build()
    inner = peft_model.base_model.model  # the diffusers SD3Transformer2DModel, LoRA layers inside
    for block in inner.transformer_blocks:
        fully_shard(block)
    fully_shard(inner)
    fully_shard(peft_model)
    sharded = [n for n, p in peft_model.named_parameters() if type(p).__name__ == "DTensor"]

    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    loss = rank_loss(pipe, peft_model, rank) + rank_reward_gradient_loss(pipe, peft_model, rank, checkpointed=True)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

    # The pipeline calls the inner transformer directly: it must work while sharded.
    with torch.no_grad():
        images = pipe(PROMPTS[0], num_inference_steps=STEPS, height=SIZE, width=SIZE, guidance_scale=1.0,
                      max_sequence_length=8, output_type="np", generator=torch.Generator().manual_seed(0)).images

    full = get_model_state_dict(peft_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = Path(args.output_dir)
    if rank == 0:
        save_diffusers_lora(StableDiffusion3Pipeline, out / "lora", peft_model, state_dict=full)
    record = {"rank": rank, "world_size": world, "loss": float(loss), "num_sharded_params": len(sharded),
              "pipeline_image_shape": list(images.shape), "full_state_dict_keys": len(full),
              "replay": replay_gathers(rank, out)}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Everything the test reads is written and closed. Leave without running C++ static destructors: at exit a
    # gloo rank once aborted with "terminate called without an active exception" after finishing its work (a
    # teardown race in the process group's threads, not in what this test checks).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
