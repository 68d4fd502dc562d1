r"""DiffusionOPDTrainer: diffusion on-policy distillation (DiffusionOPD, arXiv 2605.15055; verl-omni ``distill_kl``,
UniRL ``DiffusionOPD``) on ``transformers.Trainer``.

One optimizer step (with the default ``steps_per_generation = gradient_accumulation_steps``):

1. *Rollout* (`OPDRollout`). The student samples its own trajectories, SDE steps (``noise_level``, ``sde_type``) in
   a window (``sde_window_size``; 0: every step but the last) as Flow-GRPO's rollout records them: x_j, x_{j+1},
   t_j and the noise levels of each window step.
2. *Rewards* are decoded and scored as every trainer's, and only logged (``reward``, ``rewards/<name>/...``): they
   play no part in the loss.
3. *Distillation.* For each micro-batch and each recorded step j (one backward per step; ``train_timesteps_per_pass``
   steps per forward and backward, their rows stacked, with `timestep_passes`), the frozen teacher replays
   the recorded state x_j at t_j without gradient (at its own guidance scale) and the student with gradient (at the
   rollout's); both velocities become transition means of the same SDE step, and `opd_loss` gives the KL between the
   two Gaussian transitions (``opd_kl: exact``, divided by the step's variance, or ``ode``, mean matching), averaged
   over the samples, then over the steps by the trainer. With ``beta > 0`` the analytic KL of the same step to the
   student's own base is added.

Teachers (``trainer.policy.teachers``, `flowgrpo.trainer.policy.teachers`): ``teacher_lora`` loads a LoRA as a second,
frozen adapter on the student's base (no second copy of the base), ``teacher_model_name_or_path`` another checkpoint
of the family, and ``teachers`` several LoRAs, one per domain: each generation batch is drawn from one domain (the
train dataset's ``dataset_name`` column; `DomainRepeatSampler`, the domains in the list's order, cycled) and
distilled from that domain's teacher. Without that column every teacher teaches on every prompt, one generation batch
each in turn.

Logged besides the shared keys: ``opd_kl`` (the loss), ``opd/teacher`` (which teacher the batch was distilled from),
``opd_kl/<dataset_name>`` with several teachers, ``kl`` (beta > 0), ``sde_window_start``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from ...models.defaults import generation_card_lines
from ...schedulers import sample_sde_window, sde_transition
from ..data.sampler import DomainRepeatSampler
from ..online_trainer import LossPart, OnlineRLTrainer
from ..rollout.strategies import RolloutStrategy
from ..seeds import seed_for
from ..timestep_passes import split_rows, stack_embeds, stack_rows
from .flow_grpo_loss import gaussian_kl
from .opd_config import DiffusionOPDConfig
from .opd_loss import opd_loss

__all__ = ["DOMAIN_COLUMN", "DiffusionOPDTrainer", "OPDRollout"]

#: the train dataset's column that names each prompt's domain, matched against the teachers' ``dataset_name``
DOMAIN_COLUMN = "dataset_name"


class OPDRollout(RolloutStrategy):
    """The student's SDE rollout: SDE steps of ``sde_type`` in a window of ``sde_window_size`` steps starting at
    random in the first half of the trajectory (drawn per generation from the seed), or on every step but the last
    (``sde_window_size: 0``); the window's transitions are recorded as Flow-GRPO's rollout records them."""

    def __init__(self, args: DiffusionOPDConfig):
        self.args = args
        self.sde_type = args.sde_type

    def scheduler_options(self) -> dict[str, Any]:
        return {"noise_level": self.args.noise_level, "sde_type": self.args.sde_type}

    def plan(self, gen_index: int, step: int) -> tuple[int, int]:
        args = self.args
        steps, size = args.num_inference_steps, args.sde_window_size
        window_range = None if size == 0 else [0, max(1, min(steps // 2, steps - size))]
        return sample_sde_window(steps, size, window_range,
                                 generator=torch.Generator().manual_seed(seed_for(args.seed, gen_index)))

    def rollout(self, engine, model, embeds, plan, generator, progress, group_ids, gen_index):
        args = self.args
        final, record = engine.sample(model, embeds, args.num_inference_steps, args.guidance_scale, args.noise_level,
                                      plan, generator, record=True, progress=progress)
        record["window"] = plan
        return final, record


class DiffusionOPDTrainer(OnlineRLTrainer):
    """On-policy distillation of a flow-matching pipeline from frozen teachers (see `OnlineRLTrainer` for the
    arguments; ``args``: a ``DiffusionOPDConfig``)."""

    _tag_names = ["diffusion-opd", "on-policy-distillation", "flowgrpo", "lora", "text-to-image", "diffusers"]
    _name = "DiffusionOPD"
    _paper = {
        "title": "DiffusionOPD: A Unified Perspective of On-Policy Distillation in Diffusion Models",
        "id": "2605.15055",
        "citation": (
            "@article{li2026diffusionopd,\n  title={DiffusionOPD: A Unified Perspective of On-Policy Distillation in "
            "Diffusion Models},\n  author={Li, Quanhao and others},\n  journal={arXiv preprint arXiv:2605.15055},\n"
            "  year={2026}\n}"
        ),
    }
    _config_class = DiffusionOPDConfig

    def __init__(self, model: Any, reward_funcs: Any, args: DiffusionOPDConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, peft_config: Any = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), pipeline_kwargs: dict | None = None):
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         peft_config=peft_config, callbacks=callbacks, optimizers=optimizers,
                         pipeline_kwargs=pipeline_kwargs)
        #: the teachers as configured (`DiffusionOPDConfig.teacher_specs`), in the order of ``policy.teachers``
        self.teacher_specs = self.args.teacher_specs
        self.policy.build_teachers(self.teacher_specs, pipeline_kwargs)

    # ---- the algorithm's hooks ------------------------------------------------------------------------------------
    def _rollout_strategy(self, args: DiffusionOPDConfig) -> OPDRollout:
        return OPDRollout(args)

    def _check_datasets(self, index: dict | None, args: DiffusionOPDConfig, datasets: tuple) -> None:
        """Before anything is loaded: the teachers' sources exist (local paths), a teacher base is of the student's
        family, and each teacher's domain has prompts in the train dataset."""
        from ...models import family_adapter_class
        from ..policy.loading import read_pipeline_index

        for spec in args.teacher_specs:
            if spec.model_name_or_path:
                teacher_index = read_pipeline_index(spec.model_name_or_path, {})
                if index and teacher_index and "_class_name" in index and "_class_name" in teacher_index:
                    student_family = family_adapter_class(index["_class_name"])
                    teacher_family = family_adapter_class(teacher_index["_class_name"])
                    if student_family is not teacher_family:
                        raise ValueError(f"teacher_model_name_or_path={spec.model_name_or_path!r} is a "
                                         f"{teacher_index['_class_name']}; the student is a {index['_class_name']}. "
                                         "The teacher must be of the student's family (same latents and text "
                                         "encoders).")
            if spec.lora and _looks_local(spec.lora) and not os.path.exists(os.path.expanduser(spec.lora)):
                raise ValueError(f"The teacher LoRA {spec.lora!r} does not exist: give the folder a trainer exported "
                                 "(pytorch_lora_weights.safetensors), a .safetensors file or a Hub id.")
        row_domains = _row_domains(datasets[0])
        domains = [spec.dataset_name for spec in args.teacher_specs if spec.dataset_name is not None]
        if row_domains is None or not domains:
            return
        present = set(row_domains)
        missing = [d for d in domains if d not in present]
        if missing:
            raise ValueError(f"teachers name the domains {missing}, which the train dataset's {DOMAIN_COLUMN!r} column "
                             f"does not hold (it holds {sorted(map(str, present))[:8]}); each teacher's dataset_name "
                             "must be one of the column's values.")
        if len(domains) > 1:
            unused = sorted(map(str, present - set(domains)))
            if unused:
                raise ValueError(f"The train dataset's prompts of domains {unused[:8]} have no teacher; add a teacher "
                                 "for each domain or leave those prompts out.")

    def _get_train_sampler(self, train_dataset=None):
        """One domain per generation batch, the teachers' domains in turn, when the dataset names each prompt's
        domain and several teachers have one."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        domains = [spec.dataset_name for spec in self.args.teacher_specs]
        row_domains = _row_domains(dataset)
        if len(domains) < 2 or any(d is None for d in domains) or row_domains is None:
            return super()._get_train_sampler(train_dataset)
        args = self.args
        return DomainRepeatSampler(row_domains, domains, num_generations=args.num_generations,
                                   prompts_per_generation=args.generation_batch_size // args.num_generations,
                                   repeat_count=args.num_iterations * args.steps_per_generation, shuffle=True,
                                   seed=args.seed)

    def _generate(self, inputs: list[dict]) -> list[dict]:
        """The student's rollouts, and which teacher distils them: the one of the batch's domain, else the teachers
        in turn, one generation batch each."""
        teacher = self._teacher_for(inputs, self._generation_index())
        records = super()._generate(inputs)
        for record in records:
            record["teacher"] = teacher
        return records

    def _teacher_for(self, inputs: Sequence[dict], generation: int) -> int:
        specs = self.teacher_specs
        if len(specs) > 1 and inputs and DOMAIN_COLUMN in inputs[0]:
            domains = {row[DOMAIN_COLUMN] for row in inputs}
            if len(domains) != 1:
                raise RuntimeError(f"A generation batch mixes the domains {sorted(map(str, domains))}; with several "
                                   "teachers each batch holds one domain (DomainRepeatSampler).")
            (domain,) = domains
            for index, spec in enumerate(specs):
                if spec.dataset_name == domain:
                    return index
            raise RuntimeError(f"No teacher for domain {domain!r}.")
        return generation % len(specs)

    def _loss_parts(self, batch: dict) -> int:
        return batch["latents"].shape[1]

    def _pass_losses(self, model, batch: dict, parts: list[int], first_pass: bool) -> list[LossPart]:
        """The losses of the recorded steps ``parts``: the teacher's, the student's and (beta > 0) the reference's
        forwards each run once over the steps' states stacked (`timestep_passes`); each step's loss is `opd_loss` of
        its own rows."""
        args = self.args
        height, width = args.image_size
        policy = self.policy
        index = int(batch["teacher"])
        spec = self.teacher_specs[index]
        states = [batch["latents"][:, j] for j in parts]
        next_states = [batch["next_latents"][:, j] for j in parts]
        timesteps = [batch["timesteps"][:, j] for j in parts]
        x, t = stack_rows(states), stack_rows(timesteps)
        embeds = stack_embeds(batch["embeds"], [None] * len(parts))
        sde = self.rollouts.sde_settings()
        with self.accelerator.autocast():
            v_teacher = policy.teacher_velocity(model, index, x, t, embeds, spec.guidance_scale, height, width)
            v = policy.velocity(model, x, t, embeds, args.guidance_scale, height, width)
        self.rollouts.resolve_scoring()  # the rewards are only logged; scored while the forwards ran
        sizes = [len(state) for state in states]
        references = [None] * len(parts)
        if args.beta > 0:
            with self.accelerator.autocast():
                references = split_rows(policy.reference_velocity(model, x, t, embeds, height, width), sizes)

        def step(i: int, velocity: torch.Tensor):
            """The SDE transition of recorded step ``parts[i]`` with ``velocity``, to the recorded next state."""
            j = parts[i]
            return sde_transition(velocity, states[i], batch["sigmas"][:, j], batch["sigmas_next"][:, j], sde,
                                  next_state=next_states[i])

        losses = []
        for i, (velocity, teacher) in enumerate(zip(split_rows(v, sizes), split_rows(v_teacher, sizes))):
            student = step(i, velocity)
            with torch.no_grad():
                teacher_mean = step(i, teacher).prev_sample_mean
            out = opd_loss(student.prev_sample_mean, teacher_mean, student.std, args.opd_kl)
            loss = out.loss
            metrics = {"opd_kl": float(out.loss.detach()), "opd/teacher": float(index),
                       "sde_window_start": float(batch["window"][0])}
            if len(self.teacher_specs) > 1 and spec.dataset_name is not None:
                metrics[f"opd_kl/{spec.dataset_name}"] = float(out.loss.detach())
            if args.beta > 0:
                with torch.no_grad():
                    ref_mean = step(i, references[i]).prev_sample_mean
                kl = gaussian_kl(student.prev_sample_mean, ref_mean, student.std).mean()
                loss = loss + args.beta * kl
                metrics["kl"] = float(kl.detach())
            losses.append(LossPart(loss, metrics))
        return losses

    def _card_setup_lines(self) -> list[str]:
        args = self.args
        teachers = "; ".join(
            (f"LoRA {s.lora}" if s.lora else f"model {s.model_name_or_path}") + f" at guidance {s.guidance_scale:g}"
            + (f" for {s.dataset_name}" if s.dataset_name else "") for s in self.teacher_specs)
        return [
            f"- algorithm: {self._name} (on-policy distillation, opd_kl={args.opd_kl}; rewards logged, not trained on)",
            f"- teachers: {teachers}",
            f"- student rollouts: {args.sde_type}, noise level {args.noise_level}, "
            f"{'window ' + str(args.sde_window_size) if args.sde_window_size else 'all steps'}, group size "
            f"{args.num_generations}, {args.num_inference_steps} sampling steps, guidance {args.guidance_scale}, "
            f"{args.height}x{args.width}",
            *generation_card_lines(self),
            f"- beta (KL to the base) {args.beta}, learning rate {args.learning_rate}",
        ]


def _row_domains(dataset: Any) -> list | None:
    """Each row's domain (the ``dataset_name`` column), or None when the dataset has no such column."""
    if dataset is None or len(dataset) == 0:
        return None
    data = getattr(dataset, "data", dataset)
    names = getattr(data, "column_names", None)
    if names is not None:
        return list(data[DOMAIN_COLUMN]) if DOMAIN_COLUMN in names else None
    first = dataset[0]
    if not isinstance(first, dict) or DOMAIN_COLUMN not in first:
        return None
    return [dataset[i].get(DOMAIN_COLUMN) for i in range(len(dataset))]


def _looks_local(value: str) -> bool:
    """Whether a teacher LoRA source can only be a local path (a Hub id is ``namespace/name``)."""
    import os

    parts = value.strip("/").split("/")
    return value.startswith((".", "/", "~")) or value.endswith(".safetensors") or len(parts) > 2 or \
        (len(parts) == 2 and os.path.isdir(parts[0]))
