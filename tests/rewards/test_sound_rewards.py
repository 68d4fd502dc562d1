"""Rewards that score sound (``accepts_audio``): LTX-2's decoded audio reaches them, in rollouts and in evaluation, and
no other reward; a family without sound, or a dataset using the reserved column names, is refused before loading."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from PIL import Image
from support.family_cases import CASES, brightness_reward, config_kwargs, dataset_rows

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.rewards import AUDIO_COLUMNS, RewardSet, accepts_audio

LTX2 = next(c for c in CASES if c.name == "ltx2")


class Loudness:
    """RMS of the waveform; records what it was given."""

    accepts_audio = True
    accepts_video = True

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, images, audio, audio_sampling_rate, **columns):
        self.calls.append((list(audio), list(audio_sampling_rate), len(images), sorted(columns)))
        return [float(np.sqrt(np.mean(np.square(a)))) for a in audio]


def pictures_only(prompts, images, **columns):
    assert not set(columns) & set(AUDIO_COLUMNS), sorted(columns)
    return brightness_reward(prompts, images)


def test_reward_set_gives_the_sound_to_the_rewards_that_score_it_only():
    seen = {}

    def hears(prompts, images, **columns):
        seen["hears"] = sorted(columns)
        return [0.0] * len(prompts)

    hears.accepts_audio = True
    rewards = RewardSet([functools.partial(hears), pictures_only], ["hears", "pictures"])
    assert accepts_audio(rewards.funcs[0]) and not accepts_audio(pictures_only)
    assert rewards.audio_rewards == ["hears"]
    images = [Image.new("RGB", (4, 4))] * 2
    rewards(["a", "b"], images, audio=[np.zeros((1, 8), np.float32)] * 2, audio_sampling_rate=[16000] * 2, tag=["x", "y"])
    assert seen["hears"] == ["audio", "audio_sampling_rate", "tag"]


def test_ltx2_rollouts_and_evaluation_give_the_decoded_sound_to_the_reward(tiny_pipeline_path, tmp_path):
    loudness = Loudness()
    rows = dataset_rows(LTX2)
    args = FlowGRPOConfig(output_dir=str(tmp_path), reward_weights=[1.0, 1.0],
                          **config_kwargs(LTX2, per_device_eval_batch_size=2))
    trainer = FlowGRPOTrainer(model=str(tiny_pipeline_path("ltx2")), reward_funcs=[loudness, pictures_only],
                              args=args, train_dataset=Dataset.from_dict(rows),
                              eval_dataset=Dataset.from_dict({"prompt": rows["prompt"][:2]}),
                              peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))
    adapter = trainer.adapter
    rate = int(trainer.pipeline.vocoder.config.output_sampling_rate)
    assert adapter.audio_sampling_rate() == rate
    trainer.train()
    assert loudness.calls, "the sound reward was never called"
    waveforms, rates, n_videos, other = loudness.calls[0]
    assert len(waveforms) == len(rates) == n_videos and set(rates) == {rate} and other == []
    # The rollout's sound is what the adapter decodes from the same kind of state: (channels, samples), float32.
    gen = torch.Generator().manual_seed(0)
    height, width = args.image_size
    latents = adapter.prepare_latents(1, height, width, gen, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        expected = adapter.decode_audio(latents, height, width)
    assert all(w.dtype == np.float32 and w.shape == tuple(expected.shape[1:]) for w in waveforms)
    assert any(np.isfinite(h.get("rewards/Loudness/mean", np.nan)) for h in trainer.state.log_history)
    before = len(loudness.calls)
    metrics = trainer.evaluate()
    assert len(loudness.calls) > before and np.isfinite(metrics["eval_reward"])
    assert all(w.shape == tuple(expected.shape[1:]) for w in loudness.calls[-1][0])


def test_sound_rewards_are_refused_where_nothing_makes_sound(tiny_pipeline_path, tiny_sd3_path, tmp_path):
    loudness = Loudness()
    args = FlowGRPOConfig(output_dir=str(tmp_path / "a"), report_to=[], resolution=32, max_steps=1,
                          per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(ValueError, match=r"\['Loudness'\] score sound .*SD3Adapter generates none"):
        FlowGRPOTrainer(model=str(tiny_sd3_path), reward_funcs=[loudness], args=args,
                        train_dataset=Dataset.from_dict({"prompt": ["a cat", "a dog"]}))
    rows = {**dataset_rows(LTX2), "audio": ["ref.wav"] * 4}
    with pytest.raises(ValueError, match=r"train_dataset has the column\(s\) \['audio'\], reserved"):
        FlowGRPOTrainer(model=str(tiny_pipeline_path("ltx2")), reward_funcs=[loudness],
                        args=FlowGRPOConfig(output_dir=str(tmp_path / "b"), **config_kwargs(LTX2)),
                        train_dataset=Dataset.from_dict(rows))
    assert not loudness.calls
