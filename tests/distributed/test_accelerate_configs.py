"""Every file in accelerate_configs/ goes through accelerate's own code: ``load_config_from_file`` (unknown keys
fail), the ``accelerate launch`` argument handling (``_validate_launch_command``, ``prepare_multi_gpu_env`` /
``prepare_deepspeed_cmd_env``), and the plugin classes the launched script builds from that environment
(``FullyShardedDataParallelPlugin``, ``DeepSpeedPlugin``). FSDP wrapping is checked with accelerate's FSDP2 wrap
policy on the tiny SD3, FLUX, Qwen-Image and Wan transformers. Running the GPU configs needs GPUs; the CPU config runs for real in
tests/distributed/test_distributed.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType

CONFIGS = Path(__file__).resolve().parents[2] / "accelerate_configs"
EXPECTED = {
    "single_gpu.yaml": (DistributedType.NO, 1),
    "multi_gpu.yaml": (DistributedType.MULTI_GPU, 8),
    "fsdp8.yaml": (DistributedType.FSDP, 8),
    "fsdp8_flux.yaml": (DistributedType.FSDP, 8),
    "fsdp8_qwenimage.yaml": (DistributedType.FSDP, 8),
    "fsdp8_wan.yaml": (DistributedType.FSDP, 8),
    "fsdp8_video.yaml": (DistributedType.FSDP, 8),
    "fsdp8_flux2.yaml": (DistributedType.FSDP, 8),
    "zero2.yaml": (DistributedType.DEEPSPEED, 8),
    "zero3.yaml": (DistributedType.DEEPSPEED, 8),
    "multi_node.yaml": (DistributedType.MULTI_GPU, 16),
    "cpu_ddp.yaml": (DistributedType.MULTI_GPU, 2),
}


VIDEO_UNITS = {"WanTransformerBlock", "WanTransformer3DModel", "LTX2VideoTransformerBlock", "LTX2VideoTransformer3DModel",
               "HunyuanVideo15TransformerBlock", "HunyuanVideo15Transformer3DModel"}


def launch_args(name: str):
    """What ``accelerate launch --config_file <name> src/train.py recipe.yaml`` resolves its arguments to."""
    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / name), "src/train.py", "recipe.yaml"])
    args, defaults, mixed_precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command does before starting DeepSpeed
        fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mixed_precision_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args, defaults


def plugin_env(monkeypatch, name: str) -> dict[str, str]:
    """Set the environment the launcher gives the training processes; returns it."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, _ = launch_args(name)
    args.main_process_port = 0  # a free port: nothing is bound, but the launcher checks availability
    if args.use_deepspeed:
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def test_every_config_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_accelerate(name):
    config = load_config_from_file(str(CONFIGS / name))  # raises on unknown keys
    kind, processes = EXPECTED[name]
    assert config.distributed_type == kind
    assert config.num_processes == processes
    text = (CONFIGS / name).read_text()
    assert text.startswith("#") and "Hardware:" in text  # each file says what it expects
    args, _ = launch_args(name)
    assert args.num_processes == processes
    if name == "cpu_ddp.yaml":
        # two real CPU ranks: MULTI_GPU with use_cpu (``--cpu --num_processes 2`` would start one process)
        assert config.use_cpu and args.multi_gpu and not args.cpu
    else:
        assert not config.use_cpu and config.mixed_precision == "bf16"
    if name == "multi_node.yaml":
        assert config.num_machines == 2 and args.num_machines == 2


def test_multi_gpu_launch_environments(monkeypatch):
    env = plugin_env(monkeypatch, "multi_gpu.yaml")
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    args, _ = launch_args("multi_node.yaml")
    from accelerate.utils.launch import prepare_multi_gpu_env

    args.main_process_port = 0
    prepare_multi_gpu_env(args)
    assert (args.nnodes, args.nproc_per_node) == ("2", "8")


def _wrapped_class_names(plugin, family: str) -> set[str]:
    """Class names of the modules accelerate's FSDP2 preparation would shard as their own units (after the trainer
    keeps the configured classes its model has)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from peft import LoraConfig, get_peft_model

    from flowgrpo.testing import build_tiny_pipeline
    from flowgrpo.trainer.fsdp_units import keep_present_wrap_classes

    model = get_peft_model(build_tiny_pipeline(family, seed=0).transformer,
                           LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
    keep_present_wrap_classes(plugin, model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    return {type(m).__name__ for m in model.modules() if policy(m)}


@pytest.mark.parametrize("name, family, units", [
    ("fsdp8.yaml", "sd3", {"JointTransformerBlock", "SD3Transformer2DModel"}),
    ("fsdp8_flux.yaml", "flux", {"FluxTransformerBlock", "FluxSingleTransformerBlock", "FluxTransformer2DModel"}),
    ("fsdp8_qwenimage.yaml", "qwenimage", {"QwenImageTransformerBlock", "QwenImageTransformer2DModel"}),
    ("fsdp8_wan.yaml", "wan", {"WanTransformerBlock", "WanTransformer3DModel"}),
    ("fsdp8_video.yaml", "wan_i2v", {"WanTransformerBlock", "WanTransformer3DModel"}),
    ("fsdp8_video.yaml", "ltx2", {"LTX2VideoTransformerBlock", "LTX2VideoTransformer3DModel"}),
    ("fsdp8_video.yaml", "hunyuanvideo15", {"HunyuanVideo15TransformerBlock", "HunyuanVideo15Transformer3DModel"}),
    ("fsdp8_flux2.yaml", "flux2_klein", {"Flux2TransformerBlock", "Flux2SingleTransformerBlock",
                                          "Flux2Transformer2DModel"}),
])
def test_fsdp_configs_build_the_fsdp2_plugin_and_wrap_the_transformer(monkeypatch, name, family, units):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    env = plugin_env(monkeypatch, name)
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is True
    assert "FULL_STATE_DICT" in str(plugin.state_dict_type)
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy
    if name == "fsdp8_video.yaml":  # every video family's classes; the trainer keeps those of its model
        assert set(plugin.transformer_cls_names_to_wrap) == VIDEO_UNITS
    else:
        assert set(plugin.transformer_cls_names_to_wrap) == units
    assert not plugin.cpu_ram_efficient_loading
    # the transformer itself and every block become units (the root PeftModel is sharded last by accelerate)
    assert _wrapped_class_names(plugin, family) == units


@pytest.mark.parametrize("name, stage", [("zero2.yaml", 2), ("zero3.yaml", 3)])
def test_deepspeed_configs_build_the_plugin(monkeypatch, name, stage):
    from accelerate.utils import DeepSpeedPlugin

    env = plugin_env(monkeypatch, name)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
    plugin = DeepSpeedPlugin()  # reads the launcher's environment, as in the training processes
    assert plugin.zero_stage == stage
    config = plugin.deepspeed_config
    assert config["zero_optimization"]["stage"] == stage
    assert config["gradient_accumulation_steps"] == "auto" and config["train_micro_batch_size_per_gpu"] == "auto"
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "none"
    if stage == 3:
        # the LoRA is saved from gathered 16-bit weights; parameters are not partitioned at construction
        assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
        assert plugin.zero3_init_flag is False


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install 'flowgrpo[deepspeed]'); the ZeRO files are "
                           "validated above with accelerate's DeepSpeedPlugin, which does not need it")
@pytest.mark.parametrize("name, stage", [("zero2.yaml", 2), ("zero3.yaml", 3)])
def test_deepspeed_accepts_the_filled_config(monkeypatch, name, stage):
    """transformers fills the "auto" values from the training arguments; DeepSpeed's own config class parses it."""
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    plugin_env(monkeypatch, name)
    plugin = DeepSpeedPlugin()
    from flowgrpo import FlowGRPOConfig

    args = FlowGRPOConfig(output_dir="unused", report_to=[], per_device_train_batch_size=8, num_generations=8,
                          use_cpu=True)
    hf_config = HfTrainerDeepSpeedConfig(plugin.deepspeed_config)
    hf_config.trainer_config_process(args)
    filled = hf_config.config
    assert filled["train_micro_batch_size_per_gpu"] == 8
    assert DeepSpeedZeroConfig(**filled["zero_optimization"]).stage == stage


def test_a_config_naming_none_of_the_models_blocks_is_refused():
    from types import SimpleNamespace

    from flowgrpo.testing import build_tiny_pipeline
    from flowgrpo.trainer.fsdp_units import keep_present_wrap_classes

    plugin = SimpleNamespace(transformer_cls_names_to_wrap=["LTX2VideoTransformerBlock"])
    with pytest.raises(ValueError, match=r"none of which is in this model.*WanTransformerBlock"):
        keep_present_wrap_classes(plugin, build_tiny_pipeline("wan", seed=0).transformer)
