"""The memory savers of recipes/sd35m_24gb.yaml that run on a CPU: the prompt-embedding cache, text-encoder offload
and sliced VAE decoding, on the tiny SD3 pipeline.

This machine has no accelerator, so the trainer's device is the CPU and "off the accelerator" cannot be seen from
where the weights are; the offload is checked through ``TextEncoderOffload``'s own record of its moves (every
``.to()`` it makes), and its peak-memory effect is measured by the ``memory/sd35m_24gb`` GPU check.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from flowgrpo import FlowGRPOConfig, FlowGRPOTrainer
from flowgrpo.models import PromptEmbeds
from flowgrpo.models.base import pad_rows_to_longest
from flowgrpo.trainer.data.prompt_cache import PromptEmbeddingCache, prompt_cache_key
from flowgrpo.trainer.rollout.sliced_decode import decode_in_slices

TRAIN = ["a red circle", "two blue squares", 'a sign that says "hi"', "a green triangle"]
EVAL = ["a red circle", "a purple star"]


def brightness(prompts, images, **columns):
    return [float(torch.tensor(list(im.getdata()), dtype=torch.float32).mean() / 255) for im in images]


def make_trainer(path, tmp_path, **kwargs):
    args = dict(
        output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=4, num_generations=2,
        resolution=64, num_inference_steps=3, eval_num_inference_steps=2, guidance_scale=1.0, max_steps=1,
        learning_rate=1e-2, beta=0.0, max_sequence_length=16, logging_steps=1, save_strategy="no", disable_tqdm=True,
        seed=0, log_images_steps=0, dtype="float32", per_device_eval_batch_size=4, cache_prompt_embeddings=True,
    )
    args.update(kwargs)
    return FlowGRPOTrainer(
        model=str(path), reward_funcs=brightness, args=FlowGRPOConfig(**args),
        train_dataset=Dataset.from_dict({"prompt": TRAIN}), eval_dataset=Dataset.from_dict({"prompt": EVAL}),
        peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                               target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
    )


def count_encodes(trainer) -> Counter:
    seen: Counter = Counter()
    original = trainer.adapter.encode_prompts

    def counting(prompts, *args, **kwargs):
        seen.update(prompts)
        return original(prompts, *args, **kwargs)

    trainer.adapter.encode_prompts = counting
    return seen


def test_each_prompt_encoded_once_over_steps_and_evaluation(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, max_steps=3)
    seen = count_encodes(trainer)
    drawn = []
    original = trainer._generate
    trainer._generate = lambda inputs: (drawn.extend(r["prompt"] for r in inputs), original(inputs))[1]
    trainer.train()
    first = trainer.evaluate()
    second = trainer.evaluate()
    assert len(drawn) == 3 * 4  # 3 generation batches of 2 prompts x 2 images
    assert set(seen) == set(drawn) | set(EVAL)
    assert max(seen.values()) == 1, seen  # nothing encoded twice: 6 prompt draws from 4 prompts, two evaluations
    cache = trainer.rollouts.prompt_cache
    assert cache.encoded == len(seen) and cache.hits >= 2 + len(EVAL)
    assert first["eval_reward"] == second["eval_reward"]  # the cached embeddings equal the encoded ones


def test_precompute_offload_and_sliced_decode_keep_the_first_pass_ratio_one(tiny_sd3_path, tmp_path):
    trainer = make_trainer(tiny_sd3_path, tmp_path, precompute_prompt_embeddings=True, offload_text_encoders=True,
                           vae_decode_batch_size=1, guidance_scale=3.0, beta=0.04)
    cache, offload = trainer.rollouts.prompt_cache, trainer.rollouts.prompt_cache.offload
    assert len(cache) == cache.encoded == len(set(TRAIN) | set(EVAL))  # every dataset prompt, each once
    assert set(offload.modules) == {"text_encoder", "text_encoder_2", "text_encoder_3"}
    assert offload.offloaded and offload.history == [("offload", "cpu")]
    assert set(offload.devices().values()) == {"cpu"}
    seen = count_encodes(trainer)

    trainer.train()
    log = [h for h in trainer.state.log_history if "ratio_mean" in h][0]
    assert log["on_policy_ratio_max_dev"] < 1e-5 and abs(log["ratio_mean"] - 1) < 1e-5
    assert log["kl"] == pytest.approx(0.0, abs=1e-10)
    trainer.evaluate()
    assert not seen and offload.visits == 0  # training and evaluation ran without the text encoders

    # A prompt that is not cached still works: the encoders visit the device once, then leave again.
    unseen = Dataset.from_dict({"prompt": ["an orange hexagon", "a red circle"]})
    trainer.evaluate(unseen)
    assert dict(seen) == {"an orange hexagon": 1}
    assert offload.visits == 1 and offload.offloaded
    assert offload.history[-2:] == [("visit", str(trainer.accelerator.device)), ("offload", "cpu")]
    trainer.evaluate(unseen)
    assert offload.visits == 1 and cache.stats()["encoder_visits"] == 1


def test_sliced_decode_equals_one_decode(tiny_sd3_path):
    from diffusers import DiffusionPipeline

    from flowgrpo.models import get_family_adapter

    adapter = get_family_adapter(DiffusionPipeline.from_pretrained(str(tiny_sd3_path)))
    latents = adapter.prepare_latents(5, 64, 64, torch.Generator().manual_seed(0), torch.device("cpu"), torch.float32)
    whole = adapter.decode(latents, 64, 64)
    for size in (1, 2, 5, None):  # equal up to float32 rounding: conv kernels pick their algorithm by batch size
        torch.testing.assert_close(decode_in_slices(adapter.decode, latents, 64, 64, size), whole, rtol=0, atol=2e-5)
    assert not torch.equal(whole[0], whole[1])


def test_cache_keys_bounds_and_bad_settings(tmp_path):
    from PIL import Image

    calls = []

    def encode(prompts, device, conditions=None):  # a deterministic stand-in encoder: one row per prompt
        calls.append(list(prompts))
        extra = [0.0] * len(prompts) if conditions is None else [10.0 * (c is not None) for c in conditions]
        return PromptEmbeds({"prompt_embeds": torch.tensor([[len(p) + e] for p, e in zip(prompts, extra)])})

    red, blue = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    assert prompt_cache_key("a", red) == prompt_cache_key("a", Image.new("RGB", (4, 4), "red"))
    assert prompt_cache_key("a", red) != prompt_cache_key("a", blue) != prompt_cache_key("a")
    cache = PromptEmbeddingCache(encode, "cpu", capacity=2)
    embeds, rows = cache.encode_unique(["ab", "ab", "c"], conditions=[red, blue, None])
    assert rows.tolist() == [0, 1, 2] and embeds.tensors["prompt_embeds"].flatten().tolist() == [12.0, 12.0, 1.0]
    assert len(cache) == 2 and cache.evicted == 1  # bounded: the least recently used entry went
    cache.encode_unique(["c"])
    assert calls[-1] == ["ab", "ab", "c"] and cache.hits == 1
    with pytest.raises(ValueError, match="prompt_cache_size=2"):
        cache.precompute(["x", "y", "z"])

    base = dict(output_dir=str(tmp_path), report_to=[], per_device_train_batch_size=2, num_generations=2)
    with pytest.raises(ValueError, match="offload_text_encoders=True needs cache_prompt_embeddings"):
        FlowGRPOConfig(**base, offload_text_encoders=True)
    with pytest.raises(ValueError, match="vae_decode_batch_size=0"):
        FlowGRPOConfig(**base, vae_decode_batch_size=0)
    args = FlowGRPOConfig(**base, cache_prompt_embeddings=True, precompute_prompt_embeddings=True,
                          prompt_cache_size=3)
    with pytest.raises(ValueError, match="4 distinct prompts but prompt_cache_size=3"):  # before any model load
        FlowGRPOTrainer(model="/nonexistent", reward_funcs=brightness, args=args,
                        train_dataset=Dataset.from_dict({"prompt": TRAIN}))


@pytest.mark.parametrize("family", ["qwenimage", "qwenimage21"])
def test_rows_of_different_lengths_give_the_velocity_of_one_batched_encoding(family, tiny_pipeline_path):
    """Qwen-Image's encoders pad a batch only to its longest prompt: prompts encoded in separate calls are cached with
    different lengths, padded (embeddings and masks with zeros) when looked up together, and the transformer sees
    what it sees for the batched encoding."""
    from diffusers import DiffusionPipeline

    from flowgrpo.models import get_family_adapter

    pipe = DiffusionPipeline.from_pretrained(str(tiny_pipeline_path(family)))
    adapter, cpu = get_family_adapter(pipe), torch.device("cpu")
    prompts = ["a cat", "a very large red balloon floating over a quiet mountain lake at dawn", "two dogs"]
    cache = PromptEmbeddingCache(lambda p, device: adapter.encode_prompts(p, 64, device), cpu)
    with torch.no_grad():
        batched = adapter.encode_prompts(prompts, 64, cpu)
        lengths = [len(cache.encode_unique([p])[0].tensors["prompt_embeds"][0]) for p in prompts]  # one call each
        cached, rows = cache.encode_unique(prompts)
        assert cache.encoded == 3 and cache.hits == 3 and rows.tolist() == [0, 1, 2]
        assert len(set(lengths)) == 3  # three different lengths: torch.cat alone cannot stack them
        for name, tensor in batched.tensors.items():
            torch.testing.assert_close(cached.tensors[name], tensor, rtol=0, atol=1e-5)  # zeros where it pads
        assert cached.tensors["prompt_embeds_mask"].sum(1).tolist() == lengths

        adapter.set_timesteps(pipe.scheduler, 2, 64, 64, cpu)
        latents = adapter.prepare_latents(3, 64, 64, torch.Generator().manual_seed(0), cpu, torch.float32)
        timestep = pipe.scheduler.timesteps[:1].expand(3)
        want = adapter.predict_velocity(pipe.transformer, latents, timestep, batched, 1.0, None, 64, 64)
        got = adapter.predict_velocity(pipe.transformer, latents, timestep, cached, 1.0, None, 64, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert want.abs().mean() > 1e-2


def test_qwenimage_trains_from_prompts_cached_one_at_a_time(tiny_pipeline_path, tmp_path):
    """The trainer with every prompt precomputed on its own (rows of four lengths) samples what it samples without
    the cache: same rewards."""
    prompts = ["a cat", "a very large red balloon floating over a quiet mountain lake at dawn", "two dogs",
               "a long and detailed description of a small wooden house by a river on an autumn evening"]
    rewards = {}
    for cached in (False, True):
        args = FlowGRPOConfig(
            output_dir=str(tmp_path / str(cached)), report_to=[], per_device_train_batch_size=4, num_generations=2,
            resolution=64, num_inference_steps=3, guidance_scale=3.0, negative_prompt="", max_steps=2, beta=0.0,
            max_sequence_length=64, logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0, log_images_steps=0,
            dtype="float32", cache_prompt_embeddings=cached, precompute_prompt_embeddings=cached,
            per_device_eval_batch_size=1)
        trainer = FlowGRPOTrainer(model=str(tiny_pipeline_path("qwenimage")), reward_funcs=brightness, args=args,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))
        trainer.train()
        rewards[cached] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        if cached:
            assert trainer.rollouts.prompt_cache.encoded == 4 and trainer.rollouts.prompt_cache.misses == 0
    assert len(rewards[True]) == 2 and rewards[True] == pytest.approx(rewards[False], abs=1e-4)


def test_ragged_rows_are_padded_only_where_a_mask_marks_the_padding():
    short = {"prompt_embeds": torch.ones(1, 2, 3), "prompt_embeds_mask": torch.ones(1, 2, dtype=torch.long),
             "image_pad_mask": torch.tensor([[1, 0]]), "pooled": torch.ones(1, 4)}
    long = {"prompt_embeds": torch.full((1, 4, 3), 2.0), "prompt_embeds_mask": torch.ones(1, 4, dtype=torch.long),
            "image_pad_mask": torch.tensor([[0, 1, 1, 0]]), "pooled": torch.zeros(1, 4)}
    batch = pad_rows_to_longest([short, long])
    assert batch["prompt_embeds"].shape == (2, 4, 3) and batch["pooled"].shape == (2, 4)
    assert batch["prompt_embeds"][0, 2:].abs().sum() == 0 and batch["prompt_embeds"][0, :2].eq(1).all()
    assert batch["prompt_embeds_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["image_pad_mask"].tolist() == [[1, 0, 0, 0], [0, 1, 1, 0]]
    with pytest.raises(ValueError, match="'prompt_embeds' have different lengths .2, 4. .*no mask"):
        pad_rows_to_longest([{"prompt_embeds": torch.ones(1, 2, 3)}, {"prompt_embeds": torch.ones(1, 4, 3)}])
    with pytest.raises(ValueError, match="differ beyond the sequence dimension"):
        pad_rows_to_longest([{"x": torch.ones(1, 2, 3), "x_mask": torch.ones(1, 2)},
                             {"x": torch.ones(1, 4, 5), "x_mask": torch.ones(1, 4)}])
    # batches of several rows (PromptEmbeds.cat: records of rollouts merged by dynamic sampling) pad the same way
    merged = PromptEmbeds.cat([PromptEmbeds({k: v.expand(2, *v.shape[1:]) for k, v in short.items()}),
                               PromptEmbeds(long)])
    assert merged.tensors["prompt_embeds_mask"].tolist() == [[1, 1, 0, 0]] * 2 + [[1, 1, 1, 1]]


def test_24gb_recipe_parses_into_the_memory_settings(monkeypatch, tmp_path):
    from transformers.training_args import OptimizerNames

    from flowgrpo.cli import build_peft_config, parse_recipe

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # restored after the test; the recipe's env: sets it
    # bf16 on a machine without a GPU needs use_cpu; quantization needs CUDA only when the trainer is built
    script_args, model_args, args = parse_recipe(["recipes/sd35m_24gb.yaml", "--use_cpu", "true"])
    assert model_args.model_name_or_path == "stabilityai/stable-diffusion-3.5-medium"
    assert (args.quantization, args.dtype, args.bf16) == ("4bit", "bfloat16", True)
    assert args.optim == OptimizerNames.ADAMW_BNB and args.activation_checkpointing
    assert args.cache_prompt_embeddings and args.offload_text_encoders and not args.precompute_prompt_embeddings
    assert (args.vae_decode_batch_size, args.prompt_cache_size) == (1, 1024)
    assert (args.resolution, args.per_device_train_batch_size, args.num_generations) == (512, 4, 8)
    assert args.generation_batch_size == 32 and args.steps_per_generation == 8
    assert script_args.reward_funcs == ["ocr"]
    import os

    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    peft = build_peft_config(model_args)
    assert (peft.r, peft.lora_alpha, peft.init_lora_weights) == (32, 64, "gaussian")
    if not torch.cuda.is_available():  # the quantized load needs CUDA: the trainer says so before loading anything
        args.output_dir = str(tmp_path)
        with pytest.raises(ValueError, match="quantization='4bit'.*CUDA"):
            FlowGRPOTrainer(model=model_args.model_name_or_path, reward_funcs=script_args.reward_funcs, args=args,
                            train_dataset=Dataset.from_dict({"prompt": TRAIN}), peft_config=peft)


@pytest.mark.parametrize("family", ["qwenimage_edit", "qwenimage_edit_plus"])
def test_cache_keeps_the_negative_of_each_source_image(family, tiny_pipeline_path, tmp_path):
    """Families whose negative prompt is encoded with the source image (true CFG) keep it in the cache too: the
    embeddings and negatives equal the uncached ones, and a second call (and another prompt with the same image)
    encodes no negative again. With the text encoders offloaded these calls reach the encoders only through the
    cache's visits, so a bypass would encode with the encoders away from the accelerator."""
    from support.family_cases import CASES, config_kwargs, dataset_rows

    case = next(c for c in CASES if c.name == family)
    rows = dataset_rows(case)
    results = {}
    for cached in (False, True):
        args = FlowGRPOConfig(output_dir=str(tmp_path / str(cached)),
                              **config_kwargs(case, negative_prompt=" ", cache_prompt_embeddings=cached,
                                              offload_text_encoders=cached))
        trainer = FlowGRPOTrainer(model=str(tiny_pipeline_path(family)), reward_funcs=brightness, args=args,
                                  train_dataset=Dataset.from_dict(rows),
                                  peft_config=LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian"))
        seen = count_encodes(trainer)
        prompts = [rows["prompt"][0], rows["prompt"][0], rows["prompt"][1]]
        images = [rows["image"][0], rows["image"][0], rows["image"][1]]
        with torch.no_grad():
            embeds, index = trainer.rollouts.encode_unique(prompts, images)
        assert index.tolist() == [0, 0, 1] and embeds.negative is not None
        results[cached] = embeds
        if cached:
            assert seen[" "] == 2  # one negative per distinct source image
            with torch.no_grad():  # again, and a new prompt on a source image already seen: no negative encoded
                again, _ = trainer.rollouts.encode_unique(prompts[:1] + ["a new prompt"],
                                                          images[:1] + images[:1])
            assert seen[" "] == 2 and seen["a new prompt"] == 1 and trainer.rollouts.prompt_cache.hits == 2  # (p0, im0), (" ", im0)
            for name, value in again.negative.tensors.items():
                assert torch.equal(value[0], embeds.negative.tensors[name][0]), name
    for name, value in results[False].tensors.items():
        assert torch.allclose(results[True].tensors[name], value, atol=1e-6), name
    for name, value in results[False].negative.tensors.items():
        assert torch.allclose(results[True].negative.tensors[name], value, atol=1e-6), name
