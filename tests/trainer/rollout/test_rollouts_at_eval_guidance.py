"""``rollouts_at_eval_guidance``: the trainers whose loss reads only the rollouts' clean samples (AWM, DGPO, online
Diffusion-DPO) roll out at the evaluation's guidance with the trained velocity at train_guidance_scale; the others
refuse it with their reason."""

import pytest
import torch
from support.trainer_cases import TRAINER_KINDS, make_args, make_trainer, redness_reward

ALLOWED = ("awm", "dgpo", "diffusion_dpo")
REFUSED = {"flow_grpo": "likelihood of each recorded SDE transition", "crd": "implicit reward",
           "diffusion_opd": "per-step KL"}


@pytest.mark.parametrize("kind", [*ALLOWED, *REFUSED])
def test_allowed_where_the_loss_reads_only_clean_samples(tmp_path, kind):
    config_class, _, settings, _ = TRAINER_KINDS[kind]
    if kind in REFUSED:
        with pytest.raises(ValueError, match=f"refused by .*{REFUSED[kind]}.*set guidance_scale"):
            make_args(tmp_path, config_class, rollouts_at_eval_guidance=True, eval_guidance_scale=3.0, **settings)
        return
    args = make_args(tmp_path, config_class, rollouts_at_eval_guidance=True, eval_guidance_scale=3.0,
                     guidance_scale=None, **settings)
    assert args.guidance_scale == 3.0 and args.training_guidance_scale == 1.0
    with pytest.raises(ValueError, match="eval_guidance_scale, which is not given"):
        make_args(tmp_path, config_class, rollouts_at_eval_guidance=True, guidance_scale=None, **settings)


def test_diffusion_nft_refuses_it(tmp_path):
    from flowgrpo import DiffusionNFTConfig

    with pytest.raises(ValueError, match="implicit positive and negative policies"):
        make_args(tmp_path, DiffusionNFTConfig, rollouts_at_eval_guidance=True, eval_guidance_scale=3.0)


def test_dgpo_rolls_out_at_the_evaluation_guidance(tiny_sd3_path, tmp_path):
    settings = dict(TRAINER_KINDS["dgpo"][2], kind="dgpo", reward=redness_reward, max_steps=1, learning_rate=3e-3)

    def first_samples(name, **kwargs):
        trainer = make_trainer(tiny_sd3_path, tmp_path / name, **settings, **kwargs)
        trainer.train()
        return trainer, torch.cat([record["x0"] for record in trainer.buffer])

    switched, at_eval = first_samples("switched", rollouts_at_eval_guidance=True, eval_guidance_scale=4.0)
    assert switched.args.guidance_scale == 4.0 and switched.args.training_guidance_scale == 1.0
    _, guided = first_samples("guided", guidance_scale=4.0)
    _, plain = first_samples("plain", guidance_scale=1.0)
    torch.testing.assert_close(at_eval, guided)
    assert not torch.allclose(at_eval, plain)
