"""Flow-GRPO's two switches on the tiny SD3 pipeline: Flow-DPPO's trust region (``policy_loss: dppo``) and BranchGRPO's
tree rollouts (``branch_steps``), checked against the pure functions of their loss files."""

import pytest
import torch
from support.trainer_cases import PROMPTS, make_trainer, redness_reward
from transformers import TrainerCallback

from flowgrpo.schedulers import sde_step_from_sigmas
from flowgrpo.trainer.algorithms.branch_grpo import (
    branch_tree_plan,
    depth_advantages,
    edge_log_prob,
    node_rewards,
    pruned_edges,
)
from flowgrpo.trainer.algorithms.flow_dppo_loss import transition_divergence
from flowgrpo.trainer.data.datasets import INDEX_COLUMN


def logs(trainer, key):
    return [h for h in trainer.state.log_history if key in h]


def recorded_means(trainer, record, j, fallback=None):
    """The trained policy's transition means at record step ``j`` (no gradient); ``fallback``: the sampling schedule's
    sigmas[1] (default: ``trainer``'s, once it has sampled)."""
    args = trainer.args
    fallback = float(trainer.rollouts.scheduler.sigmas[1]) if fallback is None else fallback
    x, t = record["latents"][:, j], record["timesteps"][:, j]
    with torch.no_grad():
        v = trainer.policy.velocity(trainer.model, x, t, record["embeds"], args.guidance_scale, *args.image_size)
        out = sde_step_from_sigmas(v, x, record["sigmas"][:, j], record["sigmas_next"][:, j],
                                   prev_sample=record["next_latents"][:, j], noise_level=args.noise_level,
                                   sigma_max_fallback=fallback)
    return out.prev_sample_mean, out.std


# ---- Flow-DPPO ---------------------------------------------------------------------------------------------------


def test_dppo_anchor_is_the_pre_update_means_and_the_region_acts_from_the_second_pass(tiny_sd3_path, tmp_path):
    settings = dict(policy_loss="dppo", num_iterations=2, sde_window_size=2, sde_window_range=[0, 2],
                    learning_rate=3e-2, max_steps=2, reward=redness_reward)
    trainer = make_trainer(tiny_sd3_path, tmp_path / "a", **settings)
    fresh = make_trainer(tiny_sd3_path, tmp_path / "b", **settings)  # the same initial weights, never trained
    divergences = []

    class AfterFirstUpdate(TrainerCallback):  # D of the second pass, worked out by hand from the updated weights
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                record = trainer.buffer[0]
                for j in range(2):
                    mean, std = recorded_means(trainer, record, j)
                    divergences.append(transition_divergence(mean, record["means"][:, j], std))

    trainer.add_callback(AfterFirstUpdate())
    trainer.train()
    record = trainer.buffer[0]
    for j in range(2):  # the anchor: the transition means of the weights that sampled the batch
        mean, _ = recorded_means(fresh, record, j, float(trainer.rollouts.scheduler.sigmas[1]))
        torch.testing.assert_close(record["means"][:, j], mean, rtol=1e-5, atol=1e-6)
    first, second = logs(trainer, "dppo/divergence_mean")
    assert first["dppo/divergence_mean"] == 0.0 and first["dppo/dropped_frac"] == 0.0  # on-policy: inside
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert "clip_frac" not in first
    # the logged values are the means over the two trained steps of each step's mean and largest D
    expected = torch.stack([d.mean() for d in divergences]).mean()
    assert second["dppo/divergence_mean"] == pytest.approx(float(expected), rel=1e-4)
    largest = torch.stack([d.max() for d in divergences]).mean()
    assert second["dppo/divergence_max"] == pytest.approx(float(largest), rel=1e-4)
    assert second["dppo/divergence_mean"] > 0


@pytest.mark.parametrize("tau, outside", [(1e-12, 1.0), (1e3, 0.0)])
def test_dppo_region_size(tiny_sd3_path, tmp_path, tau, outside):
    trainer = make_trainer(tiny_sd3_path, tmp_path, policy_loss="dppo", num_iterations=2, sde_window_size=1,
                           sde_window_range=[0, 2], learning_rate=3e-2, max_steps=2, dppo_tau=tau,
                           reward=redness_reward)
    trainer.train()
    second = logs(trainer, "dppo/outside_frac")[1]
    assert second["dppo/outside_frac"] == outside
    if outside == 0.0:
        assert second["dppo/dropped_frac"] == 0.0


# ---- BranchGRPO --------------------------------------------------------------------------------------------------

BRANCH = dict(branch_steps=[0, 1], num_generations=4, num_inference_steps=4, noise_level=1.0, reward=redness_reward)


def generation_rows(prompts=2, group=4):
    return [{"prompt": PROMPTS[i], INDEX_COLUMN: i} for i in range(prompts) for _ in range(group)]


def sample(trainer, rows, gen_index=0):
    with torch.no_grad():
        return trainer.rollouts.generate(rows, gen_index, 0)


def cat(records, key):
    return torch.cat([r[key] for r in records])


def test_tree_rollout_shares_prefixes_and_is_the_same_however_the_trees_are_split(tiny_sd3_path, tmp_path):
    # one generation of 2 prompts x 4 leaves: micro-batches of one tree, or of half a tree
    whole = make_trainer(tiny_sd3_path, tmp_path / "whole", per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, **BRANCH)
    split = make_trainer(tiny_sd3_path, tmp_path / "split", per_device_train_batch_size=2,
                         gradient_accumulation_steps=4, **BRANCH)
    rows = generation_rows()
    calls = []
    velocity = whole.policy.velocity

    def counting(model, latents, *args, **kwargs):
        calls.append(latents.shape[0])
        return velocity(model, latents, *args, **kwargs)

    whole.policy.velocity = counting
    a = sample(whole, rows)
    b = sample(split, rows)
    # 2 trees, each: the root twice at the split step 0, 4 rows at steps 1-3: 14 rows a tree, not 4 x 4
    assert calls == [2, 4, 4, 4] * 2
    for key in ("latents", "next_latents", "means", "log_probs", "tree_node", "tree_owner"):
        torch.testing.assert_close(cat(a.records, key), cat(b.records, key), rtol=1e-5, atol=1e-6)
    tree = a.records[0]
    x = tree["latents"]  # (4 leaves, 3 SDE steps, ...): each leaf's path
    assert all(torch.equal(x[0, 0], x[k, 0]) for k in range(4))  # one root
    assert torch.equal(x[0, 1], x[1, 1]) and torch.equal(x[2, 1], x[3, 1]) and not torch.equal(x[0, 1], x[2, 1])
    assert not torch.equal(x[0, 2], x[1, 2])  # split at step 1
    # every edge is owned once: 2 edges at step 0, then 4 a step
    owned = cat(a.records, "tree_owner").reshape(2, 4, 3).sum(1)
    assert owned.tolist() == [[2, 4, 4], [2, 4, 4]]
    assert torch.equal(cat(a.records, "tree_owner"), cat(b.records, "tree_owner"))
    # the trees draw from their own seeds: the two prompts' trees differ, a later generation too
    assert not torch.equal(a.records[0]["latents"][0, 0], a.records[1]["latents"][0, 0])
    assert not torch.equal(sample(whole, rows, gen_index=1).records[0]["latents"][0, 0], x[0, 0])


@pytest.mark.parametrize("split_log_prob", ["exact", "unscaled"])
def test_split_edges_log_prob_and_first_pass_on_policy(tiny_sd3_path, tmp_path, split_log_prob):
    trainer = make_trainer(tiny_sd3_path, tmp_path, per_device_train_batch_size=4, branch_split_log_prob=split_log_prob,
                           branch_noise_scale=4.0, **BRANCH)
    generation = sample(trainer, generation_rows(1))
    record = generation.records[0]
    std = torch.stack([recorded_means(trainer, record, j)[1] for j in range(3)], dim=1)
    for j, split in enumerate([True, True, False]):
        expected = edge_log_prob(record["next_latents"][:, j], record["means"][:, j], std[:, j], split, 4.0,
                                 split_log_prob=split_log_prob)
        torch.testing.assert_close(record["log_probs"][:, j], expected)
        if split:  # the child was drawn with 4 x the step's std
            z = (record["next_latents"][:, j] - record["means"][:, j]) / std[:, j].view(-1, 1, 1, 1)
            assert 2.0 < float(z.std()) < 8.0
    trainer.train()
    log = logs(trainer, "ratio_mean")[0]
    assert log["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and log["on_policy_ratio_max_dev"] < 1e-5
    assert log["branch/trained_edges"] == 10.0  # 2 + 4 + 4 edges of one tree (the last step is deterministic)


def test_edges_carry_their_childs_depth_advantage_and_pruning_leaves_edges_out(tiny_sd3_path, tmp_path):
    scores = []

    def reward(prompts, images, **columns):
        values = redness_reward(prompts, images)
        scores.extend(values)
        return values

    settings = {**BRANCH, "reward": reward, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 4,
                "branch_pruning": "width",
                "branch_width_ratio": 0.5, "num_inference_steps": 5}
    trainer = make_trainer(tiny_sd3_path, tmp_path, **settings)
    generation = sample(trainer, generation_rows())
    trainer.rollouts.score(generation)
    plan = branch_tree_plan(5, [0, 1], 2)
    leaf_rewards = torch.tensor(scores, dtype=torch.float64).reshape(2, 4)
    node_adv = depth_advantages(plan, node_rewards(plan, leaf_rewards))
    keep = pruned_edges(plan, node_adv, "width", width_ratio=0.5)
    edges = cat(generation.records, "edge_advantages")
    nodes = cat(generation.records, "tree_node")
    trained = cat(generation.records, "edge_trained")
    owner = cat(generation.records, "tree_owner")
    tree = torch.arange(8) // 4
    torch.testing.assert_close(edges, node_adv[tree[:, None], nodes].float())
    assert torch.equal(trained, owner & keep[tree[:, None], nodes])
    assert int(trained.sum()) < int(owner.sum())  # after the last split half of each branch's edges are left out
    assert int(trained[:, :2].sum()) == int(owner[:, :2].sum())  # the splits' own edges are all trained


def test_branch_settings_that_do_not_fit_a_tree_are_refused(tmp_path):
    from support.trainer_cases import make_args

    base = dict(branch_steps=[0, 1], num_generations=4, num_inference_steps=4)
    with pytest.raises(ValueError, match="last sampling step 3"):
        make_args(tmp_path, **{**base, "branch_steps": [0, 3]})
    for bad, match in ((dict(timestep_fraction=0.5), "timestep_fraction"),
                       (dict(filter_zero_std_groups=True), "filter_zero_std_groups"),
                       (dict(reward_aggregation="normalize_then_sum"), "reward_aggregation")):
        with pytest.raises(ValueError, match=match):
            make_args(tmp_path, **base, **bad)


def test_engine_samples_stretches_from_given_latents_with_given_draws(tiny_sd3_path, tmp_path):
    """Two stretches of steps, the second from where the first ended, sample what one whole call samples with the
    same draws; each SDE step's next state is mean + std z with the caller's z."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, num_inference_steps=4)
    engine = trainer.rollouts
    embeds, rows = engine.encode_unique(PROMPTS[:2])
    embeds = embeds.index_select(rows)
    x = trainer.adapter.prepare_latents(2, 64, 64, torch.Generator().manual_seed(0), torch.device("cpu"),
                                        torch.float32)
    draws = {i: torch.randn(x.shape, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)}
    kwargs = dict(record=True, record_means=True, step_noise=lambda i: draws[i])
    with torch.no_grad(), trainer.policy.generation_context() as model:
        whole, record = engine.sample(model, embeds, 4, 1.0, 0.7, (0, 3), None, initial_latents=x, **kwargs)
        middle, first = engine.sample(model, embeds, 4, 1.0, 0.7, (0, 3), None, initial_latents=x, steps=(0, 2),
                                      **kwargs)
        end, second = engine.sample(model, embeds, 4, 1.0, 0.7, (0, 3), None, initial_latents=middle, steps=(2, 4),
                                    **kwargs)
    torch.testing.assert_close(end, whole)
    for key in ("latents", "next_latents", "log_probs", "means"):
        torch.testing.assert_close(torch.cat([first[key], second[key]], dim=1), record[key])
    assert record["latents"].shape[1] == 3 and second["latents"].shape[1] == 1  # step 3 is deterministic
    std = (record["next_latents"][:, 0] - record["means"][:, 0]) / draws[0]
    assert float(std.std() / std.mean()) < 1e-4  # one std per sample: x' = mean + std z
    with pytest.raises(ValueError, match="initial_latents"):
        engine.sample(trainer.model, embeds, 4, 1.0, 0.7, (0, 3), None, record=False, steps=(1, 2))
