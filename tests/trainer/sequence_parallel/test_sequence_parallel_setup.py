"""Sequence parallelism's set-up, without a launch: the configuration's checks, the refused families (at the
trainer's construction, before anything is loaded), the sampler that gives an SP group the same rows, and the
layout of ranks into groups. The training itself is tests/distributed/test_sequence_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flowgrpo.trainer.data.sampler import RepeatSampler
from flowgrpo.trainer.sequence_parallel import SequenceParallelLayout, sequence_parallel_loss_scale


def test_config_refuses_sizes_algorithms_and_backends_it_cannot_run(tmp_path):
    from flowgrpo import AWMConfig, FlowGRPOConfig

    common = dict(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=2, num_generations=2)
    assert FlowGRPOConfig(**common).sequence_parallel_size == 1
    with pytest.raises(ValueError, match="sequence_parallel_size=0 must be an integer >= 1"):
        FlowGRPOConfig(**common, sequence_parallel_size=0)
    alone = FlowGRPOConfig(**common, sequence_parallel_size=2)  # one process parses recipes (planning, --help)
    with pytest.raises(ValueError, match="sequence_parallel_size=2 does not divide the 3 processes"):
        alone.check_sequence_parallel_launch(3)
    with pytest.raises(ValueError, match="AWMTrainer: this algorithm has not been tested with sequence parallelism"):
        AWMConfig(**common, sequence_parallel_size=2)
    with pytest.raises(ValueError, match="rollout_backend='ray'.*span 2 GPUs"):
        FlowGRPOConfig(**common, sequence_parallel_size=2, rollout_backend="ray")


@pytest.mark.parametrize("family", ["sd3", "zimage", "wan"])
def test_trainer_refuses_before_loading(family, tiny_pipeline_path, tmp_path, monkeypatch):
    """SD3 and Z-Image are refused with the reason; a launch S does not divide (here one process) too."""
    from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
    from flowgrpo.trainer.policy import policy

    args = FlowGRPOConfig(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=2, num_generations=2,
                          sequence_parallel_size=2)
    monkeypatch.setattr(policy, "load_pipeline", None)  # loading anything would fail with another error
    expected = {"sd3": "sequence_parallel_size=2 with sd3.*SD3's transformer.*no context-parallel plan",
                "zimage": "sequence_parallel_size=2 with zimage.*Z-Image's transformer.*unified",
                "wan": "sequence_parallel_size=2 does not divide the 1 processes of this launch"}[family]
    with pytest.raises(ValueError, match=expected):
        FlowGRPOTrainer(model=str(tiny_pipeline_path(family)), reward_funcs=lambda prompts, images, **kw: [0.0] *
                        len(images), args=args, train_dataset=[{"prompt": "a cat"}] * 2)


def test_families_with_a_plan_pass_and_qwenimage21_is_refused():
    from flowgrpo.models import family_adapter_class
    from flowgrpo.trainer.policy.loading import check_sequence_parallel_family

    args = SimpleNamespace(sequence_parallel_size=2)
    for pipeline in ("WanPipeline", "WanImageToVideoPipeline", "LTX2Pipeline", "HunyuanVideo15Pipeline",
                     "FluxPipeline", "FluxKontextPipeline", "Flux2Pipeline", "QwenImagePipeline",
                     "QwenImageEditPlusPipeline"):
        check_sequence_parallel_family(family_adapter_class(pipeline), args)
    with pytest.raises(ValueError, match="qwenimage21.*block-causal"):
        check_sequence_parallel_family(family_adapter_class("QwenImage21Pipeline"), args)


def test_sampler_gives_every_process_of_a_group_its_replicas_share():
    # 2 replicas x 2 processes; a generation of 2 prompts x G=2 = 4 rows, 2 per replica (batch 2 per process)
    sampler = RepeatSampler(list(range(4)), num_generations=2, prompts_per_generation=2, shuffle=False,
                            sequence_parallel_size=2, data_parallel_size=2)
    rows = list(sampler)
    assert len(rows) == len(sampler) == 16
    batches = [rows[i:i + 2] for i in range(0, len(rows), 2)]  # accelerate: batch k goes to rank k mod 4
    first, second = batches[:4], batches[4:8]
    assert first == [[0, 0], [0, 0], [1, 1], [1, 1]]  # ranks 0, 1: replica 0's share; ranks 2, 3: replica 1's
    assert second == [[2, 2], [2, 2], [3, 3], [3, 3]]
    plain = RepeatSampler(list(range(4)), num_generations=2, prompts_per_generation=2, shuffle=False)
    assert list(plain) == [0, 0, 1, 1, 2, 2, 3, 3]  # unchanged without sequence parallelism


def test_layout_places_ranks_in_groups_and_keeps_one_copy_per_replica():
    layout = SequenceParallelLayout(size=2, rank=3, world_size=4)
    assert (layout.data_parallel_size, layout.data_parallel_rank, layout.sequence_parallel_rank) == (2, 1, 1)
    assert (layout.leader_rank, layout.group_ranks(), layout.is_leader) == (2, [2, 3], False)
    gathered = torch.tensor([[0.0], [0.0], [1.0], [1.0], [2.0], [2.0], [3.0], [3.0]])  # 2 rows per rank, rank order
    assert layout.leaders(gathered, 2).flatten().tolist() == [0.0, 0.0, 2.0, 2.0]
    assert layout.leaders([["a"], ["a"], ["b"], ["b"]]) == [["a"], ["b"]]
    assert sequence_parallel_loss_scale(layout) == 2.0
    with pytest.raises(ValueError, match="sequence_parallel_size=3 does not divide the 4 processes"):
        SequenceParallelLayout(size=3, rank=0, world_size=4)
