"""DiffusionOPDTrainer on the tiny SD3 pipeline: teachers loaded as diffusers loads them (a second adapter, a merged
copy, another checkpoint), the loss as `opd_loss` computes it from the recorded states, one domain per batch with
several teachers, and bad teachers refused before anything loads."""

import os

import pytest
import torch
from datasets import Dataset
from diffusers import DiffusionPipeline
from support.trainer_cases import PROMPTS, lora_config, make_args, redness_reward, teacher_lora_folder

from flowgrpo import DiffusionOPDConfig, DiffusionOPDTrainer
from flowgrpo.schedulers import sde_step_from_sigmas
from flowgrpo.trainer.algorithms.opd_loss import opd_loss
from flowgrpo.trainer.data.sampler import DomainRepeatSampler


def make_opd(path, tmp_path, peft=True, dataset=None, reward=redness_reward, **kwargs):
    kwargs.setdefault("sde_window_size", 2)
    if not any(kwargs.get(k) for k in ("teacher_lora", "teacher_model_name_or_path", "teachers")):
        kwargs["teacher_lora"] = str(teacher_lora_folder(path))
    return DiffusionOPDTrainer(model=str(path), reward_funcs=reward, args=make_args(tmp_path, DiffusionOPDConfig,
                                                                                   **kwargs),
                               train_dataset=dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS}),
                               peft_config=lora_config() if peft else None)


def probe(trainer, seed=0):
    """A state, a timestep and embeddings to compare velocities at."""
    adapter = trainer.adapter
    embeds = adapter.encode_prompts(PROMPTS[:2], 16, torch.device("cpu"))
    x = adapter.prepare_latents(2, 64, 64, torch.Generator().manual_seed(seed), torch.device("cpu"), torch.float32)
    return x, torch.full((2,), 700.0), embeds


def stock_velocity(pipe, x, t, embeds):
    with torch.no_grad():
        return pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds.tensors["prompt_embeds"],
                                pooled_projections=embeds.tensors["pooled_prompt_embeds"]).sample.float()


def test_teacher_lora_is_a_frozen_second_adapter_as_diffusers_loads_it(tiny_sd3_path, tmp_path):
    folder = teacher_lora_folder(tiny_sd3_path)
    trainer = make_opd(tiny_sd3_path, tmp_path)
    model = trainer.policy.unwrapped
    assert list(model.peft_config) == ["default", "teacher0"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    x, t, embeds = probe(trainer)
    with torch.no_grad():
        student_before = trainer.policy.velocity(trainer.model, x, t, embeds, 1.0, 64, 64)
    teacher = trainer.policy.teacher_velocity(trainer.model, 0, x, t, embeds, 1.0, 64, 64)
    stock = DiffusionPipeline.from_pretrained(str(tiny_sd3_path))
    base = stock_velocity(stock, x, t, embeds)
    stock.load_lora_weights(str(folder))
    torch.testing.assert_close(teacher, stock_velocity(stock, x, t, embeds), rtol=1e-4, atol=1e-5)
    assert (teacher - base).abs().max() > 1e-3  # the teacher is not the base
    with torch.no_grad():  # the student is back, its adapter trainable again
        torch.testing.assert_close(trainer.policy.velocity(trainer.model, x, t, embeds, 1.0, 64, 64), student_before)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    # exports and checkpoints hold the student only
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    from safetensors import safe_open

    with safe_open(os.path.join(out, "pytorch_lora_weights.safetensors"), "pt") as f:
        assert not any("teacher" in k for k in f.keys())
    assert not os.path.exists(os.path.join(out, "teacher0"))
    assert "teacher0" not in open(os.path.join(out, "adapter_config.json")).read()
    trainer.create_model_card()
    card = open(os.path.join(out, "README.md")).read()
    assert "DiffusionOPD" in card and "2605.15055" in card and str(folder) in card


def test_the_loss_is_the_kl_between_the_students_and_the_teachers_transitions(tiny_sd3_path, tmp_path):
    trainer = make_opd(tiny_sd3_path, tmp_path / "a", learning_rate=1e-2, teacher_guidance_scale=2.0)
    twin = make_opd(tiny_sd3_path, tmp_path / "b", teacher_guidance_scale=2.0)  # the same initial student
    trainer.train()
    record = trainer.buffer[0]
    args = trainer.args
    fallback = float(trainer.rollouts.scheduler.sigmas[1])
    kls = []
    for j in range(record["latents"].shape[1]):
        x, t = record["latents"][:, j], record["timesteps"][:, j]

        def mean(v, x=x, j=j):
            return sde_step_from_sigmas(v, x, record["sigmas"][:, j], record["sigmas_next"][:, j],
                                        prev_sample=record["next_latents"][:, j], noise_level=args.noise_level,
                                        sigma_max_fallback=fallback)

        with torch.no_grad():
            student = mean(twin.policy.velocity(twin.model, x, t, record["embeds"], 1.0, 64, 64))
        teacher = mean(twin.policy.teacher_velocity(twin.model, 0, x, t, record["embeds"], 2.0, 64, 64))
        kls.append(opd_loss(student.prev_sample_mean, teacher.prev_sample_mean, student.std, "exact").loss)
    log = next(h for h in trainer.state.log_history if "opd_kl" in h)
    assert log["opd_kl"] == pytest.approx(float(torch.stack(kls).mean()), rel=1e-4)
    assert log["opd_kl"] > 0 and log["opd/teacher"] == 0.0 and "reward" in log  # rewards are logged


def test_a_teacher_equal_to_the_student_gives_zero_kl(tiny_sd3_path, tmp_path):
    from peft import get_peft_model

    from flowgrpo.trainer.outputs.lora_export import save_diffusers_lora

    pipe = DiffusionPipeline.from_pretrained(str(tiny_sd3_path))
    zero = get_peft_model(pipe.transformer, lora_config())  # B = 0: the base, as the student starts
    save_diffusers_lora(type(pipe), tmp_path / "zero", zero)
    trainer = make_opd(tiny_sd3_path, tmp_path, teacher_lora=str(tmp_path / "zero"), opd_kl="ode", max_steps=1)
    trainer.train()
    assert next(h for h in trainer.state.log_history if "opd_kl" in h)["opd_kl"] == 0.0


def test_several_teachers_one_domain_a_batch_in_turn(tiny_sd3_path, tmp_path):
    seen = []

    def reward(prompts, images, dataset_name=None, **columns):
        seen.append(sorted(set(dataset_name)))
        return redness_reward(prompts, images)

    data = Dataset.from_dict({"prompt": PROMPTS, "dataset_name": ["ocr", "geneval"] * 4})
    teachers = [{"lora": str(teacher_lora_folder(tiny_sd3_path, seed=1)), "dataset_name": "geneval"},
                {"lora": str(teacher_lora_folder(tiny_sd3_path, seed=2)), "dataset_name": "ocr",
                 "guidance_scale": 3.0}]
    trainer = make_opd(tiny_sd3_path, tmp_path, dataset=data, reward=reward, teachers=teachers, max_steps=4,
                       num_generations=2)
    assert isinstance(trainer._get_train_sampler(), DomainRepeatSampler)
    trainer.train()
    assert seen == [["geneval"], ["ocr"], ["geneval"], ["ocr"]]
    logged = [h["opd/teacher"] for h in trainer.state.log_history if "opd/teacher" in h]
    assert logged == [0.0, 1.0, 0.0, 1.0]
    assert {k for h in trainer.state.log_history for k in h if k.startswith("opd_kl/")} == {"opd_kl/geneval",
                                                                                          "opd_kl/ocr"}
    # the two teachers differ, and the second replays at its own guidance
    x, t, embeds = probe(trainer)
    a = trainer.policy.teacher_velocity(trainer.model, 0, x, t, embeds, 1.0, 64, 64)
    b = trainer.policy.teacher_velocity(trainer.model, 1, x, t, embeds, 1.0, 64, 64)
    assert (a - b).abs().max() > 1e-3
    assert trainer.teacher_specs[1].guidance_scale == 3.0 and trainer.teacher_specs[0].guidance_scale == 1.0


def test_domain_sampler_streams_each_domain_and_continues_over_epochs():
    domains = ["a", "b", "a", "b", "a", "c", "c", "c"]
    sampler = DomainRepeatSampler(domains, ["a", "b", "c"], num_generations=2, prompts_per_generation=2,
                                  repeat_count=1, seed=3)
    first = list(sampler)
    assert len(first) == len(sampler) == 16  # 4 generations of 2 prompts x 2 images, as a RepeatSampler's epoch
    chunks = [first[k:k + 4] for k in range(0, 16, 4)]
    assert [domains[c[0]] for c in chunks] == ["a", "b", "c", "a"]
    for chunk in chunks:
        assert chunk[0] == chunk[1] and chunk[2] == chunk[3] and chunk[0] != chunk[2]
        assert domains[chunk[0]] == domains[chunk[2]]
    # domain a's stream goes on: generation 3 takes the prompts after generation 0's (a fresh pass after 3 prompts)
    assert chunks[3][0] != chunks[0][0] or chunks[3][2] != chunks[0][2]
    sampler.set_epoch(1)  # generations 4-7 of the run: domains b, c, a, b
    second = list(sampler)
    assert [domains[second[k]] for k in range(0, 16, 4)] == ["b", "c", "a", "b"]
    assert second == list(sampler)  # a function of the epoch
    with pytest.raises(ValueError, match="fewer prompts"):
        DomainRepeatSampler(domains, ["a", "b"], num_generations=2, prompts_per_generation=3)


def test_without_a_domain_column_the_teachers_take_turns(tiny_sd3_path, tmp_path):
    teachers = [{"lora": str(teacher_lora_folder(tiny_sd3_path, seed=1)), "dataset_name": "shape"},
                {"lora": str(teacher_lora_folder(tiny_sd3_path, seed=2)), "dataset_name": "color"}]
    trainer = make_opd(tiny_sd3_path, tmp_path, teachers=teachers, max_steps=3)
    trainer.train()
    assert [h["opd/teacher"] for h in trainer.state.log_history if "opd/teacher" in h] == [0.0, 1.0, 0.0]


def test_teacher_of_another_checkpoint_shares_the_students_components(tiny_sd3_path, tmp_path):
    from flowgrpo.testing import cached_tiny_pipeline_path

    other = cached_tiny_pipeline_path("sd3", seed=1)
    trainer = make_opd(tiny_sd3_path, tmp_path, teacher_model_name_or_path=str(other))
    (teacher,) = trainer.policy.teachers
    assert not any(p.requires_grad for p in teacher.module.parameters())
    x, t, embeds = probe(trainer)
    velocity = trainer.policy.teacher_velocity(trainer.model, 0, x, t, embeds, 1.0, 64, 64)
    torch.testing.assert_close(velocity, stock_velocity(DiffusionPipeline.from_pretrained(str(other)), x, t, embeds),
                               rtol=1e-4, atol=1e-5)
    trainer.train()


def test_full_finetuning_student_gets_a_merged_copy_of_the_teacher(tiny_sd3_path, tmp_path):
    folder = teacher_lora_folder(tiny_sd3_path)
    trainer = make_opd(tiny_sd3_path, tmp_path, peft=False, learning_rate=1e-4)
    x, t, embeds = probe(trainer)
    stock = DiffusionPipeline.from_pretrained(str(tiny_sd3_path))
    stock.load_lora_weights(str(folder))
    torch.testing.assert_close(trainer.policy.teacher_velocity(trainer.model, 0, x, t, embeds, 1.0, 64, 64),
                               stock_velocity(stock, x, t, embeds), rtol=1e-4, atol=1e-5)
    trainer.train()
    # the student moved, the teacher did not
    torch.testing.assert_close(trainer.policy.teacher_velocity(trainer.model, 0, x, t, embeds, 1.0, 64, 64),
                               stock_velocity(stock, x, t, embeds), rtol=1e-4, atol=1e-5)


def test_bad_teachers_are_refused_before_loading(tiny_sd3_path, tiny_flux_path, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_opd(tiny_sd3_path, tmp_path, teacher_lora=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="student's family"):
        make_opd(tiny_sd3_path, tmp_path, teacher_model_name_or_path=str(tiny_flux_path))
    lora = str(teacher_lora_folder(tiny_sd3_path))
    data = Dataset.from_dict({"prompt": PROMPTS, "dataset_name": ["ocr"] * 8})
    with pytest.raises(ValueError, match="does not hold"):
        make_opd(tiny_sd3_path, tmp_path, dataset=data,
                 teachers=[{"lora": lora, "dataset_name": "ocr"}, {"lora": lora, "dataset_name": "geneval"}])
    with pytest.raises(ValueError, match="does not fit"):
        make_opd(tiny_sd3_path, tmp_path, teacher_lora=str(teacher_lora_folder(tiny_flux_path)))
