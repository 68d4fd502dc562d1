"""The rollout backend's parts that need no Ray cluster: the configuration's checks, the weights a worker receives
(collected, loaded, digested, refused when they do not match), the read-ahead of the dataloader, the check of reward
results from another process, the float32 check of a received trajectory, and truncated importance weights on a real
tiny Flow-GRPO trainer. The Ray cluster's tests are in tests/distributed/test_ray_rollouts.py."""

from __future__ import annotations

import math

import pytest
import torch
from support.trainer_cases import make_trainer

from flowgrpo import DiffusionNFTConfig, DiffusionNFTTrainer, FlowGRPOConfig
from flowgrpo.rewards import RewardResult, resolve_reward_funcs
from flowgrpo.trainer.algorithms.flow_grpo_importance import apply_truncated_importance_weights
from flowgrpo.trainer.data.datasets import INDEX_COLUMN
from flowgrpo.trainer.rollout.backend import LocalRolloutBackend, RolloutWorkerError
from flowgrpo.trainer.rollout.ray.backend import check_record_precision
from flowgrpo.trainer.rollout.ray.read_ahead import ReadAhead
from flowgrpo.trainer.rollout.ray.rewards import validate_reward_result
from flowgrpo.trainer.rollout.ray.weights import (
    collect_policy_state,
    load_policy_state,
    policy_state_digest,
    state_digest,
)
from flowgrpo.trainer.rollout.ray.worker import SingleProcessAccelerator


def config(**kwargs):
    return FlowGRPOConfig(output_dir="/tmp/unused", report_to=[], **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"rollout_backend": "slurm"}, "rollout_backend='slurm'"),
    ({"max_staleness": 1}, "max_staleness set, but rollout_backend='local'"),
    ({"rollout_worker_resources": {"num_gpus": 1}}, "rollout_worker_resources set"),
    ({"rollout_backend": "ray", "weight_sync_steps": 3, "max_staleness": 1}, "set max_staleness >= 2"),
    ({"rollout_backend": "ray", "rollout_worker_resources": '{"gpus": 1}'}, "unknown key(s) ['gpus']"),
    ({"rollout_backend": "ray", "rollout_worker_resources": "{num_gpus: 1"}, "is not valid JSON"),
    ({"rollout_backend": "ray", "rollout_worker_resources": {"num_gpus": -1}}, "must be a number >= 0"),
    ({"rollout_backend": "ray", "max_staleness": -1}, "max_staleness=-1 must be an integer >= 0"),
    ({"rollout_backend": "ray", "rollout_timeout_s": 0}, "rollout_timeout_s=0"),
    ({"rollout_backend": "ray", "truncated_importance_cap": 0.5}, "truncated_importance_cap=0.5"),
    ({"reward_backend": "remote"}, "reward_backend='remote'"),
])
def test_bad_backend_settings_are_refused_with_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError) as raised:
        config(**kwargs)
    assert message in str(raised.value)


@pytest.mark.parametrize("config_name, kwargs, message", [
    ("DGPOConfig", {"per_device_train_batch_size": 16}, "its rollouts switch to the EMA reference"),
    ("CRDConfig", {"per_device_train_batch_size": 24}, "its rollouts are sampled by a named sampling copy"),
    ("DiffusionOPDConfig", {"teacher_lora": "teacher"}, "its teachers replay the student's states"),
    ("FlowGRPOConfig", {"branch_steps": [0, 1], "num_generations": 4}, "branch_steps=[0, 1] samples each group as a tree"),
    ("FlowGRPOConfig", {"policy_loss": "dppo", "num_iterations": 2}, "policy_loss='dppo' anchors each transition"),
])
def test_trainers_whose_rollouts_workers_cannot_reproduce_refuse_ray(config_name, kwargs, message):
    import flowgrpo

    config_class = getattr(flowgrpo, config_name)
    config_class(output_dir="/tmp/unused", report_to=[], **kwargs)  # local: accepted
    with pytest.raises(ValueError) as raised:
        config_class(output_dir="/tmp/unused", report_to=[], rollout_backend="ray", **kwargs)
    assert f"rollout_backend='ray' with {config_name}: {message}" in str(raised.value)
    assert "Use rollout_backend: local." in str(raised.value)


def test_backend_settings_parse_json_resources():
    args = config(rollout_backend="ray", rollout_worker_resources='{"num_gpus": 1, "num_cpus": 4}', max_staleness=1,
                  weight_sync_steps=2)
    assert args.rollout_worker_resources == {"num_gpus": 1, "num_cpus": 4}
    assert config().rollout_backend == "local"


def test_the_help_lists_the_backend_fields():
    doc = FlowGRPOConfig.__doc__
    for name in ("rollout_backend", "rollout_workers", "rollout_worker_resources", "max_staleness",
                 "weight_sync_steps", "reward_backend", "reward_workers", "ray_address", "rollout_timeout_s",
                 "truncated_importance_cap"):
        assert f"    {name} (`" in doc, name


def test_read_ahead_yields_the_batches_unchanged_and_shows_each_generation_early():
    seen = []
    batches = [[{"prompt": f"p{i // 2}", "i": i}] for i in range(9)]  # two micro-steps per generation
    ahead = ReadAhead(iter(batches), position=0, depth=3, period=2, note=lambda g, rows: seen.append((g, rows)))
    first = next(ahead)
    assert first is batches[0]
    assert [g for g, _ in seen] == [0, 1]  # generation 1 (micro-step 2) is known while micro-step 0 trains
    assert list(ahead) == batches[1:]
    assert [g for g, _ in seen] == [0, 1, 2, 3, 4] and all(rows is batches[2 * g] for g, rows in seen)


def test_reward_results_from_workers_are_checked_like_local_ones():
    rewards = resolve_reward_funcs(["jpeg_compressibility", "jpeg_incompressibility"], [1.0, 0.5])
    good = RewardResult(per_reward={"jpeg_compressibility": [1.0, float("nan")], "jpeg_incompressibility": [2.0, 3.0]},
                        total=[0.0, 0.0])
    checked = validate_reward_result(good, rewards, 2, "reward worker 0")
    assert checked.per_reward["jpeg_compressibility"] == [1.0, None]  # non-finite: unscored, as locally
    assert checked.total == [2.0, None]  # recomputed with the trainer's weights
    with pytest.raises(ValueError, match="gave 1 scores for 2 samples"):
        validate_reward_result(RewardResult(per_reward={"jpeg_compressibility": [1.0], "jpeg_incompressibility":
                                                        [1.0, 2.0]}, total=[1.0, 2.0]), rewards, 2, "w")
    with pytest.raises(ValueError, match="scored rewards"):
        validate_reward_result(RewardResult(per_reward={"other": [1.0, 2.0]}, total=[1.0, 2.0]), rewards, 2, "w")
    with pytest.raises(TypeError, match="expected a number or None"):
        validate_reward_result(RewardResult(per_reward={"jpeg_compressibility": ["a", 1.0],
                                                        "jpeg_incompressibility": [1.0, 2.0]}, total=[1.0, 2.0]),
                               rewards, 2, "w")
    with pytest.raises(TypeError, match="not a RewardResult"):
        validate_reward_result([1.0, 2.0], rewards, 2, "w")


def test_a_half_precision_trajectory_is_refused():
    check_record_precision({"latents": torch.zeros(2, 3), "embeds": torch.zeros(2, dtype=torch.bfloat16)}, "w")
    with pytest.raises(RolloutWorkerError, match="'log_probs' in torch.bfloat16"):
        check_record_precision({"log_probs": torch.zeros(2, dtype=torch.bfloat16)}, "w")


def test_a_worker_policy_loads_exactly_what_the_trainer_holds_old_policy_included(tiny_sd3_path, tmp_path):
    """Two NFT trainers stand for the trainer and a worker (the same model and LoRA configuration): the trainer's
    state, old-policy adapter included, loads into the other, whose read-back digest equals the sent one; keys of
    another adapter, or of another dtype, are refused."""
    from datasets import Dataset
    from support.trainer_cases import PROMPTS, lora_config

    def nft(out):
        args = DiffusionNFTConfig(output_dir=str(out), report_to=[], per_device_train_batch_size=4, num_generations=4,
                                  resolution=64, num_inference_steps=4, guidance_scale=1.0, max_sequence_length=16,
                                  dtype="float32", max_steps=1)
        return DiffusionNFTTrainer(model=str(tiny_sd3_path), reward_funcs="jpeg_compressibility", args=args,
                                   train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora_config())

    trainer, worker = nft(tmp_path / "a"), nft(tmp_path / "b")
    with torch.no_grad():
        for p in trainer.policy.trainable_parameters():
            p.add_(0.01)
        trainer.policy.update_old_policy(0.5)
    state = collect_policy_state(trainer.policy)
    assert any(".old." in k for k in state) and any(".default." in k for k in state)
    assert state_digest(state) != policy_state_digest(worker.policy)
    load_policy_state(worker.policy, state)
    assert policy_state_digest(worker.policy) == state_digest(state) == policy_state_digest(trainer.policy)
    without_old = {k: v for k, v in state.items() if ".old." not in k}
    with pytest.raises(ValueError, match="missing"):
        load_policy_state(worker.policy, without_old)
    other_dtype = {k: v.double() for k, v in state.items()}
    with pytest.raises(ValueError, match="torch.float64"):
        load_policy_state(worker.policy, other_dtype)


def test_truncated_importance_weights_replay_the_window_with_the_current_weights(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, per_device_train_batch_size=4, num_generations=4,
                           sde_window_size=2, sde_window_range=[0, 2], truncated_importance_cap=None)
    args = trainer.args
    args.truncated_importance_cap = 2.0  # read by the replay as the Ray backend passes it
    rows = [{"prompt": "a red circle", INDEX_COLUMN: 0} for _ in range(4)]
    generation = trainer.rollouts.generate(rows, 0, 0)
    record = generation.records[0]
    behaviour = record["log_probs"].clone()
    # unchanged weights: the replay gives the behaviour log-probs back, every weight is exactly 1
    weights = apply_truncated_importance_weights(trainer.policy, trainer.rollouts, [dict(record)], args)
    assert torch.equal(weights, torch.ones(4))
    # one "optimizer step" later: the proximal log-probs move, w = min(exp(sum_j prox - behaviour), 2)
    with torch.no_grad():
        for p in trainer.policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale = dict(record)
    weights = apply_truncated_importance_weights(trainer.policy, trainer.rollouts, [stale], args)
    assert torch.equal(stale["behaviour_log_probs"], behaviour) and not torch.equal(stale["log_probs"], behaviour)
    expected = torch.exp((stale["log_probs"] - behaviour).sum(dim=1)).clamp(max=2.0)
    assert torch.allclose(weights, expected) and torch.equal(stale["importance_weights"], weights)
    assert not torch.equal(weights, torch.ones(4)) and float(weights.max()) <= 2.0
    # the loss sees the weighted advantages
    stale["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    assert torch.allclose(trainer._advantages(stale), stale["advantages"] * weights)
    assert isinstance(trainer.rollout_backend, LocalRolloutBackend)
    generation.local_results()


def test_the_cap_is_refused_for_algorithms_without_behaviour_log_probs(tiny_sd3_path, tmp_path):
    from datasets import Dataset
    from support.trainer_cases import PROMPTS, lora_config

    args = DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=4,
                              num_generations=4, resolution=64, num_inference_steps=4, guidance_scale=1.0,
                              max_sequence_length=16, dtype="float32", rollout_backend="ray",
                              truncated_importance_cap=2.0)
    with pytest.raises(ValueError, match="records none"):
        DiffusionNFTTrainer(model=str(tiny_sd3_path), reward_funcs="jpeg_compressibility", args=args,
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora_config())


def test_the_single_process_stand_in_follows_the_trainers_mixed_precision():
    cpu = SingleProcessAccelerator("cpu", "bf16")
    with cpu.autocast():
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert y.dtype == torch.bfloat16
    with SingleProcessAccelerator("cpu", "no").autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert cpu.gather(torch.ones(3)).shape == (3,) and cpu.num_processes == 1 and not math.isnan(0.0)
