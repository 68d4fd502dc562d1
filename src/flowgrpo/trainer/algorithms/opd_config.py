"""DiffusionOPDConfig: the settings of diffusion on-policy distillation, as a `transformers.TrainingArguments`
subclass.

The settings every online-RL trainer shares are those of `OnlineRLConfig`; this class adds on-policy distillation's
own (arXiv 2605.15055; verl-omni ``DistillKLLoss``, UniRL ``DiffusionOPD``): the student's SDE rollouts
(``noise_level``, ``sde_type``, ``sde_window_size``), the frozen teacher(s) that replay every recorded state
(``teacher_lora`` as a second adapter on the student's base, or ``teacher_model_name_or_path`` for another base, or
``teachers``: several LoRA teachers, one domain per generation batch, cycled) with their guidance, and the form of
the per-step KL between transition means (``opd_kl``). Rewards are only logged. The math:
``flowgrpo.trainer.algorithms.opd_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..algorithm_spec import (
    AlgorithmFacts,
    AlgorithmSpec,
    PlannedStep,
    PolicyCopy,
    RolloutRecord,
    TransitionProbe,
    WorkerNeeds,
)
from ..config_docs import document_config
from ..json_setting import decode_json_setting
from ..online_config import OnlineRLConfig, check_choice

#: the per-step KL's forms (opd_loss.py implements them)
OPD_KL_MODES = ("exact", "ode")
OPD_SDE_TYPES = ("sde", "cps", "dance")
TEACHER_KEYS = ("lora", "guidance_scale", "dataset_name")

__all__ = ["OPD_KL_MODES", "OPD_SDE_TYPES", "SPEC", "TEACHER_KEYS", "DiffusionOPDConfig", "TeacherSpec", "describe_opd"]


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher, resolved: a LoRA on the student's base (``lora``) or another base model
    (``model_name_or_path``), the guidance scale it replays at, and the dataset (domain) whose batches it teaches
    (None: every batch)."""

    lora: str | None
    model_name_or_path: str | None
    guidance_scale: float
    dataset_name: str | None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@document_config
@dataclass
class DiffusionOPDConfig(OnlineRLConfig):
    r"""Configuration for [`DiffusionOPDTrainer`]: the shared settings of [`OnlineRLConfig`] plus the student's SDE
    rollouts, the teacher(s) and the per-step KL (the math: ``flowgrpo.trainer.algorithms.opd_loss``)."""

    # ---- the teachers --------------------------------------------------------------------------------
    teacher_lora: str | None = field(
        default=None,
        metadata={"help": "The teacher as a LoRA folder or Hub id, loaded as a second, frozen adapter on the "
                          "student's base model (no second copy of the base): each recorded state is replayed with "
                          "that adapter active. Give one of teacher_lora, teacher_model_name_or_path, teachers."},
    )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The teacher as a different base model (a diffusers pipeline folder or Hub id of the same "
                          "family, e.g. a larger or fine-tuned model), loaded frozen next to the student."},
    )
    teacher_guidance_scale: float | None = field(
        default=None,
        metadata={"help": "CFG scale at which the teacher replays the student's states (teachers without their own "
                          "guidance_scale use it too). None: the student's guidance_scale."},
    )
    teachers: list | str | None = field(
        default=None,
        metadata={"help": "Several LoRA teachers, a list of {lora, guidance_scale, dataset_name} (JSON on the command "
                          "line): each generation batch is drawn from one teacher's dataset_name (a name in the "
                          "train dataset's 'dataset_name' column) and distilled from that teacher, cycling through "
                          "the list in order. This is how an OCR expert, a GenEval expert and a preference expert "
                          "merge into one student. lora is required; guidance_scale defaults to "
                          "teacher_guidance_scale; dataset_name is required with more than one teacher."},
    )
    opd_kl: str = field(
        default="exact",
        metadata={"help": "Per-step KL between the student's and the teacher's transition means: 'exact' "
                          "(mean((mu_S - mu_T)^2) / (2 s^2), s the step's transition std; needs noise_level > 0) or "
                          "'ode' (mean((mu_S - mu_T)^2) / 2, UniRL's mean matching)."},
    )

    # ---- the student's rollouts ----------------------------------------------------------------------
    noise_level: float = field(
        default=0.7,
        metadata={"help": "SDE noise level a of the student's rollouts (Flow-GRPO's: 0.7); the recorded steps are "
                          "the ones distilled. 0 samples by ODE (then opd_kl must be 'ode')."},
    )
    sde_type: str = field(
        default="sde",
        metadata={"help": "The student's stochastic sampler: 'sde' (Flow-GRPO's), 'cps' or 'dance', as in "
                          "FlowGRPOConfig."},
    )
    sde_window_size: int = field(
        default=0,
        metadata={"help": "Recorded (and distilled) SDE steps per rollout, a window at a random start in the first "
                          "half of the steps; 0 records every step but the last."},
    )
    beta: float = field(
        default=0.0,
        metadata={"help": "Weight of an extra KL to the student's own base (LoRA off). On-policy distillation has "
                          "none (0); the teacher is the anchor."},
    )

    _trainer_name = "DiffusionOPDTrainer"
    def _check_algorithm(self) -> None:
        check_choice("opd_kl", self.opd_kl, OPD_KL_MODES)
        check_choice("sde_type", self.sde_type, OPD_SDE_TYPES)
        if self.noise_level < 0:
            raise ValueError(f"noise_level={self.noise_level} must be >= 0.")
        if self.opd_kl == "exact" and self.noise_level == 0:
            raise ValueError("opd_kl='exact' divides by the step's transition std, which is 0 with noise_level=0 "
                             "(ODE rollouts); set noise_level > 0 (e.g. 0.7) or opd_kl: ode.")
        k = self.sde_window_size
        steps = self.num_inference_steps  # unset: the model's own, checked once the trainer has resolved it
        if not _is_int(k) or k < 0 or (steps is not None and k > steps - 1):
            raise ValueError(f"sde_window_size={k!r} must be an integer in 0 .. num_inference_steps - 1 = "
                             f"{None if steps is None else steps - 1} (0 records every step but the last).")
        if self.teacher_guidance_scale is not None and not self.teacher_guidance_scale > 0:
            raise ValueError(f"teacher_guidance_scale={self.teacher_guidance_scale} must be > 0 (1.0: no guidance), "
                             "or null for the student's guidance_scale.")
        self.teachers = self._parse_teachers(self.teachers)
        given = [name for name in ("teacher_lora", "teacher_model_name_or_path", "teachers") if getattr(self, name)]
        if not given:
            raise ValueError("On-policy distillation needs a teacher: set teacher_lora (a LoRA folder or Hub id on "
                             "the student's base), teacher_model_name_or_path (another base model) or teachers (a "
                             "list of {lora, guidance_scale, dataset_name}).")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are all set; give exactly one teacher source (teachers for "
                             "several LoRA teachers, teacher_lora for one, teacher_model_name_or_path for another "
                             "base).")

    @staticmethod
    def _parse_teachers(value) -> list[dict] | None:
        if value is None:
            return None
        value = decode_json_setting(value, "teachers", 'give a list such as [{"lora": "ocr_expert", "dataset_name": '
                                    '"ocr"}].')
        if isinstance(value, dict):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"teachers={value!r} must be a non-empty list of {{lora, guidance_scale, dataset_name}}.")
        parsed = []
        for i, entry in enumerate(value):
            if not isinstance(entry, dict):
                raise ValueError(f"teachers[{i}]={entry!r} must be a mapping with keys lora, guidance_scale, "
                                 "dataset_name.")
            unknown = sorted(set(entry) - set(TEACHER_KEYS))
            if unknown:
                raise ValueError(f"teachers[{i}] has unknown keys {unknown}; the keys are lora, guidance_scale, "
                                 "dataset_name.")
            if not isinstance(entry.get("lora"), str) or not entry["lora"]:
                raise ValueError(f"teachers[{i}] needs 'lora': a LoRA folder or Hub id (got {entry.get('lora')!r}).")
            scale = entry.get("guidance_scale")
            if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0):
                raise ValueError(f"teachers[{i}].guidance_scale={scale!r} must be a number > 0 (or left out).")
            name = entry.get("dataset_name")
            if name is not None and not isinstance(name, str):
                raise ValueError(f"teachers[{i}].dataset_name={name!r} must be a string.")
            parsed.append({"lora": entry["lora"], "guidance_scale": None if scale is None else float(scale),
                           "dataset_name": name})
        if len(parsed) > 1:
            names = [t["dataset_name"] for t in parsed]
            if any(n is None for n in names):
                missing = [i for i, n in enumerate(names) if n is None]
                raise ValueError(f"teachers {missing} have no dataset_name; with several teachers each needs the "
                                 "dataset_name (domain) whose batches it distils.")
            if len(set(names)) != len(names):
                raise ValueError(f"teachers' dataset_name values {names} repeat; give each teacher its own domain.")
        return parsed

    @property
    def teacher_specs(self) -> list[TeacherSpec]:
        """Every teacher, resolved (guidance: its own, else teacher_guidance_scale, else guidance_scale)."""
        default = self.guidance_scale if self.teacher_guidance_scale is None else self.teacher_guidance_scale
        if self.teachers:
            return [TeacherSpec(lora=t["lora"], model_name_or_path=None,
                                guidance_scale=default if t["guidance_scale"] is None else t["guidance_scale"],
                                dataset_name=t["dataset_name"]) for t in self.teachers]
        return [TeacherSpec(lora=self.teacher_lora, model_name_or_path=self.teacher_model_name_or_path,
                            guidance_scale=default, dataset_name=None)]

    def teacher_for_generation(self, generation: int) -> TeacherSpec:
        """The teacher of generation batch ``generation`` (counted from 0): the teachers in turn, so that each batch
        holds one domain and resuming at a generation picks the same teacher."""
        specs = self.teacher_specs
        return specs[generation % len(specs)]


# ---- the algorithm spec (flowgrpo.trainer.algorithm_spec) ----------------------------------------------------------
def describe_opd(args: DiffusionOPDConfig, use_lora: bool | None = None) -> AlgorithmFacts:
    """On-policy distillation's facts: the student's SDE rollouts record their window's transitions; each recorded
    step is trained with a teacher's replay of the state (a forward without gradient) and the KL of the two
    transitions' means."""
    steps = int(args.num_inference_steps or 0)
    window = int(args.sde_window_size or 0)
    recorded = window if window > 0 else max(1, steps - 1)
    teachers = args.teacher_specs
    kind = "adapter" if teachers[0].lora and use_lora is not False else "model"
    return AlgorithmFacts(
        copies=(PolicyCopy("teacher", "frozen teacher" + ("s" if len(teachers) > 1 else ""), count=len(teachers),
                           kind=kind),),
        reads_reference=args.beta > 0,
        record=RolloutRecord("transitions", fields=("latents", "next_latents", "log_probs", "timesteps", "sigmas",
                                                    "sigmas_next", "window", "teacher"), steps=recorded,
                             loss_reads_log_probs=False),  # the student's and teachers' means are recomputed
        workers=WorkerNeeds(
            switch_step=None, whole_groups=False, trainer_replay=("the teachers' velocities at every recorded state of the student, in the loss (the "
                            "teachers never reach the workers)"),
            staleness="a state k steps old was visited by the student of k steps before; the teachers replay it as "
                      "it is, so staleness only moves the visited states away from the current student's."),
        probe=TransitionProbe("recorded_transition", noise_level=float(args.noise_level or 0.7), sde_type="sde"),
        step=PlannedStep("recorded_transition", trained_timesteps=recorded,
                         frozen_forwards=("teacher",) + (("reference",) if args.beta > 0 else ()),
                         loss="transition_mean_mse", unsharded_reference=args.beta > 0,
                         noise_level=float(args.noise_level or 0.0), sde_type=args.sde_type),
    )


SPEC = AlgorithmSpec(
    name="diffusion_opd", title="DiffusionOPD",
    config="flowgrpo.trainer.algorithms.opd_config:DiffusionOPDConfig",
    trainer="flowgrpo.trainer.algorithms.opd_trainer:DiffusionOPDTrainer",
    summary="on-policy distillation: the student's SDE rollouts, each state replayed by frozen teachers",
    describe=describe_opd,
    eval_guidance_rollouts_refusal=("its per-step KL compares the student's and the teacher's transitions at the states "
                                    "the student sampled, at the student's guidance"),
    advantage_free=("on-policy distillation does not read: its loss is the KL to the teachers, rewards are "
                    "only logged"),
)
