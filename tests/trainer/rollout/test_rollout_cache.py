"""``rollout_cache``: diffusers' cache hooks around training rollouts only, on a real tiny AWM trainer (its SA-Solver
loop and the engine's own loop), and the refusals, each raised before the pipeline is loaded.

Which cache runs on which family is measured on every family's tiny pipeline by scripts/rollout_cache_table.py (a
few minutes; its table is flowgrpo.trainer.speed_settings.UNSUPPORTED); here one refused combination per kind of
reason is checked."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from support.trainer_cases import PROMPTS, make_trainer

from flowgrpo.trainer.rollout.ray.worker import rollout_fingerprint
from flowgrpo.trainer.speed_settings import rollout_cache_refusal, sharded_launch


def cache_hooks(trainer) -> list[str]:
    """The names of the diffusers hooks left on any module of the trained transformer."""
    registries = [getattr(sub, "_diffusers_hook", None) for m in trainer.policy.adapter.transformers()
                  for sub in m.modules()]
    return [name for registry in registries if registry is not None for name in registry.hooks]


def test_a_cached_rollout_skips_blocks_and_nothing_else_is_cached(tiny_sd3_path, tmp_path):
    """AWM's SA-Solver rollout skips some hooked computations (logged), leaves no hook behind, and the training
    forward's ratio is 1 on-policy; an evaluation gives the same scores with the cache as without it (it never runs
    through it). The engine's own loop is the next test's."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="awm", train_timesteps=2, rollout_sampler="sa_solver",
                           num_inference_steps=6, rollout_cache="pab")
    assert rollout_fingerprint(trainer.rollouts)["rollout_cache"] == "pab"  # a Ray worker must match it
    evaluation = Dataset.from_dict({"prompt": PROMPTS[:2]})
    before = trainer.evaluate(evaluation)
    trainer.train()
    log = next(h for h in trainer.state.log_history if "rollout/cache_skipped" in h)
    assert 0 < log["rollout/cache_skipped"] < 1
    assert log["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert cache_hooks(trainer) == []
    cache, trainer.rollouts.cache = trainer.rollouts.cache, None
    uncached = trainer.evaluate(evaluation)
    trainer.rollouts.cache = cache
    assert trainer.evaluate(evaluation)["eval_reward"] == uncached["eval_reward"] != before["eval_reward"]


def test_the_cached_states_are_not_the_policys(tiny_sd3_path, tmp_path):
    """The same rollout (the engine's sampling loop) with and without the cache: same noise, final latents a little
    apart."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, kind="crd", crd_num_timesteps=2, num_inference_steps=6,
                           rollout_cache="taylorseer",
                           rollout_cache_config={"cache_interval": 2, "disable_cache_before_step": 2,
                                                 "taylor_factors_dtype": "float32"})
    rows = [dict(trainer.train_dataset[i]) for i in range(4)]
    cached = trainer.rollouts.generate(rows, 0, 0)
    cache, trainer.rollouts.cache = trainer.rollouts.cache, None
    plain = trainer.rollouts.generate(rows, 0, 0)
    trainer.rollouts.cache = cache
    difference = (cached.records[0]["x0"] - plain.records[0]["x0"]).abs().max()
    assert 0 < float(difference) < 1
    assert cached.timing["cache_calls"] > cached.timing["cache_computed"] > 0
    assert not torch.equal(cached.records[0]["x0"], plain.records[0]["x0"])


@pytest.mark.parametrize("kind, kwargs, message", [
    ("flow_grpo", {"rollout_cache": "taylorseer"}, "reads the rollout's recorded transition log-probs"),
    ("awm", {"rollout_cache": "first_block"}, "does not run on the sd3 family"),
    ("awm", {"rollout_cache": "pab", "torch_compile": True}, "compiled again at every rollout"),
    ("awm", {"rollout_cache": "pab", "base_model_tail_steps": 1}, "base_model_tail_steps=1"),
    ("awm", {"rollout_cache": "pab", "rollout_cache_config": {"cache_interval": 2}}, "'cache_interval'"),
    ("awm", {"rollout_cache": "mag"}, "needs the model's magnitude ratios"),
    ("awm", {"rollout_cache": "taylorseer", "rollout_cache_config": {"current_timestep_callback": 1}},
     "set by the rollout engine"),
])
def test_a_cache_that_cannot_give_the_runs_results_is_refused_before_loading(tiny_sd3_path, tmp_path, monkeypatch,
                                                                             kind, kwargs, message):
    import flowgrpo.trainer.policy.policy as policy_module

    def no_loading(*args, **kw):
        raise AssertionError("the pipeline was loaded before the refusal")

    monkeypatch.setattr(policy_module, "load_pipeline", no_loading)
    settings = {"train_timesteps": 2} if kind == "awm" else {}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_trainer(tiny_sd3_path, tmp_path, kind=kind, **settings, **kwargs)


def test_bad_cache_settings_name_the_value():
    from support.trainer_cases import make_args

    with pytest.raises(ValueError, match="rollout_cache='lru'"):
        make_args(__import__("pathlib").Path("/tmp"), rollout_cache="lru")
    with pytest.raises(ValueError, match="rollout_cache is 'none'"):
        make_args(__import__("pathlib").Path("/tmp"), rollout_cache_config={"threshold": 0.1})
    with pytest.raises(ValueError, match="is not valid JSON"):
        make_args(__import__("pathlib").Path("/tmp"), rollout_cache="pab", rollout_cache_config="{threshold")


def test_the_family_table_conditions():
    # PAB keeps one state for both passes of Qwen-Image's guidance: refused with guidance only
    assert rollout_cache_refusal("pab", "qwenimage", uses_cfg=True) is not None
    assert rollout_cache_refusal("pab", "qwenimage", uses_cfg=False) is None
    # TaylorSeer's default patterns miss Wan's layers: allowed once the recipe names them
    assert rollout_cache_refusal("taylorseer", "wan", False) is not None
    assert rollout_cache_refusal("taylorseer", "wan", False, {"cache_identifiers": [r"blocks\.\d+\.attn\d"]}) is None
    assert rollout_cache_refusal("none", "sd3", True) is None


def test_sharded_launches_are_read_from_the_configuration_and_the_environment(monkeypatch, tmp_path):
    class Args:
        fsdp = ""
        deepspeed = None

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    assert sharded_launch(Args()) is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert sharded_launch(Args()) == "FSDP"
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    config = tmp_path / "ds.json"
    config.write_text('{"zero_optimization": {"stage": 3}}')
    Args.deepspeed = str(config)
    assert sharded_launch(Args()) == "DeepSpeed ZeRO-3"
    config.write_text('{"zero_optimization": {"stage": 2}}')
    assert sharded_launch(Args()) is None


def test_speed_settings_follow_the_algorithms_spec():
    """The refusals read the algorithm's facts, not its name: a rollout inside the loss (the reward-gradient trainer),
    recorded log-probs (Flow-GRPO), and sequence parallelism with either switch."""
    from flowgrpo.trainer.registry import TRAINERS
    from flowgrpo.trainer.speed_settings import check_speed_settings

    def facts(name, **kwargs):
        args = TRAINERS[name].config_class()(output_dir="/tmp/unused", report_to=[], num_inference_steps=4, **kwargs)
        return args, TRAINERS[name].facts(args)

    args, backprop = facts("reward_backprop")
    args.rollout_cache = "pab"
    with pytest.raises(ValueError, match="its rollout runs inside its loss"):
        check_speed_settings(args, backprop, "sd3", uses_cfg=False)
    args, grpo = facts("flow_grpo")
    args.rollout_cache = "pab"
    with pytest.raises(ValueError, match="reads the rollout's recorded transition log-probs"):
        check_speed_settings(args, grpo, "sd3", uses_cfg=False)
    args, nft = facts("diffusion_nft")
    args.sequence_parallel_size, args.torch_compile = 2, True
    with pytest.raises(ValueError, match="torch_compile=True with sequence_parallel_size=2"):
        check_speed_settings(args, nft, "wan", uses_cfg=False)
    args.torch_compile, args.rollout_cache = False, "pab"
    with pytest.raises(ValueError, match="rollout_cache='pab' with sequence_parallel_size=2"):
        check_speed_settings(args, nft, "wan", uses_cfg=False)
