"""DGPO's loss and schedules (flowgrpo.trainer.algorithms.dgpo_loss): the hand check of DESIGN section 11, gradients
against autograd and an independent float64 computation, the trust region's direction, the cross-process group sum,
and the pure schedules."""

import math

import numpy as np
import pytest
import torch

from flowgrpo.trainer.algorithms.dgpo_loss import (
    dense_group_index,
    dgpo_loss,
    dgpo_policy_loss,
    dgpo_reference_decay,
    dgpo_rollouts_use_ema_reference,
    dgpo_step_indices,
    dsm_clip_mask,
    dsm_error,
    group_shared_noise,
)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_hand_check_of_design_section_11():
    dsm = torch.tensor([0.50, 0.40], dtype=torch.float64, requires_grad=True)
    out = dgpo_policy_loss(dsm, torch.tensor([0.45, 0.45], dtype=torch.float64), torch.tensor([1.0, -1.0]),
                           torch.tensor([0, 0]), 1, beta_dpo=10.0, group_size=2)
    assert float(out.group_scores[0]) == pytest.approx(0.5, abs=1e-12)
    assert float(out.sample_weights[0]) == pytest.approx(0.62246, abs=1e-5)
    assert float(out.loss.detach()) == pytest.approx(0.031123, abs=1e-6)
    out.loss.backward()
    assert dsm.grad.tolist() == pytest.approx([0.31123, -0.31123], abs=1e-5)


def test_dsm_is_the_flow_matching_error_in_float32_at_least():
    g = torch.Generator().manual_seed(0)
    v, eps, x0 = (torch.randn(3, 2, 4, 4, generator=g).to(torch.bfloat16) for _ in range(3))
    d = dsm_error(v, eps, x0)
    assert d.dtype == torch.float32
    ref = ((v.double() - (eps.double() - x0.double())) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(d.double(), ref, rtol=1e-6)


def independent(v, eps, x0, v_ref, v_old, v_kl, adv, groups, beta_dpo, k, clip, beta, clip_kl, c=5.0):
    """The formulas written out per sample in numpy float64 (loss only; the gradient is checked by autograd of this
    same expression with the weights frozen, below)."""
    v, eps, x0, v_ref, v_old, v_kl = (t.detach().double().numpy() for t in (v, eps, x0, v_ref, v_old, v_kl))
    adv = np.clip(adv.double().numpy(), -c, c)
    n = v.shape[0]
    d = [np.mean((v[i] - (eps[i] - x0[i])) ** 2) for i in range(n)]
    d_ref = [np.mean((v_ref[i] - (eps[i] - x0[i])) ** 2) for i in range(n)]
    d_old = [np.mean((v_old[i] - (eps[i] - x0[i])) ** 2) for i in range(n)]
    scores = {}
    for i in range(n):
        scores[groups[i]] = scores.get(groups[i], 0.0) + adv[i] * beta_dpo * (d[i] - d_ref[i]) / k
    w = [sigmoid(scores[groups[i]]) for i in range(n)]
    clipped = []
    for i in range(n):
        rho = math.exp(d_old[i] - d[i])
        clipped.append(rho > 1 + clip if adv[i] > 0 else rho < 1 - clip)
    policy = np.mean([w[i] * adv[i] * d[i] for i in range(n)])
    kl = np.mean([np.mean((v[i] - v_kl[i]) ** 2) for i in range(n)])
    return policy + beta * kl, w, clipped


def test_loss_weights_and_gradient_match_an_independent_computation():
    g = torch.Generator().manual_seed(1)
    shape = (6, 2, 3, 3)
    x0, eps = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    target = eps - x0
    v = (target + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    v_ref = target + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    # the old policy is close to v for some samples and far for others, so both sides of the region occur
    v_old = v.detach() + torch.tensor([0.0, 0.5, 0.0, 0.5, 0.001, 0.0], dtype=torch.float64).view(-1, 1, 1, 1) \
        * torch.randn(shape, generator=g, dtype=torch.float64)
    v_kl = target + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.5, -1.0, 7.0, 0.0, -2.0], dtype=torch.float64)
    groups = [3, 3, 3, 11, 11, 11]
    index, num_groups = dense_group_index(torch.tensor(groups))
    out = dgpo_loss(v, eps, x0, adv, index, num_groups, v_dgpo_ref=v_ref, beta_dpo=20.0, group_size=3, v_old=v_old,
                    clip=0.05, v_kl_ref=v_kl, beta=0.3)
    expected, w, clipped = independent(v, eps, x0, v_ref, v_old, v_kl, adv, groups, 20.0, 3, 0.05, 0.3, False)
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-12)
    assert out.sample_weights.tolist() == pytest.approx(w, rel=1e-12)
    assert out.clip_mask.tolist() == clipped
    assert any(clipped) and not all(clipped)
    out.loss.backward()
    # gradient: d/dv of mean_i w_i A_i D_i (unclipped samples only) + beta mean_i mean((v - v_kl)^2)
    n, numel = 6, 18
    a = adv.clamp(-5, 5)
    expected_grad = torch.zeros(shape, dtype=torch.float64)
    for i in range(n):
        if not clipped[i]:
            expected_grad[i] += w[i] * a[i] * 2 * (v[i].detach() - target[i]) / (numel * n)
        expected_grad[i] += 0.3 * 2 * (v[i].detach() - v_kl[i]) / (numel * n)
    assert torch.allclose(v.grad, expected_grad, rtol=1e-10, atol=1e-14)


def test_clip_mask_follows_the_advantage_direction_and_zero_advantage_takes_the_lower_side():
    dsm = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    old = torch.log(torch.tensor([1.2, 0.8, 1.2, 0.8, 0.8, 1.2])) + dsm  # rho = 1.2, .8, 1.2, .8, .8, 1.2
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0])
    mask = dsm_clip_mask(dsm, old, adv, 0.1)
    assert mask.tolist() == [True, False, False, True, True, False]


def test_clipped_samples_get_no_dsm_gradient_and_clip_kl_detaches_their_kl():
    g = torch.Generator().manual_seed(2)
    shape = (2, 1, 2, 2)
    x0, eps = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g, requires_grad=True)
    v_old = v.detach() - 0.5 * (v.detach() - (eps - x0))  # the old policy fits better: rho < 1 for both samples
    adv = torch.tensor([-1.0, 1.0])  # sample 0 moves against its advantage (clipped), sample 1 does not
    common = dict(v_dgpo_ref=torch.randn(shape, generator=g), beta_dpo=5.0, group_size=2, v_old=v_old, clip=0.01,
                  v_kl_ref=torch.randn(shape, generator=g), beta=1.0)
    out = dgpo_loss(v, eps, x0, adv, torch.tensor([0, 0]), 1, clip_kl=True, **common)
    assert out.clip_mask.tolist() == [True, False]
    out.loss.backward()
    assert torch.all(v.grad[0] == 0) and torch.any(v.grad[1] != 0)
    v.grad = None
    out = dgpo_loss(v, eps, x0, adv, torch.tensor([0, 0]), 1, clip_kl=False, **common)
    out.loss.backward()
    assert torch.any(v.grad[0] != 0)  # only the KL term reaches the clipped sample
    assert float(out.clip_frac) == 0.5


def test_group_sum_over_processes_equals_the_single_process_score():
    """Two processes holding halves of each group: with the all-reduce (simulated by adding the other half's local
    sums) every sample gets the weight the whole micro-batch would give it, and the mean of the two processes'
    gradients equals the single-process gradient."""
    g = torch.Generator().manual_seed(3)
    dsm = torch.rand(8, generator=g, dtype=torch.float64)
    ref = torch.rand(8, generator=g, dtype=torch.float64)
    adv = torch.randn(8, generator=g, dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    d_whole = dsm.clone().requires_grad_(True)
    whole = dgpo_policy_loss(d_whole, ref, adv, groups, 2, beta_dpo=50.0, group_size=4)
    halves = [slice(0, 4), slice(4, 8)]
    local_sums = []
    for part in halves:  # first pass: each process's own sums
        out = dgpo_policy_loss(dsm[part], ref[part], adv[part], groups[part], 2, beta_dpo=50.0, group_size=4)
        local_sums.append(out.group_scores.detach())
    total = local_sums[0] + local_sums[1]
    assert torch.allclose(total, whole.group_scores)
    grads = []
    for part in halves:
        d = dsm[part].clone().requires_grad_(True)
        out = dgpo_policy_loss(d, ref[part], adv[part], groups[part], 2, beta_dpo=50.0, group_size=4,
                               reduce_group_sums=lambda t: total.clone())
        assert torch.allclose(out.sample_weights, whole.sample_weights[part])
        out.loss.backward()
        grads.append(d.grad)
    whole.loss.backward()
    # each process averages over its 4 samples; DDP averages the two processes' gradients
    assert torch.allclose(torch.cat(grads) / 2, d_whole.grad, rtol=1e-12)


def test_dense_group_index_is_shared_by_processes_that_see_the_same_labels():
    index, n = dense_group_index(torch.tensor([42, 7, 42, 99, 7]))
    assert n == 3 and index.tolist() == [1, 0, 1, 2, 0]


def test_bad_inputs_are_refused_with_the_value():
    d = torch.ones(2)
    with pytest.raises(ValueError, match="beta_dpo=0"):
        dgpo_policy_loss(d, d, d, torch.tensor([0, 0]), 1, beta_dpo=0.0, group_size=2)
    with pytest.raises(ValueError, match="group_index must lie in 0 .. num_groups - 1 = 0"):
        dgpo_policy_loss(d, d, d, torch.tensor([0, 1]), 1, beta_dpo=1.0, group_size=2)


def test_step_indices_are_a_pure_distinct_draw_from_zero_to_trunc_inclusive():
    draws = [dgpo_step_indices(seed=5, step=s, inner_epoch=0, num_timesteps=4, trunc_steps=6) for s in range(200)]
    assert all(len(set(d)) == 4 and all(0 <= i <= 6 for i in d) for d in draws)
    assert {i for d in draws for i in d} == set(range(7))  # index trunc_steps itself is a candidate
    assert dgpo_step_indices(5, 17, 0, 4, 6) == draws[17]  # the same on every process, whatever ran before
    assert dgpo_step_indices(5, 17, 1, 4, 6) != draws[17] or dgpo_step_indices(5, 18, 1, 4, 6) != draws[18]
    assert len({tuple(d) for d in draws}) > 100
    assert sorted(dgpo_step_indices(0, 0, 0, 5, 4)) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="num_timesteps=8 must be in 1 .. trunc_steps \\+ 1 = 7"):
        dgpo_step_indices(0, 0, 0, 8, 6)


def test_group_shared_noise_is_shared_within_groups_and_independent_of_the_process():
    like = torch.zeros(5, 2, 3, 3)
    noise = group_shared_noise(like, [4, 9, 4, 9, 1], 0, 3, 1)
    assert torch.equal(noise[0], noise[2]) and torch.equal(noise[1], noise[3]) and not torch.equal(noise[0], noise[1])
    other_process = group_shared_noise(like[:2], [9, 1], 0, 3, 1)
    assert torch.equal(other_process[0], noise[1]) and torch.equal(other_process[1], noise[4])
    assert not torch.equal(group_shared_noise(like, [4, 9, 4, 9, 1], 0, 3, 2)[0], noise[0])


def test_ema_reference_schedule_and_rollout_switch():
    assert dgpo_reference_decay(0) == 0.0
    assert dgpo_reference_decay(150) == pytest.approx(0.15)
    assert dgpo_reference_decay(300) == dgpo_reference_decay(10_000) == 0.3
    assert not dgpo_rollouts_use_ema_reference(200, 200) and dgpo_rollouts_use_ema_reference(201, 200)
