"""AWM's loss and timestep sampling (flowgrpo.trainer.algorithms.awm_loss), checked by hand on a 2-sample batch.

The trainer itself (resume, export, launch line) is exercised with the other trainers in tests/trainer/test_trainer.py.
"""

import math

import numpy as np
import pytest
import torch

from flowgrpo.trainer.algorithms.awm_config import AWMConfig
from flowgrpo.trainer.algorithms.awm_loss import awm_loss, elbo_std, ema_adapter_decay, sample_train_timesteps

T, B = 2, 2  # two noise levels, two samples: rows are level-major (k * B + b)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (T * B, 2, 3, 3)
    x0 = torch.randn(B, 2, 3, 3, generator=g, dtype=torch.float64)
    return dict(
        x0=torch.cat([x0] * T), noise=torch.randn(shape, generator=g, dtype=torch.float64),
        v=torch.randn(shape, generator=g, dtype=torch.float64), v_ref=torch.randn(shape, generator=g, dtype=torch.float64),
        v_ema=torch.randn(shape, generator=g, dtype=torch.float64),
        t=torch.tensor([0.8, 0.8, 0.3, 0.3], dtype=torch.float64), adv=torch.tensor([2.5, -7.0], dtype=torch.float64),
    )


def by_hand(d, old, weighting, loss_type, clip, beta, ema_beta, kl_weight, power=0.25, c=5.0, amax=1.0):
    """The formulas of DESIGN section 7, written out per (level, sample) in numpy float64."""
    v, eps, x0, t = (d[k].numpy() for k in ("v", "noise", "x0", "t"))
    logp = np.zeros((T, B))
    for k in range(T):
        for b in range(B):
            row = k * B + b
            e = np.mean((v[row] - (eps[row] - x0[row])) ** 2)
            logp[k, b] = {"Uniform": -e, "t": -e * t[row], "ghuber": -((e + 1e-10) ** power - 1e-10 ** power)
                          * t[row] / power}[weighting]
    adv = np.clip(d["adv"].numpy(), -c, c) / c * amax
    if loss_type == "exp_first":
        r = np.exp(logp - old)
        terms = [max(-adv[b] * r[k, b], -adv[b] * np.clip(r[k, b], 1 - clip, 1 + clip)) for k in range(T)
                 for b in range(B)]
    else:
        r = np.exp(logp.mean(0) - old.mean(0))
        terms = [max(-adv[b] * r[b], -adv[b] * np.clip(r[b], 1 - clip, 1 + clip)) for b in range(B)]
    loss = np.mean(terms)

    def kl(other, weight):
        vals = []
        for row in range(T * B):
            m = np.mean((v[row] - other[row]) ** 2)
            if weight == "ELBO":
                std = 0.7 * math.sqrt(t[row] / (1 - min(t[row], 0.99)))
                m = m / (2 * std**2)
            vals.append(m)
        return np.mean(vals)

    if beta > 0:
        loss += beta * kl(d["v_ref"].numpy(), kl_weight)
        if ema_beta > 0:
            loss += ema_beta * kl(d["v_ema"].numpy(), "Uniform")
    return loss, logp


@pytest.mark.parametrize("weighting, loss_type, kl_weight", [("ghuber", "exp_first", "Uniform"),
                                                             ("t", "sum_first", "ELBO"),
                                                             ("Uniform", "exp_first", "ELBO")])
def test_loss_matches_the_formulas_on_and_off_policy(weighting, loss_type, kl_weight):
    d = batch()
    common = dict(train_timesteps=T, weighting=weighting, loss_type=loss_type, clip_range=0.2, adv_clip_max=5.0,
                  advantage_max=1.0, v_ref=d["v_ref"], beta=0.01, kl_weight=kl_weight, v_ema=d["v_ema"], ema_beta=0.5,
                  kl_ema_weight="Uniform")
    # on-policy: old = current (the ratio is exactly 1)
    out = awm_loss(d["v"], d["noise"], d["x0"], d["t"], d["adv"], None, **common)
    _, logp = by_hand(d, np.zeros((T, B)), weighting, loss_type, 0.2, 0.01, 0.5, kl_weight)
    expected, _ = by_hand(d, logp, weighting, loss_type, 0.2, 0.01, 0.5, kl_weight)
    assert torch.all(out.ratio == 1)
    assert float(out.loss) == pytest.approx(expected, rel=1e-12)
    # off-policy: old log-probs shifted so that one ratio of each sample is clipped
    old = torch.from_numpy(logp) + torch.tensor([[0.5, -0.5], [0.01, -0.01]], dtype=torch.float64)
    out = awm_loss(d["v"], d["noise"], d["x0"], d["t"], d["adv"], old, **common)
    expected, _ = by_hand(d, old.numpy(), weighting, loss_type, 0.2, 0.01, 0.5, kl_weight)
    assert float(out.loss) == pytest.approx(expected, rel=1e-12)


def test_gardo_gate_keeps_the_kl_of_the_gated_samples_only():
    """regularizer: gardo: the KL term is the mean over the gated samples' rows (level-major T * B), 0 with none."""
    d = batch()
    common = dict(train_timesteps=T, weighting="Uniform", loss_type="exp_first", clip_range=0.2, adv_clip_max=5.0,
                  advantage_max=1.0, v_ref=d["v_ref"], beta=0.01, kl_weight="ELBO")
    per_row = ((d["v"] - d["v_ref"]) ** 2).mean(dim=(1, 2, 3)) / (2 * elbo_std(d["t"]) ** 2)
    for gate, expected in ((torch.tensor([True, False]), per_row.view(T, B)[:, 0].mean()),
                           (torch.tensor([False, True]), per_row.view(T, B)[:, 1].mean()),
                           (torch.tensor([False, False]), torch.tensor(0.0, dtype=torch.float64)),
                           (None, per_row.mean())):
        out = awm_loss(d["v"], d["noise"], d["x0"], d["t"], d["adv"], None, kl_gate=gate, **common)
        assert float(out.kl) == pytest.approx(float(expected), rel=1e-12, abs=1e-15)
        ungated = awm_loss(d["v"], d["noise"], d["x0"], d["t"], d["adv"], None, **common)
        assert float(out.loss - out.kl * 0.01) == pytest.approx(float(ungated.loss - ungated.kl * 0.01), rel=1e-12)


def test_gradient_on_policy_is_the_advantage_weighted_flow_matching_gradient():
    """Uniform weighting, exp_first, on-policy: d loss / d v_kb = (2 / (N T B)) (A_b (v - v*) + beta (v - v_ref))
    with A scaled by advantage_max / adv_clip_max, v* = eps - x0 and N elements per sample."""
    d = batch(1)
    v = d["v"].clone().requires_grad_(True)
    out = awm_loss(v, d["noise"], d["x0"], d["t"], d["adv"], None, train_timesteps=T, weighting="Uniform",
                   loss_type="exp_first", clip_range=1.0, adv_clip_max=5.0, advantage_max=1.0, v_ref=d["v_ref"],
                   beta=0.1, kl_weight="Uniform")
    out.loss.backward()
    n = v[0].numel()
    adv = (d["adv"].clamp(-5, 5) / 5).repeat(T).view(-1, 1, 1, 1)
    target = d["noise"] - d["x0"]
    expected = 2 / (n * T * B) * (adv * (d["v"] - target) + 0.1 * (d["v"] - d["v_ref"]))
    torch.testing.assert_close(v.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["exp_first", "sum_first"])
def test_gradient_with_ghuber_and_clipping_matches_finite_differences_of_the_formulas(loss_type):
    d = batch(2)
    _, logp = by_hand(d, np.zeros((T, B)), "ghuber", loss_type, 0.2, 0.0, 0.0, "Uniform")
    old = logp + np.array([[0.3, -0.02], [0.01, 0.4]])
    v = d["v"].clone().requires_grad_(True)
    out = awm_loss(v, d["noise"], d["x0"], d["t"], d["adv"], torch.from_numpy(old), train_timesteps=T,
                   weighting="ghuber", loss_type=loss_type, clip_range=0.2, adv_clip_max=5.0, advantage_max=1.0)
    out.loss.backward()
    eps = 1e-6
    flat = d["v"].reshape(-1)
    for i in range(0, flat.numel(), 7):
        for sign in (1, -1):
            bumped = dict(d)
            w = flat.clone()
            w[i] += sign * eps
            bumped["v"] = w.reshape(d["v"].shape)
            value, _ = by_hand(bumped, old, "ghuber", loss_type, 0.2, 0.0, 0.0, "Uniform")
            if sign == 1:
                plus = value
            else:
                minus = value
        assert v.grad.reshape(-1)[i].item() == pytest.approx((plus - minus) / (2 * eps), rel=1e-5, abs=1e-9), i


def test_timestep_sampling_follows_the_official_bins():
    sigmas = torch.linspace(1.0, 0.1, 14)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        t = sample_train_timesteps("discrete_wo_init", 6, 3, sigmas, 0.9, 3.0, g)
        assert t.shape == (18,)
        levels = t.view(6, 3)
        assert torch.all(levels == levels[:, :1])  # the micro-batch shares its levels
        bounds = torch.linspace(1, int(14 * 0.9), 7).long()
        index = [int((sigmas - lv).abs().argmin()) for lv in levels[:, 0]]
        for k, i in enumerate(index):
            assert bounds[k] <= i < max(bounds[k + 1], bounds[k] + 1), (k, i)
        t = sample_train_timesteps("discrete_with_init", 3, 2, sigmas, 0.9, 3.0, g)
        assert torch.all(t[:2] == 1.0)  # the first level is the rollout's first
    shift = lambda x: 3 * x / (1 + 2 * x)  # noqa: E731
    t = sample_train_timesteps("uniform", 4, 5, sigmas, 0.9, 3.0, g).view(4, 5)
    for b in range(5):  # each sample holds one level from each of the 4 strata of [0.2, 1], shifted
        edges = [shift(0.2 + 0.8 * k / 4) for k in range(5)]
        got = sorted(t[:, b].tolist())
        assert all(edges[k] <= got[k] <= edges[k + 1] for k in range(4))
    t = sample_train_timesteps("logit_normal", 6, 2, sigmas, 0.9, 3.0, g)
    assert torch.all(t >= 0.01) and torch.all(t < 1) and torch.all(t.view(6, 2) == t.view(6, 2)[:, :1])


def test_ema_adapter_decay_and_config_checks(tmp_path):
    assert ema_adapter_decay(1, 0.3, "linear") == pytest.approx(0.001)
    assert ema_adapter_decay(1000, 0.3, "linear") == 0.3 and ema_adapter_decay(5, 0.3, "constant") == 0.3
    with pytest.raises(ValueError, match="time_type='cosine'"):
        AWMConfig(output_dir=str(tmp_path), report_to=[], time_type="cosine")
    with pytest.raises(ValueError, match="loss_type='mean_first'"):
        AWMConfig(output_dir=str(tmp_path), report_to=[], loss_type="mean_first")
    with pytest.raises(ValueError, match="empty range"):
        AWMConfig(output_dir=str(tmp_path), report_to=[], num_inference_steps=2, timestep_fraction=0.4)
    args = AWMConfig(output_dir=str(tmp_path), report_to=[])
    assert (args.train_timesteps, args.time_type, args.weighting, args.loss_type, args.clip_range, args.beta,
            args.scale_rewards) == (6, "discrete_wo_init", "ghuber", "exp_first", 1.0, 0.001, "batch")
    # rollout steps and guidance: the model's own (CFG-free for AWM), resolved by the trainer; the paper's 14 steps on
    # SD3.5-M are recipes/awm_geneval.yaml's
    assert (args.num_inference_steps, args.guidance_scale) == (None, None) and args._cfg_free_rollouts
    assert args.uses_ema_adapter and not AWMConfig(output_dir=str(tmp_path), report_to=[], beta=0).uses_ema_adapter
