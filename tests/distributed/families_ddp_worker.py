"""Two optimizer steps of every newer model family on two CPU ranks, for tests/models/test_model_families.py.

    accelerate launch --config_file accelerate_configs/cpu_ddp.yaml tests/distributed/families_ddp_worker.py \
        --pipelines JSON --output_dir DIR [--trainers '["dgpo", "crd"]']

One launch (one start-up) for the families it is given (tests/models/test_model_families.py splits them over a
few launches balanced by cost): each rank builds a ``FlowGRPOTrainer`` on each tiny pipeline in turn and
trains two optimizer steps under DDP; after every step it records the logged metrics, a digest of its trainable
weights (equal on both ranks when gradients are synchronised) and a digest of its own samples (different: each
rank samples its own noise). Each trainer named in ``--trainers`` then trains one step of its own on the same
pipeline (one trained noise level, one group of four images split over the two ranks, so that its cross-process sums
and gathers join samples of one group; a LoRA initialised away from zero, so that the policy differs from the base
from the start), recorded under ``<case>/<trainer>`` (the reward-gradient trainer on the families of `ONLY_ON`). Rank ``r`` writes ``DIR/rank<r>.json``.

With ``--dppo_branch_opd PIPELINE --teacher_lora DIR`` the same launch then trains, on that pipeline, Flow-DPPO,
BranchGRPO and on-policy distillation (recorded as cases ``new:dppo_branch`` and ``new:opd``): Flow-GRPO with
Flow-DPPO's trust region and BranchGRPO trees of 4 leaves split over the two ranks (each rank samples and trains
its own half of every tree), and on-policy distillation from the teacher LoRA.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared support package


def _digest(tensors) -> str:
    digest = hashlib.sha1()
    for name, t in tensors:
        digest.update(name.encode())
        digest.update(t.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


#: each further trainer's settings for a cheap step: one trained noise level, the rollout's guidance in the KL
OWN_SETTINGS = {
    "dgpo": dict(dgpo_num_timesteps=1, dgpo_trunc_steps=1, beta=0.01, beta_dpo=10.0),
    "crd": dict(crd_num_timesteps=1, beta=0.01, kl_guidance_scale=1.0),
    # DRaFT-K through the last 2 steps, each checkpointed (DDP: the last one through DDP's forward), with the KL
    "reward_backprop": dict(reward_backprop_mode="draft", backprop_steps=2, kl_beta=0.01),
}
#: further trainers run on some families only: the reward-gradient trainer (video families do not give it images) on
#: one family whose DDP searches for unused weights and one editing family with packed latents, to keep the launch short
ONLY_ON = {"reward_backprop": ("qwenimage", "flux_kontext")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipelines", required=True, help="JSON {case name: tiny pipeline folder}")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--trainers", default="[]", help="JSON list of further trainer names (the registry's)")
    parser.add_argument("--dppo_branch_opd", default=None,
                        help="a tiny pipeline to train Flow-DPPO, BranchGRPO and on-policy distillation on")
    parser.add_argument("--teacher_lora", default=None, help="the teacher LoRA of --dppo_branch_opd's distillation")
    cli = parser.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from support.family_cases import CASES, brightness_reward, config_kwargs, dataset_rows
    from transformers import TrainerCallback

    from flowgrpo import DiffusionOPDConfig, DiffusionOPDTrainer, FlowGRPOConfig, FlowGRPOTrainer
    from flowgrpo.trainer.registry import config_class, trainer_class

    paths = json.loads(cli.pipelines)
    out = Path(cli.output_dir)
    records: dict[str, list] = {}
    rank = world = None

    def parts(trainer) -> dict[str, str]:
        """Digest of the trainable weights, per expert for a two-expert model ("transformer", "transformer_2")."""
        model = trainer.accelerator.unwrap_model(trainer.model)
        groups: dict[str, list] = {}
        two = len(trainer.adapter.transformers()) > 1
        for name, param in sorted(model.named_parameters()):
            if param.requires_grad:
                groups.setdefault(name.split(".")[2] if two else "all", []).append((name, param))
        return {k: _digest(v) for k, v in groups.items()}

    class Recorder(TrainerCallback):
        def __init__(self, trainer, sink):
            self.trainer, self.sink = trainer, sink

        def on_train_begin(self, args, state, control, **kwargs):
            self.sink.append({"step": 0, "weights": parts(self.trainer)})

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if not ("reward" in logs and "loss" in logs) and "ratio_mean" not in logs and "opd_kl" not in logs:
                return
            images, _, rewards = self.trainer.rollouts.last_samples
            frames = [f for sample in images for f in (sample if isinstance(sample, list) else [sample])]
            self.sink.append({
                "step": state.global_step,
                "logs": {k: float(v) for k, v in logs.items() if isinstance(v, (int, float))},
                "weights": parts(self.trainer),
                "samples": hashlib.sha1(b"".join(f.tobytes() for f in frames)).hexdigest(),
                "num_frames": [len(sample) if isinstance(sample, list) else 1 for sample in images],
                "rewards": rewards,
            })

    for case in CASES:
        if case.name not in paths:  # a launch may train a subset of the families
            continue
        args = FlowGRPOConfig(output_dir=str(out / case.name), **config_kwargs(
            case, max_steps=2, per_device_train_batch_size=2, num_generations=2, use_cpu=True, noise_level=1.0))
        trainer = FlowGRPOTrainer(model=paths[case.name], reward_funcs=brightness_reward, args=args,
                                  train_dataset=Dataset.from_dict(dataset_rows(case)),
                                  peft_config=LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian"))
        rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        records[case.name] = []
        trainer.add_callback(Recorder(trainer, records[case.name]))
        trainer.train()
        trainer.reward_set.close()
        for kind in json.loads(cli.trainers):
            if kind in ONLY_ON and case.name not in ONLY_ON[kind]:
                continue
            own = OWN_SETTINGS[kind]
            args = config_class(kind)(output_dir=str(out / case.name / kind), **config_kwargs(
                case, max_steps=1, per_device_train_batch_size=2, num_generations=4, use_cpu=True, **own))
            trainer = trainer_class(kind)(model=paths[case.name], reward_funcs=brightness_reward, args=args,
                                          train_dataset=Dataset.from_dict(dataset_rows(case)),
                                          peft_config=LoraConfig(r=2, lora_alpha=4, init_lora_weights=False))
            records[f"{case.name}/{kind}"] = []
            trainer.add_callback(Recorder(trainer, records[f"{case.name}/{kind}"]))
            trainer.train()
            trainer.reward_set.close()
    if cli.dppo_branch_opd:
        from support.family_cases import PROMPTS

        common = dict(report_to=[], resolution=32, num_inference_steps=3, eval_num_inference_steps=3,
                      guidance_scale=1.0, learning_rate=1e-2, beta=0.0, max_sequence_length=16, logging_steps=1,
                      save_strategy="no", disable_tqdm=True, seed=0, log_images_steps=0, dtype="float32",
                      use_cpu=True, noise_level=1.0, per_device_train_batch_size=2, max_steps=2)
        runs = {
            "new:dppo_branch": (FlowGRPOConfig, FlowGRPOTrainer, dict(
                num_generations=4, branch_steps=[0, 1], policy_loss="dppo", num_iterations=2)),
            "new:opd": (DiffusionOPDConfig, DiffusionOPDTrainer, dict(num_generations=2,
                                                                      teacher_lora=cli.teacher_lora)),
        }
        for name, (config_cls, trainer_cls, own) in runs.items():
            args = config_cls(output_dir=str(out / name.replace(":", "_")), **common, **own)
            trainer = trainer_cls(model=cli.dppo_branch_opd, reward_funcs=brightness_reward, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                  peft_config=LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian"))
            rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
            records[name] = []
            trainer.add_callback(Recorder(trainer, records[name]))
            trainer.train()
            trainer.reward_set.close()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world, "cases": records,
                                                      "pid": os.getpid()}))


if __name__ == "__main__":
    from flowgrpo.process_gc import pause_until_training

    pause_until_training()  # as src/train.py: the first train() turns the collector back on
    main()
