"""The EMA of the trainable weights (flowgrpo.trainer.policy.ema), with and without Flow-GRPO's warm-up."""

import pytest
import torch

from flowgrpo.trainer.policy.ema import EMAWeights


def test_ema_update_with_and_without_warmup():
    p = torch.nn.Parameter(torch.zeros(3))
    plain, warm = EMAWeights([p], decay=0.9), EMAWeights([p], decay=0.9, update_interval=2, warmup=True)
    with torch.no_grad():
        p.fill_(1.0)
    plain.update([p], 1)
    assert plain.shadow[0].tolist() == pytest.approx([0.1] * 3)  # 0.9 * 0 + 0.1 * 1
    warm.update([p], 1)  # not a multiple of the interval: no update
    assert warm.shadow[0].tolist() == [0.0] * 3 and warm.num_updates == 0
    warm.update([p], 2)  # d = min(3 / 12, 0.9) = 0.25
    assert warm.shadow[0].tolist() == pytest.approx([0.75] * 3)
    assert warm.current_decay(2) == 0.25 and warm.current_decay(80) == 0.9 and warm.current_decay(1000) == 0.9
    restored = EMAWeights([p], decay=0.5)
    restored.load_state_dict(warm.state_dict())
    assert restored.warmup and restored.decay == 0.9 and restored.update_interval == 2
    old = warm.state_dict()
    del old["warmup"]  # a checkpoint written before the option: no warm-up
    restored.load_state_dict(old)
    assert not restored.warmup


def test_warmup_follows_awms_official_ema_step_by_step():
    """AWM's official EMA (decay 0.99, update interval 1): after optimizer step k (global_step already incremented),
    ema += (1 - min((1 + k) / (10 + k), 0.99)) (theta - ema). The trainer calls update(params, state.global_step)
    after the step, so the same k."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    ema = EMAWeights([p], decay=0.99, update_interval=1, warmup=True)
    official = p.detach().clone()
    for k in range(1, 400):
        with torch.no_grad():
            p.copy_(torch.randn(4, generator=g, dtype=torch.float64))
        ema.update([p], k)
        official += (1 - min((1 + k) / (10 + k), 0.99)) * (p.detach() - official)
        torch.testing.assert_close(ema.shadow[0].double(), official, rtol=0, atol=1e-6)
    assert ema.current_decay(1) == pytest.approx(2 / 11) and ema.current_decay(890) == 0.99
