"""BranchGRPO (flowgrpo.trainer.algorithms.branch_grpo): the tree plan and its seeds, node rewards, the depth-wise
advantages' hand check of DESIGN section 11 and rules, pruning against a literal re-implementation of the official
procedure, and the split edges' log-probs."""

import math
import random

import pytest
import torch

from flowgrpo.trainer.algorithms.branch_grpo import (
    branch_tree_plan,
    depth_advantages,
    depth_pruning_window,
    edge_log_prob,
    edge_std,
    node_noise,
    node_rewards,
    pruned_edges,
)
from flowgrpo.trainer.seeds import seed_for


def test_hand_check_of_design_section_11():
    plan = branch_tree_plan(3, [0, 1], 2)  # 4 leaves: pairs (1, 2) and (3, 6)
    rewards = node_rewards(plan, torch.tensor([1.0, 2.0, 3.0, 6.0]))
    adv = depth_advantages(plan, rewards)
    assert rewards[list(plan.level_nodes(1))].tolist() == [1.5, 4.5]
    assert adv[plan.root] == 0
    assert adv[list(plan.level_nodes(1))].tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)
    for level in (2, 3):
        assert adv[list(plan.level_nodes(level))].tolist() == pytest.approx([-0.9258, -0.4629, 0.0, 1.3887], abs=1e-4)


def test_plan_of_the_official_setting():
    plan = branch_tree_plan(20, [9, 0, 6, 3], 2, seed=42, generation=3, tree_key=17)
    assert plan.branch_steps == (0, 3, 6, 9)
    widths = [plan.width(level) for level in range(21)]
    assert widths == [1, 2, 2, 2, 4, 4, 4, 8, 8, 8] + [16] * 11
    assert plan.num_leaves == 16 and len(plan.nodes) == sum(widths) and len(plan.edges) == len(plan.nodes) - 1
    assert sorted(plan.edges) == list(range(1, len(plan.nodes)))
    for node in plan.nodes[1:]:
        parent = plan.nodes[node.parent]
        assert parent.level == node.level - 1 and node.step == parent.level
        assert node.split == (node.step in plan.branch_steps)
        assert parent.branch == (node.branch // 2 if node.split else node.branch)
    for step in plan.steps:
        assert step.split == (step.step in (0, 3, 6, 9))
        assert len(step.children) == len(step.parents) * (2 if step.split else 1)
    # leaves below a node are one contiguous run of the leaf order
    node = plan.node_index(7, 5)
    below = [leaf for leaf in plan.leaves if _ancestor(plan, leaf, 7) == node]
    assert [plan.nodes[leaf].branch for leaf in below] == list(plan.leaf_span(node))


def _ancestor(plan, index, level):
    while plan.nodes[index].level > level:
        index = plan.nodes[index].parent
    return index


def test_seeds_depend_on_seed_generation_prompt_and_node_only():
    plan = branch_tree_plan(6, [0, 2], 2, seed=1, generation=5, tree_key=9)
    seeds = [n.noise_seed for n in plan.nodes]
    assert len(set(seeds)) == len(seeds)
    assert seeds == [seed_for("branch-node", 1, 5, 9, n.level, n.branch) for n in plan.nodes]
    assert seeds == [n.noise_seed for n in branch_tree_plan(6, [0, 2], 2, seed=1, generation=5, tree_key=9).nodes]
    for other in (dict(seed=2, generation=5, tree_key=9), dict(seed=1, generation=6, tree_key=9),
                  dict(seed=1, generation=5, tree_key=10)):
        assert not set(seeds) & {n.noise_seed for n in branch_tree_plan(6, [0, 2], 2, **other).nodes}


def _toy_mean(x, level):
    return 0.9 * x + 0.05 * (level + 1)


def test_any_execution_order_samples_the_same_tree():
    """A rollout engine that batches each level and one that walks the tree depth-first, children in reverse order,
    draw the same leaves: every draw comes from its node's own seed."""
    plan = branch_tree_plan(7, [1, 4], 3, seed=7, generation=2, tree_key=4)
    shape = (2, 3, 3)
    std = 0.2

    def draw(node):
        return node_noise(node, shape, dtype=torch.float64)

    # level by level, parents batched
    states = {plan.root: draw(plan.nodes[plan.root])}
    for step in plan.steps:
        parents = torch.stack([states[p] for p in step.parents])
        means = _toy_mean(parents, step.step)
        for child in step.children:
            node = plan.nodes[child]
            mean = means[step.parents.index(node.parent)]
            states[child] = mean + float(edge_std(std, node.split, 4.0)) * draw(node)
    batched = torch.stack([states[leaf] for leaf in plan.leaves])

    # depth-first, last child first
    walked = {}

    def visit(index, x):
        walked[index] = x
        for child in reversed(plan.children[index]):
            node = plan.nodes[child]
            visit(child, _toy_mean(x, node.step) + float(edge_std(std, node.split, 4.0)) * draw(node))

    visit(plan.root, draw(plan.nodes[plan.root]))
    assert torch.equal(batched, torch.stack([walked[leaf] for leaf in plan.leaves]))
    assert plan.num_leaves == 9 and len(set(batched.sum(dim=(1, 2, 3)).tolist())) == 9


def test_node_rewards_are_leaf_means_and_skip_unscored_leaves():
    plan = branch_tree_plan(4, [0, 2], 2)
    leaf = torch.tensor([[1.0, 3.0, float("nan"), 5.0], [0.0, 0.0, 0.0, 4.0]])
    r = node_rewards(plan, leaf)
    assert r.shape == (2, len(plan.nodes))
    assert r[0, plan.root] == 3.0 and r[1, plan.root] == 1.0
    assert r[0, list(plan.level_nodes(1))].tolist() == [2.0, 5.0]
    adv = depth_advantages(plan, r)
    assert adv[0, plan.leaves[2]] == 0  # the unscored leaf
    assert adv[0, list(plan.leaves)][[0, 1, 3]].tolist() == pytest.approx([-1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="has 5 rewards per tree but the tree has 4 leaves"):
        node_rewards(plan, torch.zeros(5))


def test_depth_advantage_rules():
    plan = branch_tree_plan(6, [0, 1, 2, 3, 4], 2)  # 32 leaves: an outlier's z-score exceeds 5
    leaves = torch.zeros(32)
    leaves[7] = 1.0
    adv = depth_advantages(plan, node_rewards(plan, leaves))
    assert adv[plan.leaves[7]] == 5.0  # 31 / sqrt(32) = 5.48, clamped
    expected_other = (0 - 1 / 32) / math.sqrt((31 * (1 / 32) ** 2 + (31 / 32) ** 2) / 31)
    assert float(adv[plan.leaves[0]]) == pytest.approx(expected_other, rel=1e-6)
    flat = depth_advantages(plan, node_rewards(plan, torch.full((32,), 0.3) + torch.arange(32) * 1e-9))
    assert torch.all(flat == 0)  # unbiased std below 1e-6: no signal


def official_pruning(plan, adv_per_tree, mode, ratio=0.5, depths=()):
    """The official procedure, literally: transitions collected depth-first from each root in order, depth pruning
    by the child's depth, then width pruning of the transitions whose parent step is after the last split (mode 1:
    grouped by the last split's child, best by advantage with Python's stable sort; mode 2: best and worst over
    all)."""
    samples = []
    for p, adv in enumerate(adv_per_tree):
        def collect(index, p=p, adv=adv):
            for child in plan.children[index]:
                node = plan.nodes[child]
                samples.append({"tree": p, "node": child, "parent": index, "step": plan.nodes[index].level,
                                "child_depth": node.level, "advantage": float(adv[child])})
                collect(child, p, adv)
        collect(plan.root)
    if depths:
        samples = [s for s in samples if s["child_depth"] not in set(depths)]
    if mode in (1, 2):
        last = max(plan.branch_steps)
        late = [s for s in samples if s["step"] > last]
        other = [s for s in samples if s["step"] <= last]
        if mode == 1:
            groups = {}
            for s in late:
                node = s["parent"]
                while plan.nodes[node].level != last + 1:
                    node = plan.nodes[node].parent
                groups.setdefault((s["tree"], node), []).append(s)
            kept = []
            for group in groups.values():
                keep = max(1, int(len(group) * ratio))
                kept.extend(sorted(group, key=lambda s: s["advantage"], reverse=True)[:keep])
        else:
            ordered = sorted(late, key=lambda s: s["advantage"], reverse=True)
            keep = max(2, int(len(ordered) * ratio))
            best = keep // 2
            kept = ordered[:best] + ordered[-(keep - best):]
        samples = other + kept
    return {(s["tree"], s["node"]) for s in samples}


@pytest.mark.parametrize("pruning, mode, ratio", [("width", "per_branch", 0.5), ("width", "best_worst", 0.5),
                                                  ("width", "per_branch", 0.3), ("width", "best_worst", 0.25)])
def test_width_pruning_is_the_official_procedure(pruning, mode, ratio):
    plan = branch_tree_plan(9, [0, 2, 4], 2)
    rng = random.Random(0)
    for _ in range(5):
        leaves = torch.tensor([[rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(8)] for _ in range(3)])
        adv = depth_advantages(plan, node_rewards(plan, leaves))
        keep = pruned_edges(plan, adv, pruning, width_mode=mode, width_ratio=ratio)
        got = {(p, n) for p, n in zip(*torch.nonzero(keep, as_tuple=True)) for p, n in [(int(p), int(n))]}
        assert got == official_pruning(plan, adv, 1 if mode == "per_branch" else 2, ratio)
        assert not bool(keep[:, plan.root].any())
        early = [n for n in plan.edges if plan.nodes[n].step <= 4]
        assert bool(keep[:, early].all())  # edges up to the last split are never width-pruned


def test_per_branch_width_pruning_keeps_each_branchs_earliest_steps():
    plan = branch_tree_plan(10, [0, 3], 2)
    adv = depth_advantages(plan, node_rewards(plan, torch.tensor([[1.0, 4.0, 2.0, 0.0]])))
    keep = pruned_edges(plan, adv, "width", width_mode="per_branch", width_ratio=0.5)
    for leaf_branch in range(4):
        chain = [plan.node_index(level, leaf_branch) for level in range(5, 11)]  # edges sampled at steps 4 .. 9
        assert keep[0, chain].tolist() == [True, True, True, False, False, False]


def test_depth_pruning_and_its_sliding_window():
    plan = branch_tree_plan(20, [0, 3, 6, 9], 2)
    adv = torch.zeros(1, len(plan.nodes))
    keep = pruned_edges(plan, adv, "depth", prune_depths=[15, 16, 17, 18])
    for node in plan.edges:
        assert bool(keep[0, node]) == (plan.nodes[node].level not in (15, 16, 17, 18))
    assert depth_pruning_window([15, 16, 17, 18]) == (15, 16, 17, 18)
    assert depth_pruning_window([15, 16, 17, 18], step=89, slide_interval=30, stop_depth=9) == (13, 14, 15, 16)
    assert depth_pruning_window([15, 16, 17, 18], step=10_000, slide_interval=30, stop_depth=9) == (9, 10, 11, 12)
    with pytest.raises(ValueError, match="branch_pruning='wide' is not valid"):
        pruned_edges(plan, adv, "wide")


def test_split_edge_log_prob_exact_and_the_official_quirk():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 2, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    std = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    split = torch.tensor([True, False, True])
    sample = mean.detach() + edge_std(std, split, 4.0).view(-1, 1, 1, 1) * torch.randn(3, 2, 4, 4, generator=g,
                                                                                          dtype=torch.float64)
    exact = edge_log_prob(sample, mean, std, split, 4.0)
    quirk = edge_log_prob(sample, mean, std, split, 4.0, split_log_prob="unscaled")
    for i in range(3):  # against torch.distributions, with the std each edge was drawn with (or the unscaled one)
        drawn_with = float(std[i]) * (4.0 if split[i] else 1.0)
        normal = torch.distributions.Normal(mean.detach()[i], drawn_with)
        assert float(exact.detach()[i]) == pytest.approx(float(normal.log_prob(sample[i]).mean()), rel=1e-12)
        unscaled = torch.distributions.Normal(mean.detach()[i], float(std[i]))
        assert float(quirk.detach()[i]) == pytest.approx(float(unscaled.log_prob(sample[i]).mean()), rel=1e-12)
    assert exact[1] == quirk[1]  # a non-split edge is the same either way
    exact.sum().backward()
    expected = (sample - mean.detach()) / (edge_std(std, split, 4.0).view(-1, 1, 1, 1) ** 2 * 32)
    assert torch.allclose(mean.grad, expected, rtol=1e-12)
    with pytest.raises(ValueError, match="split_log_prob='scaled' is not valid"):
        edge_log_prob(sample, mean, std, split, 4.0, split_log_prob="scaled")


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="branch_steps \\[20\\] are outside 0 .. num_inference_steps - 1 = 19"):
        branch_tree_plan(20, [0, 20], 2)
    with pytest.raises(ValueError, match="repeats a step"):
        branch_tree_plan(20, [3, 3], 2)
    with pytest.raises(ValueError, match="branch_factor=1 must be an integer >= 2"):
        branch_tree_plan(20, [3], 1)
