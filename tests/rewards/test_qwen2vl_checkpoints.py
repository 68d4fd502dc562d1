"""The Qwen2-VL checkpoint key conversion that HPSv3, EditReward and VideoAlign share (flowgrpo.rewards.qwen2vl_checkpoints),
on a hand-made state dict in both layouts. (Each reward's real checkpoint layout: its own test file.)"""

import pytest

from flowgrpo.rewards.qwen2vl_checkpoints import convert_qwen2vl_keys


def test_old_and_current_layouts_convert_to_the_current_one_and_unknown_keys_are_named():
    old = {"model.layers.0.mlp.weight": 1, "model.embed_tokens.weight": 2, "visual.blocks.0.attn.weight": 3,
           "rm_head.0.weight": 4, "lm_head.weight": 5}
    current = {"model.language_model.layers.0.mlp.weight": 1, "model.language_model.embed_tokens.weight": 2,
               "model.visual.blocks.0.attn.weight": 3, "rm_head.0.weight": 4}
    convert = lambda state, heads=("rm_head.",): convert_qwen2vl_keys(  # noqa: E731
        state, heads, checkpoint="a test", expected="model.*, visual.*, rm_head.*")
    assert convert(old) == current
    assert convert(current) == current  # today's layout loads as it is
    with pytest.raises(ValueError, match=r"not a test checkpoint: unexpected keys \['rm_head.0.weight'\] "
                                         r"\(expected model.\*, visual.\*, rm_head.\*\)"):
        convert(old, heads=("rm_heads.",))  # another reward's head is no head of this one
