"""Online RL on the toy world: one run with held-out accuracy measured against training wall-clock.

::

    from flowgrpo.toy.learning import RLSettings, run_toy_rl
    settings = RLSettings(reward="toy_count", reward_weights=None, max_steps=60)  # defaults: recipes/toy.yaml
    result = run_toy_rl(".cache/toy-world", settings, "outputs/toy-rl")
    result["before"]["count"], result["after"]["count"]

The run uses the trainer named by ``settings.trainer`` (``"flow_grpo"``: :class:`~flowgrpo.trainer.FlowGRPOTrainer`,
``"diffusion_nft"``: :class:`~flowgrpo.trainer.DiffusionNFTTrainer` with its own fields in ``settings.extra_config``;
`TOY_TRAINERS` maps names to a config and a trainer class) on the world's ``prompts_train.txt``; accuracy is
measured by :func:`~flowgrpo.toy.build.evaluate_pipeline` on ``prompts_eval.txt`` (deterministic ODE sampling
with the world's Euler scheduler, fixed seeds), before training, every ``eval_every`` steps and at the end, of the
weights the trainer itself evaluates (with ``use_ema``, the EMA of the weights, swapped in for the evaluation) and,
whenever there is an EMA, of the raw weights too, under each evaluation's ``"raw"``.
Training wall-clock excludes these evaluations: it sums the duration of the optimizer steps (sampling, scoring
and the policy update).

A setting whose trainer configuration evaluates periodically (``extra_config`` with ``eval_strategy: steps``, as the
reward constraints of source ``evaluation`` need) gets the trainer's own evaluation on the *validation prompts*
(`validation_prompts`: every fourth training prompt, never the held-out ones, which stay unseen), at the held-out
evaluation's steps and guidance; those evaluations are part of the method, so their seconds count as training
seconds (``validation_seconds`` says how many), and their metrics are kept in the result (``validation``).

Each result records what made it (``flowgrpo.toy.provenance``): the code digest of the modules the run imported with
the commit and whether the tree was clean (``code``), and the weights digest of every teacher it read (``teachers``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..trainer.registry import BUILTIN_TRAINERS, TRAINERS, trainer_names
from .build import METADATA_FILE, evaluate_pipeline, quiet_toy_truncation_warnings, read_prompts
from .provenance import code_record, module_manifest, weights_digest

__all__ = ["RLSettings", "TOY_TRAINERS", "VALIDATION_STRIDE", "run_toy_rl", "plot_accuracy_curve",
           "before_after_sheet", "teacher_digests", "validation_prompts"]

#: The trainer's periodic evaluation (the reward constraints' source ``evaluation``) scores every this-many-th
#: training prompt: 44 of the world's 173, never a held-out prompt.
VALIDATION_STRIDE = 4

class _ToyTrainers(Mapping):
    """Trainers a toy run can use: the trainer registry's (``flowgrpo.trainer.registry.TRAINERS``), as name -> (config
    class, trainer class) ``"module:attribute"`` paths, imported on use (the built-ins' without loading anything). The
    trainer is built as ``Trainer(model=..., reward_funcs=..., args=Config(...), train_dataset=..., peft_config=...)``;
    ``RLSettings.config_kwargs()`` gives the config's fields."""

    def __iter__(self):
        return iter(trainer_names())

    def __len__(self) -> int:
        return len(trainer_names())

    def __contains__(self, name: object) -> bool:
        return name in TRAINERS

    def __getitem__(self, name: str) -> tuple[str, str]:
        if name in BUILTIN_TRAINERS:
            return BUILTIN_TRAINERS[name][1:]
        spec = TRAINERS[name]
        return spec.config, spec.trainer


TOY_TRAINERS: Mapping[str, tuple[str, str]] = _ToyTrainers()

#: RLSettings fields that configure Flow-GRPO's sampler and objective: passed only to the trainers whose configuration
#: has them all (the Flow-GRPO family).
FLOW_GRPO_FIELDS = (
    "noise_level", "sde_type", "sde_window_size", "sde_window_range", "epsilon", "sde_window_strategy",
    "sde_window_shift_interval", "sde_window_stride", "sde_window_roll_back", "ode_solver", "ode_compression_ratio",
    "ratio_normalization", "kl_estimator", "same_noise_per_group",
)

_REWARD_ATTRIBUTE = {"toy_color": "color", "toy_shape": "shape", "toy_count": "count", "toy_position": "position",
                     "toy_geneval": "all", "toy_shape_score": "shape", "toy_smooth_shape_color": "shape"}


#: The recipe's LoRA targets: every linear layer of the joint blocks (attention and both feed-forwards) and the
#: output projection. On this 64-wide model attention-only LoRA kept colour but learned shape more slowly.
TOY_LORA_TARGET_MODULES = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_out",
)


@dataclasses.dataclass
class RLSettings:
    """One RL configuration on the toy world (the defaults are those of ``recipes/toy.yaml``, Flow-GRPO-Fast)."""

    name: str = "fast-w2"
    reward: str | list[str] = dataclasses.field(default_factory=lambda: ["toy_shape_score", "toy_color"])
    reward_weights: list[float] | None = dataclasses.field(default_factory=lambda: [1.0, 0.5])
    max_steps: int = 1000
    learning_rate: float = 3e-4
    lr_scheduler_type: str = "linear"
    use_lora: bool = True
    lora_r: int = 32
    lora_target_modules: list[str] = dataclasses.field(default_factory=lambda: list(TOY_LORA_TARGET_MODULES))
    num_generations: int = 8
    prompts_per_step: int = 4
    num_inference_steps: int = 8
    guidance_scale: float = 3.0
    noise_level: float = 0.7
    sde_type: str = "sde"
    sde_window_size: int = 2
    sde_window_range: list[int] | None = dataclasses.field(default_factory=lambda: [0, 3])
    beta: float = 0.0
    epsilon: float = 1e-3
    scale_rewards: str = "group"
    num_iterations: int = 1
    max_sequence_length: int = 8
    seed: int = 0
    # ---- the Flow-GRPO family's variants (FlowGRPOConfig fields of the same names) ----
    sde_window_strategy: str = "random"
    sde_window_shift_interval: int = 25
    sde_window_stride: int = 1
    sde_window_roll_back: bool = True
    ode_solver: str = "euler"
    ode_compression_ratio: float = 1.0
    ratio_normalization: str = "none"
    kl_estimator: str = "analytic"
    reward_aggregation: str = "weighted_sum"
    same_noise_per_group: bool = False
    # ---- which trainer (a key of TOY_TRAINERS) and config fields only that trainer has ----
    trainer: str = "flow_grpo"
    extra_config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def config_kwargs(self) -> dict[str, Any]:
        """The trainer config's fields for this setting (``extra_config`` last, so it can add or override).

        Flow-GRPO's sampler and objective fields (`FLOW_GRPO_FIELDS`) go to the trainers whose configuration has every
        one of them (the Flow-GRPO family, and a plugin built on it); another trainer refuses a setting that changes one
        of them (it would have no effect there).
        """
        kwargs = dict(
            learning_rate=self.learning_rate, lr_scheduler_type=self.lr_scheduler_type,
            num_generations=self.num_generations,
            per_device_train_batch_size=self.num_generations * self.prompts_per_step,
            num_inference_steps=self.num_inference_steps, guidance_scale=self.guidance_scale, beta=self.beta,
            scale_rewards=self.scale_rewards, num_iterations=self.num_iterations,
            max_sequence_length=self.max_sequence_length, seed=self.seed, max_steps=self.max_steps,
            reward_weights=self.reward_weights, reward_aggregation=self.reward_aggregation,
        )
        config_fields = {f.name for f in dataclasses.fields(toy_trainer_classes(self.trainer)[0])}
        if set(FLOW_GRPO_FIELDS) <= config_fields:
            kwargs.update({name: getattr(self, name) for name in FLOW_GRPO_FIELDS})
        else:
            default = RLSettings()
            changed = [name for name in FLOW_GRPO_FIELDS if getattr(self, name) != getattr(default, name)]
            if changed:
                raise ValueError(f"{self.name}: {changed} configure Flow-GRPO, but trainer={self.trainer!r}; leave "
                                 "them at their defaults and set that trainer's own fields in extra_config.")
        kwargs.update(self.extra_config)
        return kwargs


def toy_trainer_classes(name: str) -> tuple[type, type]:
    """The (config class, trainer class) registered in `TOY_TRAINERS` as ``name``."""
    if name not in TOY_TRAINERS:
        raise ValueError(f"trainer={name!r} is not a toy-world trainer; choose one of {sorted(TOY_TRAINERS)}.")

    def load(path: str):
        module, _, attribute = path.partition(":")
        return getattr(importlib.import_module(module), attribute)

    config_path, trainer_path = TOY_TRAINERS[name]
    return load(config_path), load(trainer_path)


def validation_prompts(train_prompts: list[str]) -> list[str]:
    """The prompts of the trainer's own periodic evaluation: every `VALIDATION_STRIDE`-th training prompt."""
    return list(train_prompts[::VALIDATION_STRIDE])


def teacher_digests(extra_config: dict[str, Any]) -> list[dict[str, Any]]:
    """The teachers a setting reads from a path (``teacher_lora``, ``teachers[].lora``), each with the weights
    digest of its folder (None when the folder is missing)."""
    paths = [extra_config["teacher_lora"]] if extra_config.get("teacher_lora") else []
    paths += [t["lora"] for t in extra_config.get("teachers") or [] if isinstance(t, dict) and t.get("lora")]
    return [{"lora": str(path), "sha256": weights_digest(path)} for path in paths]


def _wall_clock(evaluate, eval_every: int, log: Any = print):
    """A ``_WallClock`` callback (built here so that importing this module stays free of transformers)."""
    from transformers import TrainerCallback

    class _WallClockCallback(_WallClock, TrainerCallback):
        pass

    return _WallClockCallback(evaluate, eval_every, log)


class _WallClock:
    """Sums optimizer-step durations and runs the held-out evaluation every ``eval_every`` steps (the methods of a
    ``transformers.TrainerCallback``; :func:`_wall_clock` makes the callback)."""

    def __init__(self, evaluate, eval_every: int, log: Any = print):
        self.evaluate = evaluate
        self.log = log
        self.eval_every = eval_every
        self.train_seconds = 0.0
        self._begin = None
        self.curve: list[dict[str, Any]] = []
        self.train_log: list[dict[str, Any]] = []
        #: the trainer's own periodic evaluations (their seconds count as training): step and metrics
        self.validation: list[dict[str, Any]] = []
        self.validation_seconds = 0.0
        self._since = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._since = time.perf_counter()  # an evaluation on start comes next

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._begin is not None:
            self.train_seconds += time.perf_counter() - self._begin
            self._begin = None
        if self.eval_every and state.global_step % self.eval_every == 0 and state.global_step < state.max_steps:
            accuracy = self.evaluate()
            self.curve.append({"step": state.global_step, "train_seconds": self.train_seconds, **accuracy})
            self.log(f"[toy rl] step {state.global_step} ({self.train_seconds:.0f} s of training): " + _fmt(accuracy))
        self._since = time.perf_counter()  # the trainer's own evaluation, if due, runs after this

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if self._since is not None:
            seconds = time.perf_counter() - self._since
            self.train_seconds += seconds
            self.validation_seconds += seconds
            self._since = None
        kept = {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float)) and (
            k.startswith("constraint/") or (k.startswith("eval_rewards/") and k.endswith("/mean")))}
        self.validation.append({"step": state.global_step, "train_seconds": self.train_seconds, **kept})

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" in logs:
            self.train_log.append({"step": state.global_step, "train_seconds": self.train_seconds,
                                   **{k: v for k, v in logs.items() if isinstance(v, (int, float))}})


def run_toy_rl(world_dir: str | os.PathLike[str], settings: RLSettings, output_dir: str | os.PathLike[str],
               eval_images_per_prompt: int = 4, eval_steps: int = 20, eval_guidance_scale: float | None = None,
               eval_every: int = 0, eval_seed: int = 1234, max_eval_prompts: int | None = None,
               sheet_prompts: int = 12, log: Any = print) -> dict[str, Any]:
    """Train ``settings`` on the toy world at ``world_dir``; returns before/after accuracies and the curves.

    Writes ``output_dir/result.json``, ``reward_curve.png`` and ``before_after.png`` (``sheet_prompts``
    eval prompts, first image of each, before and after). Accuracies are dicts as returned by
    :func:`~flowgrpo.toy.build.evaluate_pipeline` (without images).
    """
    from datasets import Dataset

    config_class, trainer_class = toy_trainer_classes(settings.trainer)
    world_dir, output_dir = Path(world_dir), Path(output_dir)
    quiet_toy_truncation_warnings(settings.max_sequence_length)
    output_dir.mkdir(parents=True, exist_ok=True)
    train_prompts = read_prompts(world_dir, "train")
    eval_prompts = read_prompts(world_dir, "eval")[:max_eval_prompts]
    eval_guidance = settings.guidance_scale if eval_guidance_scale is None else eval_guidance_scale
    peft_config = None
    if settings.use_lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=settings.lora_r, lora_alpha=2 * settings.lora_r, init_lora_weights="gaussian",
                                 target_modules=list(settings.lora_target_modules))
    config = dict(
        output_dir=str(output_dir / "trainer"), report_to=[], resolution=_world_resolution(world_dir),
        eval_num_inference_steps=eval_steps, eval_guidance_scale=eval_guidance, logging_steps=1,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, log_images_steps=0, dtype="float32",
        use_cpu=True, warmup_steps=0, per_device_eval_batch_size=len(validation_prompts(train_prompts)),
    )
    config.update(settings.config_kwargs())  # a setting may ask for the trainer's own evaluation (eval_strategy)
    args = config_class(**config)
    validating = str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no"
    rewards = [settings.reward] if isinstance(settings.reward, str) else list(settings.reward)
    trainer = trainer_class(model=str(world_dir), reward_funcs=rewards, args=args,
                            train_dataset=Dataset.from_dict({"prompt": train_prompts}), peft_config=peft_config,
                            eval_dataset=Dataset.from_dict({"prompt": validation_prompts(train_prompts)})
                            if validating else None)
    code_at_start = module_manifest()
    pipeline = trainer.pipeline

    also_raw = trainer.policy.ema is not None  # with an EMA, the raw weights are measured too

    def evaluate(return_images: bool = False) -> dict[str, Any]:
        # as the trainer's own evaluation: with use_ema, the EMA of the weights is what is evaluated, and with
        # eval_raw_weights (AWM) the raw weights too, under "raw"
        def measure(use_ema: bool, images: bool) -> dict[str, Any]:
            with trainer.policy.ema_weights() if use_ema else contextlib.nullcontext():
                return evaluate_pipeline(pipeline, eval_prompts, images_per_prompt=eval_images_per_prompt,
                                         num_inference_steps=eval_steps, guidance_scale=eval_guidance,
                                         max_sequence_length=settings.max_sequence_length, seed=eval_seed,
                                         return_images=images, rewards=rewards)

        was_training = pipeline.transformer.training
        result = measure(True, return_images)
        if also_raw:
            result["raw"] = measure(False, False)
        pipeline.transformer.train(was_training)
        return result

    start = time.perf_counter()
    before = evaluate(return_images=True)
    before_images = before.pop("images")
    log(f"[toy rl] {settings.name}: before " + _fmt(before))
    clock = _wall_clock(lambda: evaluate(), eval_every, log)
    trainer.add_callback(clock)
    clock.curve.append({"step": 0, "train_seconds": 0.0, **before})
    trainer.train()
    after = evaluate(return_images=True)
    after_images = after.pop("images")
    clock.curve.append({"step": settings.max_steps, "train_seconds": clock.train_seconds, **after})
    log(f"[toy rl] {settings.name}: after {settings.max_steps} steps ({clock.train_seconds:.0f} s of training): "
        + _fmt(after))

    attribute = _REWARD_ATTRIBUTE.get(rewards[0], "all")
    result = {
        "settings": dataclasses.asdict(settings), "target_attribute": attribute,
        "before": before, "after": after, "gain": after[attribute] - before[attribute],
        "train_seconds": clock.train_seconds, "total_seconds": time.perf_counter() - start,
        "curve": clock.curve, "train_log": clock.train_log,
        "eval": {"prompts": len(eval_prompts), "images_per_prompt": eval_images_per_prompt, "steps": eval_steps,
                 "guidance_scale": eval_guidance, "seed": eval_seed, "every": eval_every},
        "world": world_digest(world_dir),
        "code": code_record(code_at_start),
    }
    teachers = teacher_digests(settings.extra_config)
    if teachers:
        result["teachers"] = teachers
    if validating:
        result["validation"] = clock.validation
        result["validation_seconds"] = clock.validation_seconds
    (output_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    plot_accuracy_curve(result, output_dir / "reward_curve.png")
    before_after_sheet(eval_prompts, before_images, after_images, eval_images_per_prompt,
                       output_dir / "before_after.png", sheet_prompts, attribute)
    trainer.reward_set.close()
    return result


def read_world_metadata(world_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """A toy world folder's ``toy_world.json``: its seed, config, recommended generation settings (``generation``),
    accuracies and ``builder_digest``. (Kept out of ``build.py``, whose source decides the builder digest.)"""
    return json.loads((Path(world_dir) / METADATA_FILE).read_text(encoding="utf-8"))


def world_digest(world_dir: str | os.PathLike[str]) -> str | None:
    """The builder digest recorded in a toy world's ``toy_world.json`` (which builder, preset and seed made it), so
    results from different worlds are never pooled; ``None`` for a world folder without one."""
    return read_world_metadata(world_dir).get("builder_digest")


def _world_resolution(world_dir: Path) -> int:
    return int(read_world_metadata(world_dir)["generation"]["resolution"])


def _fmt(acc: dict[str, Any]) -> str:
    parts = [f"{k} {acc[k]:.1%}" for k in ("color", "shape", "count", "position", "all") if k in acc]
    parts += [f"{k} {v:.3f}" for k, v in acc.items() if k.startswith("reward/")]
    if "raw" in acc:
        parts.append("raw weights: " + _fmt(acc["raw"]))
    return ", ".join(parts)


def plot_accuracy_curve(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Training reward (per step) and held-out accuracy of the target attribute against training seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attribute = result["target_attribute"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    train = [(r["train_seconds"], r["reward"]) for r in result["train_log"] if math.isfinite(r.get("reward", math.nan))]
    names = result["settings"]["reward"]
    names = names if isinstance(names, str) else " + ".join(names)
    top = 1.02
    if train:
        xs, ys = zip(*train)
        top = max(top, max(ys) + 0.02)
        ax.plot(xs, ys, color="tab:blue", alpha=0.35, lw=1, label=f"train reward ({names})")
        window = max(1, len(ys) // 10)
        smooth = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1])
                  for i in range(len(ys))]
        ax.plot(xs, smooth, color="tab:blue", lw=2, label=f"train reward ({window}-step mean)")
    points = [(r["train_seconds"], r[attribute]) for r in result["curve"]]
    xs, ys = zip(*points)
    ax.plot(xs, ys, "o-", color="tab:orange", lw=2, label=f"held-out {attribute} accuracy (ODE, fixed seeds)")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, top)
    ax.set_title(f"{result['settings'].get('trainer', 'flow_grpo')} on the toy world: {result['settings']['name']}")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def before_after_sheet(prompts: list[str], before: list[Any], after: list[Any], images_per_prompt: int,
                       path: str | os.PathLike[str], max_prompts: int = 12, attribute: str = "all") -> Path:
    """Side-by-side contact sheets, before and after, of the first image of ``max_prompts`` prompts spread evenly
    over ``prompts`` (so several colours and shapes show), each captioned with its check of ``attribute``."""
    from flowgrpo.trainer.outputs.contact_sheet import make_contact_sheet, side_by_side

    from .rewards import score_images

    count = min(max_prompts, len(prompts))
    indices = sorted({round(k * (len(prompts) - 1) / max(1, count - 1)) for k in range(count)})
    chosen = [prompts[i] for i in indices]
    sheets = []
    for images in (before, after):
        firsts = [images[i * images_per_prompt] for i in indices]
        checks = score_images(chosen, firsts)
        passed = [all(c.values()) if attribute == "all" else c.get(attribute) for c in checks]
        captions = [f"{p} | {attribute}: {'ok' if ok else 'no'}" for p, ok in zip(chosen, passed)]
        sheets.append(make_contact_sheet(firsts, captions, columns=4, cell=128))
    sheet = side_by_side(sheets[0], sheets[1], titles=("before RL", "after RL"))
    path = Path(path)
    sheet.save(path)
    return path
