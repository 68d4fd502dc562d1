"""BranchGRPO's depth-wise advantages take the reward constraints as every trainer's advantages do: each
constrained reward's own depth-wise advantages, combined with the objective's by the multiplier (a real tree rollout
on the tiny SD3 pipeline)."""

import math

import pytest
import torch
from support.trainer_cases import TRAINER_KINDS, brightness_reward, make_trainer, redness_reward

from flowgrpo.trainer.algorithms.branch_grpo import depth_advantages, node_rewards
from flowgrpo.trainer.rollout.advantages import combine_constrained_advantages


def test_tree_advantages_carry_the_constrained_reward(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="branch_grpo", max_steps=1, learning_rate=3e-3,
                           reward=[brightness_reward, redness_reward], reward_weights=[1.0, 0.0], constraint_lr=1.0,
                           reward_constraints={"redness_reward": {"min": 10.0}}, **TRAINER_KINDS["branch_grpo"][2])
    strategy = trainer.rollouts.strategy
    seen = []
    assign = strategy.assign_advantages

    def keep(generation, advantages, kl_gate, gathered_rewards, gathered_groups):
        assign(generation, advantages, kl_gate, gathered_rewards, gathered_groups)
        seen.append((generation, gathered_rewards))

    strategy.assign_advantages = keep
    trainer.train()
    generation, totals = seen[0]
    terms = generation.constraint_terms
    multiplier = terms.multipliers["redness_reward"]
    assert multiplier == pytest.approx(10.0 - float(terms.rewards["redness_reward"].mean()))
    shape = strategy.shape_plan()
    g = shape.num_leaves
    objective = depth_advantages(shape, node_rewards(shape, totals.reshape(-1, g)), 5.0)
    own = depth_advantages(shape, node_rewards(shape, terms.rewards["redness_reward"].reshape(-1, g)), math.inf)
    expected = combine_constrained_advantages(objective, {"redness_reward": own}, terms.multipliers, 5.0)
    assert not torch.allclose(expected, objective)
    for record in generation.records:
        tree, nodes = (record["tree_rows"] // g).cpu(), record["tree_node"].cpu()
        torch.testing.assert_close(record["edge_advantages"].cpu(), expected[tree[:, None], nodes].float())
