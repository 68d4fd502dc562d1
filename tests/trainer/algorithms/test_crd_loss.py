"""CRD's loss and schedules (flowgrpo.trainer.algorithms.crd_loss): the hand check of DESIGN section 11, the implicit
reward, both centrings and both loss types against an independent float64 computation, the gradient against finite
differences, the reward-weighted KL, the stratified draw and the copies' schedules."""

import math

import numpy as np
import pytest
import torch

from flowgrpo.trainer.algorithms.awm_loss import sample_train_timesteps
from flowgrpo.trainer.algorithms.crd_loss import (
    CRD_OLD_DECAY,
    CRD_SAMPLING_DECAY,
    centred,
    crd_copy_decay,
    crd_loss,
    crd_policy_loss,
    crd_step_indices,
    implicit_reward,
    reward_weight,
    reward_weighted_kl,
)


def test_hand_check_of_design_section_11():
    r = reward_weight(torch.tensor([2.0, -1.0, 0.5, -1.5], dtype=torch.float64), 5.0)
    assert r.tolist() == pytest.approx([0.7, 0.4, 0.55, 0.35])
    r_theta = torch.tensor([0.01, -0.02, 0.0, 0.03], dtype=torch.float64)
    for group_index in (None, torch.tensor([0, 0, 0, 0])):  # one group: both centrings agree
        loss, big_r, q = crd_policy_loss(r_theta, r, crd_beta=1.0, group_index=group_index)
        assert float(loss) == pytest.approx(0.096625, abs=1e-12)
        assert big_r.tolist() == pytest.approx([0.2, -0.1, 0.05, -0.15])
        assert q.tolist() == pytest.approx([0.005, -0.025, -0.005, 0.025])


def numpy_implicit_reward(v, v_old, eps, x0, adaptive=True):
    out = []
    for i in range(v.shape[0]):
        e, e_old = v[i] - (eps[i] - x0[i]), v_old[i] - (eps[i] - x0[i])
        w = max(np.mean(np.abs(e)), 1e-5) if adaptive else 1.0
        w_old = max(np.mean(np.abs(e_old)), 1e-5) if adaptive else 1.0
        out.append(-np.mean(e**2 / w - e_old**2 / w_old))
    return np.array(out)


def data(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 2, 3, 3)
    x0, eps = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    v = (eps - x0 + 0.4 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    v_old = eps - x0 + 0.4 * torch.randn(shape, generator=g, dtype=torch.float64)
    v_ref = eps - x0 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.tensor([2.0, -1.0, 0.5, -1.5, 6.0, -0.3][:n], dtype=torch.float64)
    return x0, eps, v, v_old, v_ref, adv


@pytest.mark.parametrize("adaptive", [True, False])
def test_implicit_reward_matches_the_formula(adaptive):
    x0, eps, v, v_old, _, _ = data()
    r = implicit_reward(v, v_old, eps, x0, adaptive=adaptive)
    expected = numpy_implicit_reward(*(t.detach().numpy() for t in (v, v_old, eps, x0)), adaptive=adaptive)
    assert r.dtype == torch.float64 and np.allclose(r.detach().numpy(), expected, rtol=1e-12)
    bf = implicit_reward(v.detach().to(torch.bfloat16), v_old.to(torch.bfloat16), eps.to(torch.bfloat16),
                         x0.to(torch.bfloat16), adaptive=adaptive)
    assert bf.dtype in (torch.float32, torch.float64)  # never computed in the model's dtype


def numpy_policy(r_theta, rewards, groups, beta, loss_type, c=5.0):
    r_theta, rewards = np.asarray(r_theta, dtype=np.float64), np.asarray(rewards, dtype=np.float64)
    if groups is None:
        groups = [0] * len(rewards)
    big_r, q = np.zeros_like(rewards), np.zeros_like(r_theta)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        big_r[idx] = rewards[idx] - rewards[idx].mean()
        q[idx] = r_theta[idx] - r_theta[idx].mean()
    logits = beta * q
    if loss_type == "mse":
        raw = np.mean((logits - big_r) ** 2)
    else:
        target = 1 / (1 + np.exp(-big_r))
        p = 1 / (1 + np.exp(-logits))
        raw = np.mean(-(target * np.log(p) + (1 - target) * np.log(1 - p)))
    return raw * c / beta


@pytest.mark.parametrize("loss_type", ["mse", "bce"])
@pytest.mark.parametrize("centering", ["group", "batch"])
def test_policy_loss_and_gradient_match_an_independent_computation(loss_type, centering):
    x0, eps, v, v_old, _, adv = data()
    rewards = reward_weight(adv, 5.0)
    groups = [0, 0, 0, 1, 1, 1]
    group_index = torch.tensor(groups) if centering == "group" else None
    out = crd_loss(v, v_old, eps, x0, rewards, crd_beta=2.0, loss_type=loss_type, group_index=group_index)
    r_theta = numpy_implicit_reward(*(t.detach().numpy() for t in (v, v_old, eps, x0)))
    expected = numpy_policy(r_theta, rewards.numpy(), groups if centering == "group" else None, 2.0, loss_type)
    assert float(out.policy_loss.detach()) == pytest.approx(expected, rel=1e-10)
    # the two centrings really differ on two prompts
    other = numpy_policy(r_theta, rewards.numpy(), None if centering == "group" else groups, 2.0, loss_type)
    assert abs(other - expected) > 1e-6
    out.loss.backward()
    # central finite differences of the independent loss (the adaptive weights frozen, as sg requires)
    v0, v_old0, eps0, x00 = (t.detach().numpy() for t in (v, v_old, eps, x0))
    w = np.array([max(np.mean(np.abs(v0[i] - (eps0[i] - x00[i]))), 1e-5) for i in range(6)])

    def loss_at(vv):
        rt = []
        for i in range(6):
            e, e_old = vv[i] - (eps0[i] - x00[i]), v_old0[i] - (eps0[i] - x00[i])
            w_old = max(np.mean(np.abs(e_old)), 1e-5)
            rt.append(-np.mean(e**2 / w[i] - e_old**2 / w_old))
        # sg(mean r_theta): the centring mean is held at its value at v0
        rt = np.array(rt)
        base = np.array(r_theta)
        grp = groups if centering == "group" else [0] * 6
        q = rt.copy()
        for g in set(grp):
            idx = [i for i, x in enumerate(grp) if x == g]
            q[idx] = rt[idx] - base[idx].mean()
        big_r = rewards.numpy().copy()
        for g in set(grp):
            idx = [i for i, x in enumerate(grp) if x == g]
            big_r[idx] = big_r[idx] - rewards.numpy()[idx].mean()
        logits = 2.0 * q
        if loss_type == "mse":
            raw = np.mean((logits - big_r) ** 2)
        else:
            target = 1 / (1 + np.exp(-big_r))
            raw = np.mean(np.log1p(np.exp(logits)) - target * logits)
        return raw * 5.0 / 2.0

    rng = np.random.default_rng(0)
    for _ in range(5):
        idx = tuple(int(rng.integers(0, s)) for s in v0.shape)
        h = 1e-6
        plus, minus = v0.copy(), v0.copy()
        plus[idx] += h
        minus[idx] -= h
        numeric = (loss_at(plus) - loss_at(minus)) / (2 * h)
        assert float(v.grad[idx]) == pytest.approx(numeric, rel=1e-5, abs=1e-9)


def test_centring_uses_the_gathered_values_of_every_process():
    values = torch.tensor([1.0, 2.0])
    gathered = torch.tensor([1.0, 2.0, 3.0, 10.0])
    assert centred(values, gathered).tolist() == pytest.approx([-3.0, -2.0])
    groups, groups_all = torch.tensor([0, 1]), torch.tensor([0, 1, 0, 1])
    assert centred(values, gathered, groups, groups_all).tolist() == pytest.approx([-1.0, -4.0])
    with pytest.raises(ValueError, match="groups \\[2\\] of the local samples are missing"):
        centred(values, gathered, torch.tensor([0, 2]), groups_all)


def test_crd_loss_with_a_gather_equals_the_whole_micro_batch_on_one_process():
    x0, eps, v, v_old, v_ref, adv = data()
    rewards = reward_weight(adv, 5.0)
    groups = torch.tensor([7, 7, 9, 9, 7, 9])
    whole = crd_loss(v, v_old, eps, x0, rewards, group_index=groups, v_ref=v_ref, beta_kl=0.1)
    full_r_theta = whole.implicit_reward.detach()
    parts = [slice(0, 3), slice(3, 6)]
    for part in parts:
        def gather(t, part=part):
            if t.dtype == torch.long:
                return groups
            if torch.allclose(t, rewards[part].to(t.dtype)):
                return rewards.to(t.dtype)
            return full_r_theta
        local = crd_loss(v[part], v_old[part], eps[part], x0[part], rewards[part], group_index=groups[part],
                         gather=gather)
        assert torch.allclose(local.centred_reward, whole.centred_reward[part])
        assert torch.allclose(local.centred_implicit, whole.centred_implicit[part])


def test_reward_weighted_kl():
    x0, eps, v, _, v_ref, adv = data()
    r = reward_weight(adv, 5.0)
    loss, per_sample = reward_weighted_kl(v, v_ref, r, beta_kl=0.1)
    kl = ((v.detach() - v_ref) ** 2).mean(dim=(1, 2, 3))
    m = 1e-4 / 0.1
    assert torch.allclose(per_sample.detach(), kl)
    assert float(loss.detach()) == pytest.approx(float((0.1 * (m + r * (1 - m)) * kl).mean()), rel=1e-12)
    plain, _ = reward_weighted_kl(v, v_ref, r, beta_kl=0.1, reward_adaptive=False)
    assert float(plain.detach()) == pytest.approx(float(0.1 * kl.mean()), rel=1e-12)
    # the worst sample (r = 0) keeps only the floor, 1e-4 of its KL
    single, _ = reward_weighted_kl(v[:1], v_ref[:1], torch.zeros(1), beta_kl=0.1)
    assert float(single.detach()) == pytest.approx(1e-4 * float(kl[0]), rel=1e-10)


def test_stratified_draw_is_the_ports_and_awms_discrete_draw():
    sigmas = torch.linspace(1.0, 0.1, 10, dtype=torch.float64)
    for seed in range(20):
        idx = crd_step_indices(20, 10, 0.99, generator=torch.Generator().manual_seed(seed))
        levels = sample_train_timesteps("discrete", 20, 1, sigmas, 0.99, 3.0,
                                        generator=torch.Generator().manual_seed(seed))
        assert torch.allclose(sigmas[idx].float(), levels)
        assert int(idx.max()) <= 8 and int(idx.min()) >= 0  # index int(10 x 0.99) = 9 is never drawn
        bounds = np.linspace(0, 9, 21)
        assert all(math.floor(bounds[k]) <= int(idx[k]) <= max(math.floor(bounds[k]), math.floor(bounds[k + 1]) - 1)
                   for k in range(20))
    with pytest.raises(ValueError, match="leaves no step to train"):
        crd_step_indices(4, 10, 0.05)


def test_copy_schedules():
    assert crd_copy_decay(0, *CRD_OLD_DECAY) == 0.25
    assert crd_copy_decay(100, *CRD_OLD_DECAY) == pytest.approx(0.75)
    assert crd_copy_decay(10_000, *CRD_OLD_DECAY) == 0.999
    assert crd_copy_decay(74, *CRD_SAMPLING_DECAY) == 0.0  # a copy of the policy until step 75
    assert crd_copy_decay(75, *CRD_SAMPLING_DECAY) == 0.0
    assert crd_copy_decay(175, *CRD_SAMPLING_DECAY) == pytest.approx(0.75)
    assert crd_copy_decay(10_000, *CRD_SAMPLING_DECAY) == 0.999


def test_bad_inputs_are_refused():
    r = torch.zeros(2)
    with pytest.raises(ValueError, match="crd_beta=0"):
        crd_policy_loss(r, r, crd_beta=0.0)
    with pytest.raises(ValueError, match="loss_type='l1' is not valid"):
        crd_policy_loss(r, r, crd_beta=1.0, loss_type="l1")
