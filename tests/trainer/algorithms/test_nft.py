"""DiffusionNFT: the loss's math, the old policy's weights and schedule, the configuration.

The trainer itself (rollouts, resume, export) is tested in tests/trainer/algorithms/test_nft_trainer.py on the tiny pipelines.
"""

import dataclasses

import pytest
import torch

from flowgrpo.trainer.algorithms.nft_config import FLOW_GRPO_ONLY_SETTINGS, DiffusionNFTConfig
from flowgrpo.trainer.algorithms.nft_loss import implicit_policies, nft_loss, noised_sample, reward_weight
from flowgrpo.trainer.policy.old_policy import AdapterOldPolicy, FrozenCopyOldPolicy, old_policy_decay

B, N = 4, 6  # samples, elements per sample


def tiny_problem(seed=0):
    """A linear velocity model v = x_t W^T (float64) on a micro-batch at per-sample noise levels."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, N, generator=gen, dtype=torch.float64)
    eps = torch.randn(B, N, generator=gen, dtype=torch.float64)
    sigma = torch.tensor([0.9, 0.6, 0.35, 0.1], dtype=torch.float64)
    x_t = noised_sample(x0, eps, sigma)
    weight = torch.nn.Parameter(0.3 * torch.randn(N, N, generator=gen, dtype=torch.float64))
    return x0, eps, sigma, x_t, weight


@pytest.mark.parametrize("nft_beta", [1.0, 0.1])
def test_old_equals_current_gives_v_theta_and_the_hand_computed_gradient(nft_beta):
    x0, eps, sigma, x_t, weight = tiny_problem()
    advantages = torch.tensor([5.0, -2.0, 0.0, -7.0], dtype=torch.float64)
    r = reward_weight(advantages, 5.0)
    torch.testing.assert_close(r, torch.tensor([1.0, 0.3, 0.5, 0.0], dtype=torch.float64))
    ref_weight = weight.detach() + 0.05
    v = x_t @ weight.T
    v_old = x_t @ weight.detach().T           # the old policy equals the current one
    v_ref = x_t @ ref_weight.T
    v_pos, v_neg = implicit_policies(v, v_old, nft_beta)
    torch.testing.assert_close(v_pos, v, rtol=0, atol=1e-14)
    torch.testing.assert_close(v_neg, v, rtol=0, atol=1e-14)

    beta = 0.3
    out = nft_loss(v, v_old, x0, x_t, sigma, r, nft_beta, adv_clip_max=5.0, v_ref=v_ref, beta=beta)
    torch.testing.assert_close(out.positive_loss, out.negative_loss)  # x0+ = x0- = x_t - sigma v
    (grad,) = torch.autograd.grad(out.loss, weight)

    # by hand: dloss/dv[b] = 2 C s_b^2 (2 r_b - 1)(v_b - v*_b) / (w_b N B) + 2 beta (v_b - v_ref_b) / (N B),
    # with v* = eps - x0 and w_b = mean|s_b (v*_b - v_b)|; dloss/dW = sum_b dloss/dv[b]^T x_t[b]
    with torch.no_grad():
        s = sigma[:, None]
        target = eps - x0
        w = (s * (target - v)).abs().mean(dim=1, keepdim=True)
        dv = 2 * 5.0 * s**2 * (2 * r[:, None] - 1) * (v - target) / (w * N * B)
        dv += 2 * beta * (v - v_ref) / (N * B)
        expected = dv.T @ x_t
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    # an average sample (r = 1/2) contributes nothing to the policy gradient
    assert dv[2].abs().max() < 2 * beta * (v - v_ref)[2].abs().max() / (N * B) + 1e-15


def test_gradient_with_a_different_old_policy_and_the_weight_floor():
    x0, eps, sigma, x_t, weight = tiny_problem(1)
    r = torch.tensor([0.9, 0.2, 0.5, 0.7], dtype=torch.float64)
    nft_beta, c = 0.4, 3.0
    v = x_t @ weight.T
    v_old = x_t @ (weight.detach() * 0.8).T
    # on sample 3, v- = (x_t - x0) / sigma, so that x0- = x0 and w- would be 0: the floor 1e-5 applies
    v_old[3] = ((x_t[3] - x0[3]) / sigma[3] + nft_beta * v[3].detach()) / (1 + nft_beta)
    out = nft_loss(v, v_old, x0, x_t, sigma, r, nft_beta, adv_clip_max=c)
    assert out.kl is None
    (grad,) = torch.autograd.grad(out.loss, weight)
    with torch.no_grad():
        s = sigma[:, None]
        err_pos = x_t - s * (nft_beta * v + (1 - nft_beta) * v_old) - x0
        err_neg = x_t - s * ((1 + nft_beta) * v_old - nft_beta * v) - x0
        w_pos = err_pos.abs().mean(1, keepdim=True).clamp(min=1e-5)
        w_neg = err_neg.abs().mean(1, keepdim=True).clamp(min=1e-5)
        assert w_neg[3].item() == 1e-5
        rr = r[:, None]
        dv = 2 * c * s * (-rr * err_pos / w_pos + (1 - rr) * err_neg / w_neg) / (N * B)
        expected = dv.T @ x_t
        loss = (c * (rr * err_pos.square().mean(1, keepdim=True) / w_pos
                     + (1 - rr) * err_neg.square().mean(1, keepdim=True) / w_neg) / nft_beta).mean()
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


def test_loss_is_float32_for_half_precision_inputs():
    x0, eps, sigma, x_t, weight = tiny_problem()
    v = (x_t @ weight.detach().T).bfloat16().requires_grad_(True)
    out = nft_loss(v, v.detach(), x0.bfloat16(), x_t.bfloat16(), sigma, torch.full((B,), 0.5), 1.0)
    assert out.loss.dtype == torch.float32 and out.positive_loss.dtype == torch.float32
    with pytest.raises(ValueError, match="nft_beta=0"):
        nft_loss(v, v, x0, x_t, sigma, torch.ones(B), 0.0)


def test_old_policy_decay_schedule():
    assert [old_policy_decay(k, 0, 0.001, 0.5) for k in (0, 1, 10, 499, 500, 501, 10_000)] == pytest.approx(
        [0.0, 0.001, 0.01, 0.499, 0.5, 0.5, 0.5])
    ocr = [old_policy_decay(k, 75, 0.0075, 0.999) for k in (0, 74, 75, 76, 100, 208, 209, 1000)]
    assert ocr == pytest.approx([0.0, 0.0, 0.0, 0.0075, 0.1875, 0.9975, 0.999, 0.999])


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(5, 7)
        self.second = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def test_adapter_old_policy_copies_switches_and_decays():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(TwoLayers(), LoraConfig(r=2, lora_alpha=4, target_modules=["first", "second"],
                                                   init_lora_weights="gaussian"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    old = AdapterOldPolicy(model)
    assert [p for p in model.parameters() if p.requires_grad] == trainable  # the old adapter is frozen
    assert len(old.pairs) == len(trainable) == 4
    x = torch.randn(3, 5)
    with torch.no_grad():
        for theta, _ in old.pairs:          # move the trained adapter away from the identity
            theta.add_(0.5 * torch.randn_like(theta))
        current = model(x)
        with old.forward_model(model) as m:
            before = m(x)                   # the old adapter is still the initial (identity) LoRA
        with model.disable_adapter():
            base = model(x)
    torch.testing.assert_close(before, base)
    assert (current - before).abs().max() > 1e-3
    assert [p for p in model.parameters() if p.requires_grad] == trainable  # flags restored after the block
    assert model.base_model.model.first.active_adapters == ["default"]

    snapshot = [(theta.detach().clone(), o.detach().clone()) for theta, o in old.pairs]
    old.update(0.25)
    for (theta, o), (t0, o0) in zip(old.pairs, snapshot):
        torch.testing.assert_close(o, 0.25 * o0 + 0.75 * t0)
        torch.testing.assert_close(theta, t0)
    old.update(0.0)
    with torch.no_grad(), old.forward_model(model) as m:
        torch.testing.assert_close(m(x), model(x))
    # gradients reach the trained adapter only
    model(x).square().sum().backward()
    assert all(theta.grad is not None for theta, _ in old.pairs)
    assert all(o.grad is None for _, o in old.pairs)


def test_frozen_copy_old_policy_decays_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = TwoLayers()
    old = FrozenCopyOldPolicy(model)
    assert not any(p.requires_grad for p in old.module.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    snapshot = [(t.detach().clone(), o.detach().clone()) for t, o in old.pairs]
    old.update(0.9)
    for (_, o), (t0, o0) in zip(old.pairs, snapshot):
        torch.testing.assert_close(o, 0.9 * o0 + 0.1 * t0)
    old.save(tmp_path)
    other = FrozenCopyOldPolicy(TwoLayers())
    other.load(tmp_path)
    for (_, a), (_, b) in zip(old.pairs, other.pairs):
        torch.testing.assert_close(a, b)
    with pytest.raises(FileNotFoundError, match="old_policy.safetensors"):
        other.load(tmp_path / "missing")


def nft_args(tmp_path, **kwargs):
    return DiffusionNFTConfig(output_dir=str(tmp_path), report_to=[], **kwargs)


def test_config_defaults_and_checks(tmp_path):
    args = nft_args(tmp_path)
    assert (args.sampler, args.adv_clip_max, args.timestep_fraction, args.nft_beta, args.beta,
            args.old_policy_decay_start, args.old_policy_decay_rate,
            args.old_policy_decay_max) == ("dpmpp_2m", 5, 0.99, 1.0, 1e-4, 0, 0.001, 0.5)
    # steps and guidance are the model's own until the trainer resolves them (CFG-free: the algorithm's)
    assert (args.guidance_scale, args.num_inference_steps, args.num_trained_timesteps) == (None, None, None)
    assert args._cfg_free_rollouts
    args = nft_args(tmp_path, num_inference_steps=10)
    assert args.num_trained_timesteps == 9 and args.eval_guidance_scale is None
    field_names = {f.name for f in dataclasses.fields(DiffusionNFTConfig)}
    assert not field_names & set(FLOW_GRPO_ONLY_SETTINGS)
    for bad, match in [(dict(sampler="sde"), "sampler='sde'"), (dict(nft_beta=0.0), "nft_beta=0.0"),
                       (dict(timestep_fraction=0.05, num_inference_steps=10), "trains int"), (dict(timestep_fraction=1.5), r"\(0, 1\]"),
                       (dict(old_policy_decay_max=1.0), r"\[0, 1\)"), (dict(old_policy_decay_start=-1), ">= 0"),
                       (dict(old_policy_decay_rate=-0.1), ">= 0"), (dict(num_generations=1), "num_generations")]:
        with pytest.raises(ValueError, match=match):
            nft_args(tmp_path, **bad)
    with pytest.raises(TypeError, match="noise_level: DiffusionNFT samples deterministically"):
        nft_args(tmp_path, noise_level=0.7)
    with pytest.raises(TypeError, match="same_noise_per_group"):
        nft_args(tmp_path, same_noise_per_group=True, epsilon=1e-3)


# ---- the launch script: the trainer key, --help, settings of the other trainer ------------------------------------

def test_recipes_pick_the_trainer_and_help_lists_the_nft_fields(monkeypatch):
    from pathlib import Path

    from flowgrpo.cli import RecipeError, parse_recipe
    from flowgrpo.cli.parser import build_parser

    monkeypatch.chdir(Path(__file__).resolve().parents[3])
    script, model, args = parse_recipe(["recipes/nft_ocr.yaml", "--use_cpu", "true"])
    assert script.trainer == "diffusion_nft" and isinstance(args, DiffusionNFTConfig)
    assert model.model_name_or_path == "stabilityai/stable-diffusion-3.5-medium"
    assert (args.nft_beta, args.old_policy_decay_start, args.old_policy_decay_rate, args.old_policy_decay_max) == (
        0.1, 75, 0.0075, 0.999)
    assert (args.sampler, args.guidance_scale, args.num_inference_steps, args.beta) == ("dpmpp_2m", 1.0, 10, 1e-4)
    _, _, args = parse_recipe(["recipes/nft_geneval.yaml", "--use_cpu", "true"])
    assert (args.nft_beta, args.old_policy_decay_rate, args.old_policy_decay_max) == (1.0, 0.001, 0.5)
    script, _, args = parse_recipe(["recipes/nft_geneval.yaml", "--use_cpu", "true", "--trainer=diffusion_nft",
                                    "--nft_beta", "0.3"])
    assert script.trainer == "diffusion_nft" and args.nft_beta == 0.3
    # settings of the other trainer are named as such, with the fix
    with pytest.raises(RecipeError, match="'--noise_level': a Flow-GRPO setting that DiffusionNFT does not use"):
        parse_recipe(["recipes/nft_ocr.yaml", "--use_cpu", "true", "--noise_level", "0.7"])
    with pytest.raises(RecipeError, match="'nft_beta': a DiffusionNFT setting: add trainer: diffusion_nft"):
        parse_recipe(["recipes/ocr.yaml", "--use_cpu", "true"], overrides={"nft_beta": 0.1})
    with pytest.raises(RecipeError, match="trainer='nft' is not a trainer"):
        parse_recipe(["recipes/ocr.yaml", "--trainer", "nft"])
    plain, nft = build_parser().format_help(), build_parser("diffusion_nft").format_help()
    for name in ("sampler", "timestep_fraction", "nft_beta", "old_policy_decay_start", "old_policy_decay_rate",
                 "old_policy_decay_max"):
        assert f"--{name}" in plain and f"--{name} " in nft.replace("\n", " ")
    assert "--noise_level" in plain and "--noise_level " not in nft and "--trainer" in plain
