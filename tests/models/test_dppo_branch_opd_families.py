"""Flow-DPPO, BranchGRPO and on-policy distillation on every tiny model family (tests/support/family_cases.py).

Each family runs, cheaply, one Flow-GRPO trainer with both switches (a tree of two leaves split at the first step,
two passes over the batch so that Flow-DPPO's trust region acts on the second) and one DiffusionOPDTrainer step
distilled from a teacher LoRA of that family (loaded as a second adapter, both experts of the two-expert Wan 2.2
pipelines). What must hold: the tree's first pass is on-policy, its edges are the tree's, the second pass moves away
from the anchor, the distillation loss is finite and positive, and the student's adapter is the only one trained.
The two processes of a launch: tests/distributed/families_ddp_worker.py (its ``--dppo_branch_opd`` part).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from support.family_cases import CASE_IDS, CASES, brightness_reward, config_kwargs, dataset_rows
from support.trainer_cases import teacher_lora_folder

from flowgrpo import DiffusionOPDConfig, DiffusionOPDTrainer, FlowGRPOConfig, FlowGRPOTrainer

#: every family: a few seconds each (two small trainers), 15 families
pytestmark = pytest.mark.slow


def settings(case, **overrides):
    guidance = 1.0 if case.family != "flux_kontext" else case.guidance_scale  # one transformer call a step
    values = dict(max_steps=2, per_device_train_batch_size=2, num_generations=2, noise_level=1.0,
                  guidance_scale=guidance)
    return config_kwargs(case, **{**values, **overrides})


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_dppo_trees_and_distillation_train_every_family(case, tiny_pipeline_path, tmp_path):
    path = tiny_pipeline_path(case.family, case.variant)
    lora = LoraConfig(r=2, lora_alpha=4, init_lora_weights="gaussian")
    data = Dataset.from_dict(dataset_rows(case))
    args = FlowGRPOConfig(output_dir=str(tmp_path / "grpo"), **settings(case, policy_loss="dppo", num_iterations=2,
                                                                          branch_steps=[0]))
    trainer = FlowGRPOTrainer(model=str(path), reward_funcs=brightness_reward, args=args, train_dataset=data,
                              peft_config=lora)
    trainer.train()
    first, second = [h for h in trainer.state.log_history if "dppo/divergence_mean" in h]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["dppo/divergence_mean"] == 0.0
    assert first["branch/trained_edges"] == 4.0  # 2 edges at the split step 0, 2 at step 1; step 2 is the last
    assert second["dppo/divergence_mean"] > 0
    assert math.isfinite(second["grad_norm"])
    trainer.reward_set.close()

    opd_args = DiffusionOPDConfig(output_dir=str(tmp_path / "opd"), teacher_lora=str(teacher_lora_folder(path)),
                                  **settings(case, max_steps=1))
    student = DiffusionOPDTrainer(model=str(path), reward_funcs=brightness_reward, args=opd_args,
                                  train_dataset=data, peft_config=lora)
    model = student.policy.unwrapped
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    student.train()
    log = next(h for h in student.state.log_history if "opd_kl" in h)
    assert math.isfinite(log["opd_kl"]) and log["opd_kl"] > 0
    changed = {n for n, p in model.named_parameters() if "lora_" in n and not torch.equal(p, before[n])}
    assert changed and all(".default." in n for n in changed)  # the teacher's adapter stays frozen
    if case.variant == "two_experts":  # the teacher's LoRA on each expert
        teacher_params = [n for n, _ in model.named_parameters() if ".teacher0." in n]
        assert any(".transformer." in n for n in teacher_params) and any(".transformer_2." in n
                                                                         for n in teacher_params)
    student.reward_set.close()
