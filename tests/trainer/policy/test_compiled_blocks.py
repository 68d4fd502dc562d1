"""``torch_compile``: the transformer's blocks compiled once and shared by rollouts, evaluation and training, on a
real tiny Flow-GRPO trainer; the refusals.

The run compiles with torch's ``eager`` backend: Dynamo traces and guards the blocks exactly as with inductor, so
whether rollouts, evaluation and training reach the same compiled blocks, whether batch sizes recompile and what is
logged are all tested, in seconds; inductor's C++ code generation takes minutes for the same tiny model on two CPU
cores (docs/benchmarks.md, "Compiled blocks", gives its measured first-pass ratio, exactly 1). The tests share one
worker process (``xdist_group``): the later trainers of the file reuse the graphs the first compiled."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from support.trainer_cases import PROMPTS, brightness_reward, lora_config, make_args

from flowgrpo import FlowGRPOTrainer

pytestmark = pytest.mark.xdist_group("torch_compile")


def compiled_trainer(path, folder, **kwargs):
    args = make_args(folder, torch_compile=True, torch_compile_backend="eager", sde_window_size=1,
                     sde_window_range=[0, 2], max_steps=2, learning_rate=3e-3, save_strategy="steps", save_steps=1,
                     eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=3, use_ema=True, **kwargs)
    return FlowGRPOTrainer(model=str(path), reward_funcs=brightness_reward, args=args,
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:3]}), peft_config=lora_config())


def test_compiled_blocks_keep_the_first_pass_on_policy_without_recompiling_and_resume_exactly(tiny_sd3_path,
                                                                                              tmp_path):
    """Rollouts (batch 4, no grad), evaluation (batch 3, the EMA's weights swapped in) and training (batch 4, grad)
    share the compiled blocks, LoRA layers inside: the first pass's ratio is 1, the second step compiles nothing new,
    Trainer wraps no compiled copy of the whole model, and a run resumed from its step-1 checkpoint ends with the
    uninterrupted run's weights and EMA."""
    from torch._dynamo.eval_frame import OptimizedModule

    straight = compiled_trainer(tiny_sd3_path, tmp_path / "a")
    blocks = [m for m in straight.policy.adapter.transformers()[0].modules()
              if type(m).__name__ == "JointTransformerBlock"]
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    straight.train()
    assert not isinstance(straight.model_wrapped, OptimizedModule)
    logs = [h for h in straight.state.log_history if "ratio_mean" in h]
    assert abs(logs[0]["ratio_mean"] - 1.0) < 1e-5 and logs[0]["on_policy_ratio_max_dev"] < 1e-5
    assert [("timing/compile_s" in h) for h in logs] == [True, False]  # logged once
    assert logs[0]["compile/graphs"] >= 2  # the no-grad and the grad path
    assert logs[1]["compile/recompiles"] == 0  # the evaluation batch of 3 and step 2 reused the graphs
    assert sum("eval_reward" in h for h in straight.state.log_history) == 2

    resumed = compiled_trainer(tiny_sd3_path, tmp_path / "b")  # from the straight run's own step-1 checkpoint
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-1"))
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q)
    for s, t in zip(straight.policy.ema.shadow, resumed.policy.ema.shadow):
        torch.testing.assert_close(s, t)


@pytest.mark.parametrize("environment, launch", [
    ({"ACCELERATE_USE_FSDP": "true"}, "FSDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "DeepSpeed ZeRO-3"),
])
def test_sharded_launches_refuse_compiled_blocks_before_loading(tiny_sd3_path, tmp_path, monkeypatch, environment,
                                                                launch):
    """The launch's environment (``accelerate launch`` with an FSDP or ZeRO-3 config) is read before the pipeline is
    loaded."""
    import flowgrpo.trainer.policy.policy as policy_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the refusal")

    monkeypatch.setattr(policy_module, "load_pipeline", no_loading)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=f"torch_compile=True with {launch}"):
        compiled_trainer(tiny_sd3_path, tmp_path)
