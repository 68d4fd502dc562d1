"""Two processes really train together on CPU.

* DDP: CI's launch line ``accelerate launch --config_file accelerate_configs/cpu_ddp.yaml src/train.py
  recipes/tiny_cpu.yaml --max_steps 2`` (plus paths into the test's folder). Every prompt of the dataset is the same
  text, so different images on the two ranks can only come from different noise. The ranks write their records
  through ``FLOWGRPO_RANK_LOG_DIR`` (see ``flowgrpo.cli.train``).
* FSDP2: ``tests/distributed/fsdp2_worker.py`` under ``torch.distributed.run`` shards the LoRA transformer with
  ``fully_shard`` on two gloo ranks, takes a training step, runs the pipeline and exports the LoRA; the export must
  equal the same step taken without sharding. The same launch counts the weight all-gathers of the trainer's replay
  of a micro-batch at several ``train_timesteps_per_pass``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n" \
                                 f"{proc.stderr[-6000:]}"
    return proc


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _image(pipe, seed: int = 0) -> np.ndarray:
    return pipe("a red circle", num_inference_steps=2, height=64, width=64, guidance_scale=1.0, max_sequence_length=8,
                output_type="np", generator=torch.Generator().manual_seed(seed)).images


def test_cpu_ddp_launch_trains_two_ranks(tiny_sd3_path, tmp_path):
    prompts = tmp_path / "same_prompt.txt"
    prompts.write_text('a wooden sign that says "OPEN"\n' * 4)
    out, rank_logs = tmp_path / "out", tmp_path / "ranks"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_ddp.yaml",
           "src/train.py", "recipes/tiny_cpu.yaml", "--max_steps", "2",
           "--output_dir", str(out), "--model_name_or_path", str(tiny_sd3_path), "--dataset_name", str(prompts),
           "--eval_dataset_name", str(prompts), "--max_eval_samples", "2", "--disable_tqdm", "true"]
    proc = _run(cmd, _env(FLOWGRPO_RANK_LOG_DIR=str(rank_logs)))
    # Every LoRA weight takes part in every step: DDP runs without the unused-parameter search (and its warning).
    assert "find_unused_parameters=True" not in proc.stderr

    r0, r1 = _records(rank_logs / "rank0.jsonl"), _records(rank_logs / "rank1.jsonl")
    assert [r["step"] for r in r0] == [r["step"] for r in r1] == [1, 2]
    for a, b in zip(r0, r1):
        assert a["world_size"] == b["world_size"] == 2 and (a["rank"], b["rank"]) == (0, 1)
        # statistics of the gathered rewards: the same on both ranks
        for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/jpeg_compressibility/mean"):
            assert a["logs"][key] == b["logs"][key], key
        # the same prompt everywhere, yet different images: each rank samples its own noise
        assert len(a["samples"]) == len(b["samples"]) == 4
        assert {s["prompt"] for s in a["samples"] + b["samples"]} == {'a wooden sign that says "OPEN"'}
        assert not {s["image_sha1"] for s in a["samples"]} & {s["image_sha1"] for s in b["samples"]}
        assert a["local_advantages"] != b["local_advantages"]
        # the logged mean is over both ranks' images, and advantages use the gathered batch std (scale "batch")
        rewards = np.array([s["reward"] for s in a["samples"] + b["samples"]])
        assert a["logs"]["reward"] == pytest.approx(rewards.mean(), abs=1e-5)
        assert a["logs"]["reward_std"] == pytest.approx(rewards.std(), rel=1e-3, abs=1e-6)
        for record in (a, b):
            local = np.array([s["reward"] for s in record["samples"]]).reshape(-1, 2)  # groups of G=2
            expected = (local - local.mean(axis=1, keepdims=True)) / (rewards.std() + 1e-4)
            np.testing.assert_allclose(np.array(record["local_advantages"]).reshape(-1, 2), expected,
                                       rtol=1e-3, atol=1e-4)
        # gradients are synchronised: identical trainable weights after every step
        assert a["trainable_sha1"] == b["trainable_sha1"]
    assert r0[0]["trainable_sha1"] != r0[1]["trainable_sha1"]

    # the diffusers LoRA of the run: in the output and the checkpoint, non-zero, and it changes a stock pipeline
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    lora_file = out / "pytorch_lora_weights.safetensors"
    assert lora_file.is_file() and (out / "checkpoint-2" / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "trainer_state.json").is_file() and "library_name: diffusers" in (out / "README.md").read_text()
    assert list(out.glob("eval_step_*.png"))
    lora = load_file(lora_file)
    assert lora and all(k.startswith("transformer.") for k in lora)
    assert any(float(t.abs().max()) > 0 for k, t in lora.items() if "lora_B" in k)

    pipe = StableDiffusion3Pipeline.from_pretrained(str(tiny_sd3_path))
    before = _image(pipe)
    pipe.load_lora_weights(str(out))
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert loaded and any(float(p.abs().max()) > 0 for n, p in loaded.items() if "lora_B" in n)
    assert np.abs(_image(pipe) - before).max() > 0


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch of ``fsdp2_worker.py`` on two gloo ranks: its output folder and each rank's record."""
    out = tmp_path_factory.mktemp("fsdp2")
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          "tests/distributed/fsdp2_worker.py", "--output_dir", str(out)], _env())
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.xdist_group("fsdp2_launch")  # one worker launches the two ranks for both tests that read them
def test_fsdp2_fully_shard_step_and_lora_export(fsdp2_run):
    tmp_path, ranks = fsdp2_run
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert all(r["num_sharded_params"] > 0 for r in ranks)  # parameters really were DTensors
    assert ranks[0]["pipeline_image_shape"] == [1, 32, 32, 3]  # the pipeline ran on the sharded transformer
    assert ranks[0]["full_state_dict_keys"] > 0 and ranks[1]["full_state_dict_keys"] == 0  # gathered on rank 0

    sys.path.insert(0, str(Path(__file__).parent))
    import fsdp2_worker
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    from flowgrpo.testing import build_tiny_pipeline
    from flowgrpo.trainer.outputs.lora_export import peft_lora_state_dict

    ref_pipe, ref_model = fsdp2_worker.reference_step(world_size=2)
    expected = {f"transformer.{k}": v for k, v in peft_lora_state_dict(ref_model).items()}
    exported = load_file(tmp_path / "lora" / "pytorch_lora_weights.safetensors")
    assert set(exported) == set(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(exported[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
    assert any(float(t.abs().max()) > 0 for k, t in exported.items() if "lora_B" in k)

    pipe = build_tiny_pipeline("sd3", seed=0)
    assert isinstance(pipe, StableDiffusion3Pipeline)
    kwargs = dict(prompt="a red circle", num_inference_steps=2, height=32, width=32, guidance_scale=1.0,
                  max_sequence_length=8, output_type="np")
    base = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    pipe.load_lora_weights(str(tmp_path / "lora"))
    with_lora = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    with torch.no_grad():
        reference = ref_pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    assert np.abs(with_lora - base).max() > 0
    np.testing.assert_allclose(with_lora, reference, atol=1e-5)


@pytest.mark.xdist_group("fsdp2_launch")
def test_fsdp2_weight_gathers_fall_with_timesteps_per_pass(fsdp2_run):
    """The trainer's replay of a micro-batch of T = 3 recorded steps on the FSDP2-sharded transformer: each unit
    gathers its weights once per forward and once more in the backward (resharded after the forward), so per
    micro-batch 2 T times at train_timesteps_per_pass 1, 2 ceil(T / K) at K; the gradients are the same."""
    _, ranks = fsdp2_run
    for rank in ranks:
        replay = rank["replay"]
        steps, gathers = replay["recorded_steps"], replay["gathers"]
        assert steps == 3
        for unit in ("block", "transformer"):
            assert [gathers[k][unit] for k in ("1", "2", "all")] == [2 * 3, 2 * 2, 2 * 1], (unit, gathers)
        for setting, diff in replay["grad_diff"].items():
            assert diff <= 1e-6 * replay["grad_max"], (setting, diff, replay["grad_max"])
        assert replay["grad_max"] > 0
