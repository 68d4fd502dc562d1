"""Health diagnostics, alarms and guards on crafted batches and trajectories (no pipeline: fast)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.trainer.algorithms.flow_grpo_loss import gated_mean
from flowgrpo.trainer.health import metrics as hm
from flowgrpo.trainer.health.alarms import DiversityAlarm, HackingAlarm
from flowgrpo.trainer.health.dynamic_sampling import (
    concat_records,
    fresh_prompt_indices,
    groups_without_signal,
    select_rows,
    split_rows,
)
from flowgrpo.trainer.health.gardo import (
    GateFraction,
    ReferenceResetSchedule,
    descending_ranks,
    diversity_aware_advantages,
    reward_uncertainty,
    uncertainty_gate,
)
from flowgrpo.trainer.health.monitor import HealthMonitor, clip_feature_source


def _flat(value: int, size: int = 16) -> Image.Image:
    return Image.fromarray(np.full((size, size, 3), value, dtype=np.uint8))


# ---- metrics -------------------------------------------------------------------------------------------------
def test_grey_diversity_is_rms_pixel_distance_within_groups():
    images = [_flat(0), _flat(0), _flat(0), _flat(255)]
    feats = hm.grey_features(images)
    assert feats.shape == (4, 32 * 32)
    # group 0: two identical images (0); group 1: black and white, RMS difference 1.
    assert hm.within_group_diversity(feats, torch.tensor([0, 0, 1, 1])) == pytest.approx(0.5)
    # three images, one white: pairwise distances 0, 1, 1 -> mean 2/3.
    assert hm.within_group_diversity(feats[1:], torch.tensor([5, 5, 5])) == pytest.approx(2 / 3)
    assert math.isnan(hm.within_group_diversity(feats[:2], torch.tensor([0, 1])))


def test_zero_std_groups_and_correlations():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, math.nan, 0.3, 0.3])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3])
    assert hm.zero_std_group_fraction(rewards, groups) == pytest.approx(3 / 4)  # groups 0, 1 and 3 (NaN left out)
    corr = hm.reward_correlations({"a": torch.tensor([1.0, 2, 3, math.nan]), "b": torch.tensor([2.0, 4, 6, 1]),
                                   "c": torch.tensor([3.0, 2, 1, 0])})
    assert corr["a__b"] == pytest.approx(1.0)
    assert corr["a__c"] == pytest.approx(-1.0)
    assert corr["b__c"] == pytest.approx(float(np.corrcoef([2, 4, 6, 1], [3, 2, 1, 0])[0, 1]))
    assert math.isnan(hm.reward_correlations({"x": torch.ones(3), "y": torch.arange(3.0)})["x__y"])


def test_kl_between_transitions():
    mean = torch.zeros(2, 3)
    assert hm.kl_between_transitions(mean + 1, mean, torch.tensor([1.0, 2.0])) == pytest.approx((0.5 + 0.125) / 2)


def test_lora_update_ratio_matches_explicit_weights():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4))
    model = get_peft_model(net, LoraConfig(r=2, lora_alpha=4, target_modules=["0", "1"]))
    assert hm.lora_update_ratio(model) == 0.0  # B starts at zero
    update_sq = base_sq = 0.0
    for layer in (model.base_model.model[0], model.base_model.model[1]):
        layer.lora_B["default"].weight.data.normal_()
        delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        update_sq += float(delta.detach().double().pow(2).sum())
        base_sq += float(layer.base_layer.weight.double().pow(2).sum())
    cache: dict = {}
    assert hm.lora_update_ratio(model, base_norms=cache) == pytest.approx(math.sqrt(update_sq / base_sq))
    assert len(cache) == 2 and hm.lora_update_ratio(model, base_norms=cache) == pytest.approx(
        math.sqrt(update_sq / base_sq))
    theta0 = [torch.ones(3)]
    assert hm.weight_update_ratio([torch.full((3,), 1.5)], theta0) == pytest.approx(0.5)


# ---- alarms --------------------------------------------------------------------------------------------------
def _run_alarm(train: list[float], evals: dict[int, float], tolerance: float = 0.05) -> list[int]:
    alarm = HackingAlarm(tolerance)
    fired = []
    if 0 in evals:
        alarm.update(0, {"gold": evals[0]})
    for step, reward in enumerate(train, start=1):
        alarm.observe_train_reward(step, reward)
        if step in evals and alarm.update(step, {"gold": evals[step]}).fired:
            fired.append(step)
    return fired


def test_hacking_alarm_fires_when_train_rises_and_gold_falls():
    train = [0.1 * k for k in range(1, 31)]                      # training reward keeps rising
    fired = _run_alarm(train, {0: 0.5, 10: 0.6, 20: 0.58, 30: 0.4})
    assert fired == [30]                                         # 0.6 -> 0.58 is within tolerance; 0.4 is not


def test_hacking_alarm_quiet_on_healthy_and_on_collapse():
    rising = [0.1 * k for k in range(1, 31)]
    assert _run_alarm(rising, {0: 0.5, 10: 0.6, 20: 0.7, 30: 0.8}) == []      # gold follows the training reward
    falling = [3.0 - 0.1 * k for k in range(1, 31)]
    assert _run_alarm(falling, {0: 0.5, 10: 0.6, 20: 0.3, 30: 0.2}) == []     # both fall: collapse, not hacking
    assert _run_alarm(rising, {0: 0.5, 10: 0.6, 20: 0.3}, tolerance=0.5) == []  # within a loose tolerance


def test_hacking_alarm_state_round_trip_keeps_the_best_and_baseline():
    alarm = HackingAlarm(0.05)
    alarm.update(0, {"gold": 0.7})
    for step in range(1, 11):
        alarm.observe_train_reward(step, 0.1 * step)
    alarm.update(10, {"gold": 0.65})
    resumed = HackingAlarm(0.05)
    resumed.load_state_dict(alarm.state_dict())
    for step in range(11, 21):
        resumed.observe_train_reward(step, 2.0)
    verdict = resumed.update(20, {"gold": 0.5})
    assert verdict.fired and verdict.fallen["gold"][0] == pytest.approx(0.7) and verdict.fallen["gold"][2] == 0
    assert "hacking_tolerance=0.05" in verdict.message(0.05)


def test_diversity_alarm():
    alarm = DiversityAlarm(0.5, window=2)
    assert not alarm.update(1.0) and not alarm.update(0.8)
    assert not alarm.update(0.3)          # mean(0.8, 0.3) = 0.55 >= 0.5
    assert alarm.update(0.2)              # mean(0.3, 0.2) = 0.25 < 0.5
    restored = DiversityAlarm(0.5, window=2)
    restored.load_state_dict(alarm.state_dict())
    assert restored.active and restored.first == 1.0
    assert not DiversityAlarm(0.0).update(0.0)
    with pytest.raises(ValueError, match="diversity_collapse_ratio"):
        DiversityAlarm(1.5)


# ---- GARDO ---------------------------------------------------------------------------------------------------
def test_gardo_uncertainty_ranks_and_gate():
    assert descending_ranks(torch.tensor([0.2, 0.9, 0.5, 0.5])).tolist() == [4, 1, 2, 3]
    proxy = torch.tensor([4.0, 3.0, 2.0, 1.0])           # ranks 1 2 3 4
    aux1 = torch.tensor([1.0, 2.0, 3.0, 4.0])            # ranks 4 3 2 1
    aux2 = torch.tensor([1.0, 2.0, 4.0, 3.0])            # ranks 4 3 1 2
    u = reward_uncertainty(proxy, [aux1, aux2])
    assert u.tolist() == [1 - 4, 2 - 3, 3 - 1.5, 4 - 1.5]
    # non-negative u: [1.5, 2.5]; the 90th percentile is 2.4 -> only the last sample is gated
    assert uncertainty_gate(u, 0.1).tolist() == [False, False, False, True]
    assert not uncertainty_gate(torch.tensor([-1.0, -2.0]), 0.1).any()
    per = torch.tensor([1.0, 2.0, 3.0])
    assert float(gated_mean(per, torch.tensor([True, False, True]))) == 2.0
    assert float(gated_mean(per, torch.tensor([False, False, False]))) == 0.0
    assert float(gated_mean(per, None)) == 2.0
    with pytest.raises(ValueError, match="auxiliary"):
        reward_uncertainty(proxy, [])


def test_gardo_gate_fraction_follows_the_official_compensator():
    frac = GateFraction()
    assert frac.update(torch.tensor([1.0, 3.0])) == pytest.approx(0.1)       # first batch: the base
    assert frac.update(torch.tensor([5.0])) == pytest.approx(0.11)          # above every buffered mean
    assert frac.update(torch.tensor([0.5, -3.0])) == pytest.approx(0.099)   # below every buffered mean
    assert frac.update(torch.tensor([3.0])) == pytest.approx(0.099)         # in between: unchanged
    for k in range(40):
        frac.update(torch.tensor([10.0 + k]))                              # always above: grows, then clipped
    assert frac.fraction == pytest.approx(0.2) and len(frac.buffer) == 20   # clipped, bounded buffer


def test_gardo_reset_schedule():
    sched = ReferenceResetSchedule(kl_threshold=1e-3, reset_steps=3)
    assert [sched.should_reset(k) for k in range(5)] == [False, False, False, False, True]
    sched.observe_kl(5e-3)
    assert sched.should_reset(5) and not sched.should_reset(6)
    copy = ReferenceResetSchedule(1e-3, 3)
    copy.load_state_dict(sched.state_dict())
    assert copy.resets == [4, 5] and copy.last_reset == 5


def test_gardo_diversity_aware_advantages():
    # one group of 4: rewards 1, 1, 0, 0; features: two identical, two orthogonal to everything.
    feats = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]])
    rewards = torch.tensor([1.0, 0.8, 0.0, 0.2])
    adv = rewards - rewards.mean()
    shaped, factor = diversity_aware_advantages(adv, rewards, feats, torch.zeros(4, dtype=torch.long))
    nearest = torch.tensor([0.0, 0.0, 1.0, 1.0])
    expected = torch.tensor([0 / nearest.mean(), 0 / nearest.mean(), 1.0, 1.0], dtype=torch.float64)
    assert factor.tolist() == pytest.approx(expected.tolist())     # above-mean samples that are duplicates: 0
    assert shaped.tolist() == pytest.approx((adv.double() * expected).tolist())
    feats2 = torch.tensor([[1.0, 0], [0, 1.0], [1.0, 1.0]])
    r2 = torch.tensor([1.0, 0.0, 0.9])
    _, f2 = diversity_aware_advantages(r2 - r2.mean(), r2, feats2, torch.zeros(3, dtype=torch.long))
    d = torch.tensor([1 - math.sqrt(0.5), 1 - math.sqrt(0.5), 1 - math.sqrt(0.5)])
    assert f2.tolist() == pytest.approx([float(d[0] / d.mean()), 1.0, float(d[2] / d.mean())])


# ---- dynamic sampling ----------------------------------------------------------------------------------------
def test_dynamic_sampling_bookkeeping_keeps_shapes():
    from flowgrpo.models import PromptEmbeds

    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, math.nan, math.nan, 0.5, 0.5])
    groups = torch.tensor([3, 3, 7, 7, 9, 9, 2, 2])
    assert groups_without_signal(rewards, groups) == [3, 9, 2]
    a = {"x": torch.arange(4.0).view(4, 1), "embeds": PromptEmbeds({"e": torch.arange(4.0).view(4, 1)}),
         "window": (0, 2)}
    b = {"x": torch.arange(4.0, 8.0).view(4, 1), "embeds": PromptEmbeds({"e": torch.arange(4.0, 8.0).view(4, 1)}),
         "window": (0, 2)}
    merged = concat_records([a, b])
    picked = select_rows(merged, torch.tensor([0, 5, 6, 3]))
    assert picked["x"].flatten().tolist() == [0, 5, 6, 3] and picked["window"] == (0, 2)
    assert picked["embeds"].tensors["e"].flatten().tolist() == [0, 5, 6, 3]
    pieces = split_rows(merged, 3)
    assert [len(p["embeds"]) for p in pieces] == [3, 3, 2]
    with pytest.raises(ValueError, match="window"):
        concat_records([a, {**b, "window": (1, 3)}])
    idx = fresh_prompt_indices(10, 4, seed=5)
    assert len(set(idx)) == 4 and idx == fresh_prompt_indices(10, 4, seed=5)
    assert len(fresh_prompt_indices(2, 5, seed=1)) == 5


# ---- monitor state and reference -----------------------------------------------------------------------------
def test_monitor_state_round_trip(tmp_path):
    from flowgrpo.trainer.health.arguments import HealthArguments

    args = HealthArguments()
    monitor = HealthMonitor(args)
    assert monitor.feature_name == "grey32"
    monitor.hacking.update(0, {"gold": 0.9})
    monitor.diversity.update(0.4)
    monitor.gate_fraction.update(torch.tensor([1.0]))
    monitor.reset_schedule.observe_kl(1.0)
    monitor.dropped_groups_total = 3
    monitor.save(tmp_path)
    other = HealthMonitor(args)
    assert other.load(tmp_path) and other.state_dict() == monitor.state_dict()
    assert not HealthMonitor(args).load(tmp_path / "missing")

    class FakeClip:
        def image_embeddings(self, images):
            return torch.ones(len(images), 3)

    assert clip_feature_source([lambda p, i: [], FakeClip()]) is not None
    assert HealthMonitor(args, [FakeClip()]).feature_name == "clip"


def test_reference_adapter_refresh_and_checkpoint(tmp_path):
    from peft import LoraConfig, get_peft_model

    from flowgrpo.trainer.policy.reference import ReferencePolicy

    torch.manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(r=2, target_modules=["0"],
                                                                                  init_lora_weights="gaussian"))
    x = torch.randn(3, 4)
    ref = ReferencePolicy(model, is_peft=True, own_adapter=True)
    initial = model(x).detach()
    for p in model.parameters():
        if p.requires_grad:
            p.data.add_(0.5)
    with ref.forward_model(model) as r:
        assert torch.allclose(r(x), initial)          # the reference is the initial policy
    trained_out = model(x).detach()
    assert not torch.allclose(trained_out, initial)
    ref.refresh(1.0)
    with ref.forward_model(model) as r:
        assert torch.allclose(r(x), trained_out)      # alpha = 1: a copy of the policy
    assert any(p.requires_grad for p in model.parameters())
    ref.save(tmp_path)
    fresh_model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(
        r=2, target_modules=["0"], init_lora_weights="gaussian"))
    fresh_model.load_state_dict(model.state_dict(), strict=False)
    fresh = ReferencePolicy(fresh_model, is_peft=True, own_adapter=True)
    assert fresh.load(tmp_path) and fresh.refreshes == 1
    with fresh.forward_model(fresh_model) as r:
        assert torch.allclose(r(x), trained_out)

    base = ReferencePolicy(model, is_peft=True)
    with pytest.raises(RuntimeError, match="cannot be refreshed"):
        base.refresh(0.5)

    full = torch.nn.Linear(2, 2)
    copy_ref = ReferencePolicy(full, is_peft=False)
    before = copy_ref.copy.weight.detach().clone()
    full.weight.data.add_(1.0)
    copy_ref.refresh(0.6)                               # TRL's sync_target_model: (1 - a) ref + a theta
    assert torch.allclose(copy_ref.copy.weight, 0.4 * before + 0.6 * full.weight)


def test_health_arguments_errors():
    from flowgrpo.trainer.health.arguments import HealthArguments, check_health_arguments

    class Args(HealthArguments):
        num_inference_steps = 10
        metric_for_best_model = None
        eval_strategy = "no"
        beta = 0.0

    def check(**kwargs):
        args = Args()
        for k, v in kwargs.items():
            setattr(args, k, v)
        check_health_arguments(args)
        return args

    assert check(eval_reward_kwargs='{"toy_shape": {}}').eval_reward_kwargs == {"toy_shape": {}}
    for kwargs, match in [
        ({"on_hacking": "abort"}, "on_hacking"), ({"regularizer": "kl"}, "regularizer"),
        ({"hacking_tolerance": -1}, "hacking_tolerance"), ({"diversity_collapse_ratio": 1.0}, "diversity"),
        ({"health_kl_steps": -1}, "health_kl_steps"), ({"max_resample_rounds": -1}, "max_resample_rounds"),
        ({"ref_model_mixup_alpha": 0.0}, "ref_model_mixup_alpha"), ({"ref_model_sync_steps": 0}, "sync_steps"),
        ({"base_model_tail_steps": 10}, "base_model_tail_steps"),
        ({"early_stopping_patience": 2}, "metric_for_best_model"),
        ({"early_stopping_patience": 2, "metric_for_best_model": "eval_reward"}, "eval_strategy"),
        ({"regularizer": "gardo"}, "beta"), ({"regularizer": "gardo", "beta": 0.04}, "gardo_auxiliary_rewards"),
        ({"eval_reward_weights": [1.0]}, "eval_reward_weights"),
        ({"load_best_model_at_end": True, "metric_for_best_model": "loss"}, "metric_for_best_model"),
    ]:
        with pytest.raises(ValueError, match=match):
            check(**kwargs)
