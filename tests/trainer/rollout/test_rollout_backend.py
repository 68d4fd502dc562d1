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
from flowgrpo.trainer.algorithms.flow_grpo_importance import (
    apply_proximal_anchor,
    apply_truncated_importance_weights,
)
from flowgrpo.trainer.data.datasets import INDEX_COLUMN
from flowgrpo.trainer.rollout.backend import LocalRolloutBackend, RolloutWorkerError
from flowgrpo.trainer.rollout.ray.backend import check_record_precision
from flowgrpo.trainer.rollout.ray.read_ahead import ReadAhead
from flowgrpo.trainer.rollout.ray.rewards import validate_reward_result
from flowgrpo.trainer.rollout.ray.weights import (
    bucket_layout,
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
    ({"rollout_backend": "ray", "weight_sync": "nccl"}, "weight_sync='nccl' is not valid; choose one of 'object_store'"),
    ({"weight_sync": "collective"}, "weight_sync set, but rollout_backend='local'"),
    ({"rollout_backend": "ray", "ray_start_timeout_s": 0}, "ray_start_timeout_s=0 must be a finite number > 0"),
    ({"rollout_backend": "ray", "weight_sync_bucket_mb": -1}, "weight_sync_bucket_mb=-1"),
    ({"reward_backend": "remote"}, "reward_backend='remote'"),
])
def test_bad_backend_settings_are_refused_with_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError) as raised:
        config(**kwargs)
    assert message in str(raised.value)


@pytest.mark.parametrize("config_name, kwargs", [
    ("DGPOConfig", {"per_device_train_batch_size": 16}),
    ("CRDConfig", {"per_device_train_batch_size": 24}),
    ("DiffusionOPDConfig", {"teacher_lora": "teacher"}),
    ("FlowGRPOConfig", {"branch_steps": [0, 1], "num_generations": 4}),
    ("FlowGRPOConfig", {"policy_loss": "dppo", "num_iterations": 2}),
])
def test_every_online_trainer_runs_on_rollout_workers(config_name, kwargs):
    import flowgrpo

    config_class = getattr(flowgrpo, config_name)
    args = config_class(output_dir="/tmp/unused", report_to=[], rollout_backend="ray", weight_sync="collective",
                        max_staleness=1, **kwargs)
    assert args.rollout_backend == "ray"
    # offline Diffusion-DPO samples nothing: refused, with its reason and the fix
    with pytest.raises(ValueError, match=r"rollout_backend='ray' with DiffusionDPOConfig: dpo_mode='offline'.*"
                                         r"Use rollout_backend: local\."):
        flowgrpo.DiffusionDPOConfig(output_dir="/tmp/unused", report_to=[], rollout_backend="ray", dpo_mode="offline")


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
    # Flow-DPPO's anchor of the same stale record: the trainer's weights' log-probs and means (the trust region's
    # centre), the worker's kept as the behaviour's
    anchored = dict(record)
    shift = apply_proximal_anchor(trainer.policy, trainer.rollouts, [anchored], args)
    assert torch.equal(anchored["log_probs"], stale["log_probs"]) and anchored["means"].shape == record["latents"].shape
    assert torch.equal(anchored["behaviour_log_probs"], behaviour)
    assert shift == pytest.approx(float((stale["log_probs"] - behaviour).sum(dim=1).mean()))
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


def test_a_collective_group_broadcasts_the_state_in_buckets_and_refuses_another_layout():
    """The trainer (rank 0) and two workers (threads here, processes on Ray) form a gloo group through the trainer's
    store; a state of two dtypes goes out in buckets of at most 64 bytes and lands in each worker's own tensors; a
    worker holding another layout takes part in every broadcast, then refuses (nobody is left waiting)."""
    import threading

    from flowgrpo.trainer.rollout.ray.collective import GroupHost, broadcast_state, join_group, receive_state
    from flowgrpo.trainer.rollout.ray.weights import check_layout

    state = {"policy/a": torch.arange(10, dtype=torch.float32), "policy/b": torch.ones(3, 4, dtype=torch.float64),
             "policy/c": torch.full((20,), 2.0)}
    buckets = bucket_layout(state, 64)
    assert len(buckets) == 3 and {s.dtype for b in buckets for s in b} == {"float32", "float64"}
    assert [s.key for s in buckets[2]] == ["policy/b"] and len({len(b) for b in buckets}) >= 1
    host = GroupHost("127.0.0.1", timeout_s=60)
    rendezvous = host.next_rendezvous(3, "gloo")
    received = [{k: torch.zeros_like(v) for k, v in state.items()},
                {"policy/a": torch.zeros(10), "policy/b": torch.zeros(4, 3, dtype=torch.float64),
                 "policy/c": torch.zeros(20)}]
    errors: dict[int, Exception] = {}

    def worker(rank: int) -> None:
        group = join_group(rendezvous, rank, "127.0.0.1", torch.device("cpu"))
        live = received[rank - 1]
        try:
            check_layout(live, {s.key: (s.torch_dtype, s.shape) for b in buckets for s in b})
        except ValueError as err:
            errors[rank] = err
        receive_state(group, buckets, None if rank in errors else live)

    threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2)]
    for thread in threads:
        thread.start()
    host.form(rendezvous, torch.device("cpu"))
    broadcast_state(host.group, state, buckets)
    for thread in threads:
        thread.join(timeout=60)
    assert state_digest(received[0]) == state_digest(state)
    assert list(errors) == [2] and "policy/b" in str(errors[2]) and not received[1]["policy/a"].any()
    assert host.next_rendezvous(2, "gloo").prefix != rendezvous.prefix  # a new formation, a new key prefix
    host.close()


def test_a_worker_samples_a_requests_trees_whole_with_the_same_leaves(tiny_sd3_path, tmp_path):
    """BranchGRPO with trees of 4 leaves and micro-batches of 2: the trainer's strategy samples each micro-batch's
    half of a tree (the shared prefix twice), the worker's (`for_workers`) the whole tree with the first micro-batch
    and keeps the other half for the second: half the transformer calls, the same leaves and records."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="branch_grpo", per_device_train_batch_size=2,
                           gradient_accumulation_steps=2,
                           num_generations=4, branch_steps=[0, 1], noise_level=1.0)
    engine = trainer.rollouts
    rows = [{"prompt": "a red circle", INDEX_COLUMN: 0} for _ in range(4)]
    calls = []
    hook = trainer.policy.adapter.transformers()[0].register_forward_pre_hook(lambda *a: calls.append(1))
    on_trainer = engine.generate(rows, 0, 0)
    trainer_calls = len(calls)
    engine.strategy = engine.strategy.for_workers(trainer.args, 0)
    calls.clear()
    on_worker = engine.generate(rows, 0, 0)
    hook.remove()
    assert engine.strategy.whole_trees and len(calls) * 2 == trainer_calls
    for mine, theirs in zip(on_trainer.records, on_worker.records):
        assert mine.keys() == theirs.keys()
        for key, value in mine.items():
            if isinstance(value, torch.Tensor):
                assert torch.allclose(value, theirs[key], atol=1e-6), key
            elif key != "embeds":
                assert value == theirs[key], key
    on_trainer.local_results()
    on_worker.local_results()
