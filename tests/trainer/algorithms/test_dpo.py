"""Diffusion-DPO's loss (flowgrpo.trainer.algorithms.dpo_loss) by hand on a 2-pair batch, the online pairing, the
offline pairs' checks, and the toy world's pair writer.

The trainer itself (resume, export, launch line) is exercised with the other trainers in tests/trainer/test_trainer.py.
"""

import math

import pytest
import torch

from flowgrpo import DiffusionDPOConfig
from flowgrpo.schedulers.flow_matching import flow_matching_error
from flowgrpo.trainer.algorithms.dpo_loss import dpo_loss
from flowgrpo.trainer.algorithms.dpo_trainer import DiffusionDPOTrainer, best_and_worst


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_loss_and_gradient_by_hand_on_two_pairs():
    """Two pairs, each a preferred and a rejected sample at one shared noise level: the velocities are the leaves."""
    g = torch.Generator().manual_seed(0)
    shape = (4, 2, 3, 3)  # rows: winner 0, winner 1, loser 0, loser 1
    x0 = torch.randn(shape, generator=g, dtype=torch.float64)
    eps = torch.randn(shape, generator=g, dtype=torch.float64)
    eps[2:] = eps[:2]  # a pair shares its noise
    v = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    v_ref = torch.randn(shape, generator=g, dtype=torch.float64)
    beta = 0.8
    e = flow_matching_error(v, eps, x0, dtype=torch.float64)
    e_ref = flow_matching_error(v_ref, eps, x0, dtype=torch.float64)
    out = dpo_loss(e[:2], e[2:], e_ref[:2], e_ref[2:], beta)
    out.loss.backward()

    n = x0[0].numel()
    target = (eps - x0).detach()
    err = [float(((v[i].detach() - target[i]) ** 2).mean()) for i in range(4)]
    err_ref = [float(((v_ref[i] - target[i]) ** 2).mean()) for i in range(4)]
    inside = [-beta / 2 * ((err[p] - err_ref[p]) - (err[p + 2] - err_ref[p + 2])) for p in range(2)]
    expected = sum(-math.log(sigmoid(z)) for z in inside) / 2
    assert float(out.loss) == pytest.approx(expected, rel=1e-12)
    assert torch.allclose(out.inside, torch.tensor(inside, dtype=torch.float64), rtol=1e-12)
    assert float(out.accuracy) == sum(z > 0 for z in inside) / 2
    # d L / d e_w(p) = beta / 2 sigmoid(-inside_p) / P; d e / d v = 2 (v - v*) / n; the loser's sign is opposite.
    for row in range(4):
        p, sign = row % 2, (1 if row < 2 else -1)
        coeff = sign * beta / 2 * sigmoid(-inside[p]) / 2 * 2 / n
        torch.testing.assert_close(v.grad[row], coeff * (v[row] - target[row]).detach(), rtol=1e-10, atol=1e-14)


def test_at_the_reference_the_loss_is_log_2_and_the_pull_is_beta_over_4p():
    e_w = torch.tensor([0.7, 1.3], requires_grad=True)
    e_l = torch.tensor([0.9, 0.2], requires_grad=True)
    out = dpo_loss(e_w, e_l, e_w.detach(), e_l.detach(), 1000.0)
    assert float(out.loss) == pytest.approx(math.log(2))
    out.loss.backward()
    torch.testing.assert_close(e_w.grad, torch.full((2,), 1000.0 / 8))
    torch.testing.assert_close(e_l.grad, torch.full((2,), -1000.0 / 8))


def test_diagnostics_mean_abs_inside_and_gradient_weight_by_hand():
    """Four pairs whose logits cancel in the signed mean: |inside| and sigmoid(-inside) show the saturation."""
    beta = 100.0
    # model - reference differences (w minus l) chosen so that inside = -beta / 2 * diff = [8, -8, 0.5, -0.5]
    diff = torch.tensor([-0.16, 0.16, -0.01, 0.01], dtype=torch.float64)
    zeros = torch.zeros(4, dtype=torch.float64)
    out = dpo_loss(diff, zeros, zeros, zeros, beta)
    assert out.inside.tolist() == pytest.approx([8.0, -8.0, 0.5, -0.5], rel=1e-12)
    assert float(out.inside.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(out.abs_inside) == pytest.approx((8 + 8 + 0.5 + 0.5) / 4)
    weights = [sigmoid(-8.0), sigmoid(8.0), sigmoid(-0.5), sigmoid(0.5)]  # 0.000335, 0.999665, 0.3775, 0.6225
    assert float(out.gradient_weight) == pytest.approx(sum(weights) / 4, rel=1e-12)
    assert float(out.gradient_weight) == pytest.approx(0.5, rel=1e-12)  # symmetric logits: the mean is 1/2 ...
    assert max(weights) - min(weights) > 0.999  # ... though the pairs' weights have collapsed to 0 and 1
    metrics = out.metrics()
    assert set(metrics) == {"dpo/accuracy", "dpo/inside", "dpo/abs_inside", "dpo/gradient_weight"}
    assert metrics["dpo/accuracy"] == 0.5 and metrics["dpo/abs_inside"] == pytest.approx(4.25)
    assert all(isinstance(v, float) for v in metrics.values())
    # at the reference: every weight is 1/2 and |inside| is 0
    start = dpo_loss(zeros, zeros, zeros, zeros, beta)
    assert float(start.abs_inside) == 0.0 and float(start.gradient_weight) == 0.5
    # the gradient weight is the derivative of the loss with respect to inside (per pair, times P)
    inside = torch.tensor([8.0, -8.0, 0.5, -0.5], dtype=torch.float64, requires_grad=True)
    torch.nn.functional.logsigmoid(inside).neg().sum().backward()
    torch.testing.assert_close(-inside.grad, torch.tensor(weights, dtype=torch.float64))


def test_several_noise_draws_average_the_draws_losses():
    """K draws per pair: dpo_loss on the stacked draws is the mean of each draw's loss, and its gradient the mean of
    theirs (what K accumulated backward passes of loss / K give)."""
    g = torch.Generator().manual_seed(1)
    draws = [tuple(torch.rand(3, generator=g, dtype=torch.float64) for _ in range(4)) for _ in range(5)]
    stacked = dpo_loss(*(torch.cat([d[i] for d in draws]) for i in range(4)), 100.0)
    each = [dpo_loss(*d, 100.0) for d in draws]
    assert float(stacked.loss) == pytest.approx(sum(float(o.loss) for o in each) / 5, rel=1e-12)
    assert float(stacked.gradient_weight) == pytest.approx(sum(float(o.gradient_weight) for o in each) / 5)


def test_online_pairs_are_each_groups_best_and_worst():
    groups = torch.tensor([7, 7, 7, 3, 3, 3, 5, 5])
    adv = torch.tensor([0.1, 0.9, -1.0, 0.5, 0.5, 0.5, -0.2, 0.4])
    best, worst = best_and_worst(groups, adv)
    assert (best, worst) == ([1, 7], [2, 6])  # group 3 scores the same everywhere: no pair


def test_offline_mode_needs_chosen_and_rejected_columns(tmp_path):
    from datasets import Dataset

    args = DiffusionDPOConfig(output_dir=str(tmp_path), report_to=[], dpo_mode="offline", per_device_train_batch_size=3)
    assert args.generation_batch_size == 3  # offline, the group size does not constrain the batch
    with pytest.raises(ValueError, match="'chosen' and 'rejected' image columns"):
        DiffusionDPOTrainer(model="/nonexistent", reward_funcs=lambda p, i, **k: [0.0] * len(i), args=args,
                            train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["x.png"]}))
    with pytest.raises(ValueError, match="multiple of num_generations"):
        DiffusionDPOConfig(output_dir=str(tmp_path), report_to=[], dpo_mode="online", num_generations=4,
                           per_device_train_batch_size=2, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="dpo_mode='both'"):
        DiffusionDPOConfig(output_dir=str(tmp_path), report_to=[], dpo_mode="both")
    with pytest.raises(ValueError, match="Diffusion-DPO's loss has none"):  # no KL penalty for GARDO to gate
        DiffusionDPOConfig(output_dir=str(tmp_path), report_to=[], regularizer="gardo", beta=0.01,
                           gardo_auxiliary_rewards=["aux"])
