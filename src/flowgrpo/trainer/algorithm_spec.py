"""What an algorithm *is*, declared once next to its trainer: `AlgorithmSpec`, and the facts it gives for a run
(`AlgorithmFacts`).

An algorithm is registered in the entry-point group ``flowgrpo.trainers`` (`flowgrpo.trainer.registry`), the
built-ins the same way as a third-party package. Its spec names the algorithm, its configuration and trainer classes
(``"module:Class"`` paths, imported on first use) and gives, through ``describe(args, use_lora)``, the facts that every
part outside the algorithm asks instead of knowing algorithms by name:

=================  ===================================================================================================
fact               who reads it
=================  ===================================================================================================
``copies``         the trainer (which copies of the policy to build and save), the planner (their memory), the
                   rollout workers (the ones that sample)
``reads_reference``the trainer (full fine-tuning keeps a frozen reference copy when the loss reads it)
``record``         the health guards (which recorded steps their probe may read, the last trained step), the planner
                   (the latents kept per recorded step), the trainer (whether a cached rollout may feed the loss),
                   docs/architecture.md
``workers``        the Ray backend (whether the algorithm runs there, what a worker holds and samples with, what
                   staleness means for it, whether stale samples get importance weights, what the trainer replays),
                   docs/distributed.md (its table of staleness per algorithm is generated from these facts)
``probe``          the health guards' KL probe (from which state, with which stochastic step)
``step``           the planner: the trained forward's input, how many trained timesteps a micro-batch has, the
                   forwards without gradient each one adds, the loss's form, the rollout's passes
=================  ===================================================================================================

Nothing here imports torch or the trainers: ``--help``, recipe checks and ``flowgrpo plan`` read specs cheaply.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AlgorithmFacts", "AlgorithmSpec", "PlannedStep", "PolicyCopy", "RolloutRecord", "TransitionProbe",
           "WorkerNeeds", "load_path", "worker_needs_table"]

#: where a recorded step comes from for the planner and the probe
TRAINED_INPUTS = ("recorded_transition", "noised_sample", "sampled_state")
#: the form of the loss the planner runs on fake tensors
PLANNED_LOSSES = ("ratio", "transition_mean_mse", "velocity_mse", "reward_gradient")
#: what a rollout records per micro-batch
RECORD_KINDS = ("transitions", "final_sample", "pairs", "prompts")


def load_path(path: str) -> Any:
    """The object a ``"package.module:attribute"`` path names (imported now)."""
    module, _, attribute = path.partition(":")
    if not module or not attribute:
        raise ValueError(f"{path!r} is not a 'package.module:attribute' path.")
    target = importlib.import_module(module)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


@dataclass(frozen=True)
class PolicyCopy:
    """A copy of the trained weights that the algorithm keeps beside them (LoRA: a further adapter of the trained
    model; full fine-tuning: a frozen copy of the transformer), saved in every checkpoint and left out of exports.

    ``name``: ``"old_policy"`` (``policy.old_policy``), a named copy (``policy.copies[name]``, e.g. CRD's
    ``"sampling"``) or ``"teacher"`` (on-policy distillation's frozen teachers, never saved); ``role``: what it is,
    in words; ``samples_rollouts``: whether some or all rollouts are sampled by it (a rollout worker must then hold
    it); ``count``: how many (teachers); ``kind``: ``"adapter"`` (as large as the trained LoRA) or ``"model"`` (a whole
    transformer), ``""`` when it follows the training (adapter under LoRA, model otherwise)."""

    name: str
    role: str
    samples_rollouts: bool = False
    count: int = 1
    kind: str = ""


@dataclass(frozen=True)
class RolloutRecord:
    """What a training rollout records per micro-batch.

    ``kind``: ``"transitions"`` (the recorded SDE steps: x_j, x_{j+1}, log p_old, t_j and the noise levels, per step),
    ``"final_sample"`` (the clean latent x0 and the rollout's noise levels), ``"pairs"`` (preference pairs read from
    data) or ``"prompts"`` (only the prompts' embeddings: the rollout runs inside the loss, with gradient, as the
    reward-gradient trainers do; it writes its final sample into the record when it has run); ``fields``: the record's tensors the loss reads; ``steps``: recorded steps per sample (``transitions``);
    ``means``: whether each recorded step keeps its transition mean; ``last_step``: the last sampling step a rollout
    may record and train (None when it trains no recorded step), which sampling with the base model's tail must not
    reach; ``loss_reads_log_probs``: whether the loss reads the rollout's recorded transition log-probs or means as
    the policy's own (Flow-GRPO's ratio is 1 on-policy only if they are): a cached rollout (``rollout_cache``), whose
    transitions come from skipped or extrapolated blocks, is then refused."""

    kind: str
    fields: tuple[str, ...] = ()
    steps: int = 0
    means: bool = False
    last_step: int | None = None
    loss_reads_log_probs: bool = False


@dataclass(frozen=True)
class WorkerNeeds:
    """What a Ray rollout worker needs for this algorithm, and what stays on the trainer.

    ``refusal``: why ``rollout_backend: ray`` cannot run it (None: it can); ``sampled_by``: the copy whose weights
    sample the rollouts (``"policy"`` or a `PolicyCopy` name); ``synced``: every copy a worker holds and receives at
    each weight sync besides the trained weights (``"old_policy"``, named copies; the reference when a rollout reads
    it), and nothing else (a copy only the loss reads stays on the trainer); ``staleness``: what a sample ``k``
    optimizer steps old means for the loss, in words (docs/distributed.md's table is made of these sentences);
    ``importance_weights``: whether ``truncated_importance_cap`` applies (the rollout records behaviour log-probs of
    SDE transitions); ``switch_step``: the optimizer step after which ``sampled_by`` samples instead of the policy
    (DGPO's switch to its EMA reference; None: ``sampled_by`` samples from the start), decided per generation by the
    strategy's ``plan`` from the step the generation trains at, on a worker as on the trainer; ``whole_groups``: a
    worker samples all the rows of a group that a request holds in one strategy call (BranchGRPO: a tree's shared
    prefixes once per request, not once per micro-batch); ``trainer_replay``: what the trainer recomputes of a
    generation sampled on a worker, in words ("" when nothing: the record is trained as it arrives)."""

    refusal: str | None = None
    sampled_by: str = "policy"
    synced: tuple[str, ...] = ()
    staleness: str = ""
    importance_weights: bool = False
    switch_step: int | None = None
    whole_groups: bool = False
    trainer_replay: str = ""


@dataclass(frozen=True)
class TransitionProbe:
    """The health guards' KL probe (``health/kl_to_reference``): one stochastic transition of the policy and of the
    reference from the same state. ``source``: ``"recorded_transition"`` (the record's first recorded step) or
    ``"noised_sample"`` (the final sample x0 noised to the middle of the rollout's levels); ``noise_level`` and
    ``sde_type``: the stochastic step the two transitions are compared under."""

    source: str
    noise_level: float
    sde_type: str = "sde"


@dataclass(frozen=True)
class PlannedStep:
    """The training step the planner (`flowgrpo plan`) measures on fake tensors, per micro-batch.

    ``trained_input``: ``"recorded_transition"`` (the trained forward replays a recorded SDE step and its transition is
    recomputed), ``"noised_sample"`` (the final sample noised to a level of the forward process) or ``"sampled_state"``
    (a state the sampler reached without gradient, from which ``backprop_steps`` sampler steps run with gradient);
    ``trained_timesteps``: trained timesteps per micro-batch (each a forward and a backward of the trained model; with
    ``backprop_steps``, each a chain of that many forwards and one backward); ``trained_per_sample``:
    trained transitions per sample when a micro-batch's samples do not all train the same count (BranchGRPO: a tree's
    edges per leaf; 0: ``trained_timesteps``); ``trained_batch``: rows of one trained pass per sample (AWM's
    ``train_timesteps`` noise levels go through one forward); ``rollout_passes``: transformer passes per sample in a rollout (0:
    ``num_inference_steps``; a tree's samples share their prefixes); ``frozen_forwards``: forwards without gradient that
    each trained timestep adds besides the KL reference's (``"old_policy"``, ``"teacher"``); ``loss``: the loss's form
    on the fake step (``"ratio"``, ``"transition_mean_mse"``, ``"velocity_mse"``, ``"reward_gradient"``: the reward of the
    decoded chain's end backpropagated through the decoder and ``backprop_steps`` sampler steps); ``stored_per_step``:
    latents kept per recorded step (x_j, x_{j+1}, and the transition mean); ``unsharded_reference``: full fine-tuning
    with a KL term keeps a frozen reference copy outside FSDP / ZeRO, whole on every GPU; ``noise_level`` /
    ``sde_type``: the stochastic step of the planned rollout step and of the recomputed transition (a deterministic
    sampler's memory and FLOPs are the same); ``backprop_steps``: the sampler steps one trained chain runs with
    gradient (0: none, each trained timestep is one forward; a reward-gradient step keeps the activations of all of
    them until its backward, the largest count it may draw); ``checkpointed_steps``: each of those steps is recomputed
    in the backward (only its input is kept), as gradient checkpointing through the sampler's steps does."""

    trained_input: str
    trained_timesteps: int
    trained_per_sample: float = 0.0
    trained_batch: int = 1
    rollout_passes: float = 0.0
    frozen_forwards: tuple[str, ...] = ()
    loss: str = "ratio"
    stored_per_step: int = 2
    unsharded_reference: bool = False
    noise_level: float = 0.7
    sde_type: str = "sde"
    backprop_steps: int = 0
    checkpointed_steps: bool = False


@dataclass(frozen=True)
class AlgorithmFacts:
    """The facts of one run of an algorithm (a configuration): see the module docstring."""

    copies: tuple[PolicyCopy, ...]
    reads_reference: bool
    record: RolloutRecord
    workers: WorkerNeeds
    probe: TransitionProbe
    step: PlannedStep

    def copy(self, name: str) -> PolicyCopy | None:
        """The copy called ``name``, or None."""
        return next((c for c in self.copies if c.name == name), None)

    @property
    def keeps_old_policy(self) -> bool:
        return self.copy("old_policy") is not None

    @property
    def named_copies(self) -> tuple[str, ...]:
        """The copies kept beside the old policy under their own names (``policy.copies``)."""
        return tuple(c.name for c in self.copies if c.name not in ("old_policy", "teacher"))


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm, declared once (see the module docstring).

    ``name``: the recipe's ``trainer:`` value; ``title``: its name in words (``--help``, the model card);
    ``config`` / ``trainer``: ``"module:Class"`` paths of its configuration and trainer; ``summary``: one line for
    ``--help``; ``describe(args, use_lora)``: the `AlgorithmFacts` of a configuration (``use_lora``: whether the
    transformer is trained with a LoRA, None when not known yet); ``refused_settings``: settings of other trainers'
    configurations that this one does not accept, each with the reason the command line gives;
    ``eval_guidance_rollouts_refusal``: why ``rollouts_at_eval_guidance`` is refused (None: its loss reads only the
    clean samples and it may roll out at the evaluation's guidance); ``advantage_free``: why its loss reads no
    advantage, when it does not (reward constraints, which act through the advantages, are then refused);
    ``sequence_parallel``: whether it has been run with ``sequence_parallel_size > 1`` (each group of processes
    sampling the same groups and summing its gradients, tested equal to one process); the others are refused there."""

    name: str
    title: str
    config: str
    trainer: str
    summary: str
    describe: Callable[[Any, bool | None], AlgorithmFacts]
    refused_settings: Mapping[str, str] = field(default_factory=dict)
    eval_guidance_rollouts_refusal: str | None = (
        "its loss reads the velocity of the policy that sampled the rollouts, at the rollouts' own guidance, so "
        "rollouts at another scale than training would not be its own samples")
    advantage_free: str | None = None
    sequence_parallel: bool = False

    @property
    def config_name(self) -> str:
        return self.config.partition(":")[2]

    @property
    def trainer_name(self) -> str:
        return self.trainer.partition(":")[2]

    def config_class(self) -> type:
        """The configuration class (imports transformers)."""
        return load_path(self.config)

    def trainer_class(self) -> type:
        """The trainer class (imports transformers, diffusers and peft)."""
        return load_path(self.trainer)

    def facts(self, args: Any, use_lora: bool | None = None) -> AlgorithmFacts:
        """The facts of the run that ``args`` (an instance of the configuration class) configures."""
        return self.describe(args, use_lora)

    def derive(self, **changes: Any) -> AlgorithmSpec:
        """A spec for a variant: this one with ``changes`` (e.g. a plugin's name, title, config and trainer over
        Flow-GRPO's facts)."""
        return dataclasses.replace(self, **changes)


def worker_needs_table(rows: list[tuple[str, AlgorithmFacts]]) -> str:
    """A markdown table of what rollout workers need for each ``(name, facts)``: who samples, what the workers hold
    besides the trained weights, what staleness means, what the trainer replays (docs/distributed.md holds the one of
    the built-ins, checked against their specs by a test)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").strip() or "nothing"

    lines = ["| algorithm | sampled by | workers also hold | a sample k steps old | the trainer replays |",
             "|---|---|---|---|---|"]
    for name, facts in rows:
        needs = facts.workers
        sampler = needs.sampled_by if needs.switch_step is None else \
            f"policy, then {needs.sampled_by} after step {needs.switch_step}"
        if needs.whole_groups:
            sampler += " (a request's trees whole)"
        held = ", ".join(needs.synced) or "nothing"
        lines.append(f"| {name} | {sampler} | {held} | {cell(needs.staleness)} | {cell(needs.trainer_replay)} |")
    return "\n".join(lines)
