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
