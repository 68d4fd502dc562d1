"""`Evaluator`: periodic evaluation of every online-RL trainer: deterministic sampling with fixed seeds on the eval
set, the training and gold rewards, the paired change since the first evaluation (``eval_change.py``), a contact
sheet, and the last evaluation for the model card.

It receives what it needs at construction: the configuration, the policy (its generation context and EMA), the
rollout engine (encoding and sampling), the reward sets, the accelerator and the deterministic solver of the
algorithm's evaluation samples.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...rewards import RewardSet
from ..data.condition_images import IMAGE_COLUMN
from ..data.datasets import INDEX_COLUMN
from ..outputs.contact_sheet import make_contact_sheet
from ..rollout.images import load_images, to_pil
from ..rollout.sliced_decode import decode_in_slices
from ..rollout.sound import audio_columns
from ..seeds import seed_for
from .eval_change import EvaluationBaseline

__all__ = ["Evaluator"]


class Evaluator:
    """See the module docstring.

    Args:
        args: the trainer's configuration.
        policy: the `Policy` (generation context; the EMA's weights are evaluated when there is an EMA).
        rollouts: the `RolloutEngine` (encoding and sampling).
        rewards: the training rewards; ``gold_rewards``: the gold evaluation rewards (``eval_reward_funcs``) or None.
        accelerator: process index and gathers (with sequence parallelism, the data-parallel view: one process per
            replica, whose leader decodes and scores).
        ode_solver: the deterministic solver of evaluation samples (Euler for Flow-GRPO, the ``sampler`` of the others).
        audio_rewards: the names of the (training or gold) rewards that score sound.
        raw_weights: with an EMA, evaluate the raw weights too, under ``<prefix>_raw`` (AWM's official evaluation).
    """

    def __init__(self, args: Any, policy: Any, rollouts: Any, rewards: RewardSet, gold_rewards: RewardSet | None,
                 accelerator: Any, ode_solver: str = "euler", audio_rewards: list[str] | None = None,
                 raw_weights: bool = False):
        self.args = args
        self.policy = policy
        self.rollouts = rollouts
        self.rewards = rewards
        self.gold_rewards = gold_rewards
        self.accelerator = accelerator
        self.ode_solver = ode_solver
        self.audio_rewards = list(audio_rewards or [])
        self.raw_weights = raw_weights
        self.baseline = EvaluationBaseline()
        #: the last evaluation at the first guidance scale: ``{"metrics", "contact_sheet", "samples"}`` (main process)
        self.last_eval: dict | None = None

    @property
    def is_main_process(self) -> bool:
        return self.accelerator.is_main_process

    def evaluate(self, dataset: Any, metric_key_prefix: str, step: int) -> dict[str, float]:
        """Deterministic sampling (``ode_solver``) at the eval step count with fixed seeds, once per guidance scale
        (``eval_guidance_scale``, then any other ``eval_guidance_scales``); rewards on the eval set.

        Returns ``<prefix>_reward``, ``<prefix>_reward_std`` and ``<prefix>_rewards/<name>/{mean,std,count}``
        (``count``: the images the reward scored, so that ``std / sqrt(count)`` is the standard error of the mean),
        the rewards' own metrics ``<prefix>_rewards/<name>/<key>`` (e.g. GenEval's accuracy per task) and, from the
        second evaluation of the same prompts on, ``<prefix>_rewards/<name>/{change,change_se}``: the change since
        the first evaluation and its standard error, paired image by image (same prompts and seeds;
        ``eval_change.py``); writes a contact sheet of prompts, images and scores to
        ``output_dir/eval_step_<N>.png``. With ``eval_images_per_prompt = k``, sample ``i`` is image ``i % k`` of
        prompt ``i // k`` and is drawn from its own seed, so evaluations at different steps compare the same noise;
        the metrics use every image, the sheet each prompt's first. At another guidance scale s the same keys are
        prefixed ``<prefix>_cfg<s>`` (``eval_cfg3_reward``), and the sheet is ``eval_step_<N>_cfg<s>.png``. Gold
        rewards (never trained on) are logged under the same keys, their weighted sum as ``<prefix>_gold_reward``,
        and shown on the sheet. With an EMA the EMA's weights are evaluated; with ``raw_weights`` the raw weights
        are evaluated too, at every scale, under ``<prefix>_raw`` (``eval_raw_reward``, ``eval_raw_cfg3_reward``;
        sheets ``eval_step_<N>_raw.png``).
        """
        metrics: dict[str, float] = {}
        weights = [(True, "")] + ([(False, "_raw")] if self.raw_weights and self.policy.ema is not None else [])
        for use_ema, raw in weights:
            for k, scale in enumerate(self.args.evaluation_guidance_scales):
                suffix = raw + ("" if k == 0 else f"_cfg{scale:g}")
                metrics.update(self._evaluate_at(dataset, scale, metric_key_prefix + suffix, suffix, step,
                                                 primary=k == 0 and use_ema, use_ema=use_ema))
        if self.last_eval is not None and self.is_main_process:
            self.last_eval["metrics"] = dict(metrics)  # the model card lists every scale's scores
        return metrics

    def _evaluate_at(self, dataset, guidance_scale: float, metric_key_prefix: str, sheet_suffix: str, step: int,
                     primary: bool, use_ema: bool = True) -> dict[str, float]:
        """One evaluation of ``dataset`` at ``guidance_scale`` (of the EMA's weights when there is one and
        ``use_ema``, else of the raw weights): its metrics, named with ``metric_key_prefix``."""
        args = self.args
        height, width = args.image_size
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        scores = getattr(self.accelerator, "scores_rewards", True)  # sequence parallelism: the leaders only
        per_prompt = args.eval_images_per_prompt
        indices = list(range(len(dataset) * per_prompt))[rank::world]
        records = []
        with self.policy.ema_weights() if use_ema else nullcontext(), self.policy.generation_context() as model:
            for start in range(0, len(indices), args.per_device_eval_batch_size):
                idx = indices[start:start + args.per_device_eval_batch_size]
                rows = [dataset[i // per_prompt] for i in idx]
                prompts = [r["prompt"] for r in rows]
                cols = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", INDEX_COLUMN)}
                if IMAGE_COLUMN in cols:
                    cols[IMAGE_COLUMN] = load_images(cols[IMAGE_COLUMN])
                embeds, row_map = self.rollouts.encode_unique(prompts, cols.get(IMAGE_COLUMN), guidance_scale)
                embeds = embeds.index_select(row_map)
                gens = [torch.Generator().manual_seed(seed_for(args.seed, 7919, i)) for i in idx]
                final, _ = self.rollouts.sample(model, embeds, args.eval_num_inference_steps, guidance_scale, 0.0,
                                                (0, 0), gens, record=False, ode_solver=self.ode_solver)
                if not scores:  # a sequence-parallel group's other process: its leader decodes and scores
                    continue
                final = final.to(self.policy.dtype)
                adapter = self.policy.adapter
                pil = to_pil(decode_in_slices(adapter.decode, final, height, width, args.vae_decode_batch_size))
                if self.audio_rewards:  # the sound too, for the (training or gold) rewards that score it
                    cols.update(audio_columns(adapter, final, height, width, args.vae_decode_batch_size))
                result = self.rewards(prompts, pil, **cols)
                gold = self._gold_scores(prompts, pil, cols)  # eval_reward_funcs: scored here only, never trained on
                for j, i in enumerate(idx):
                    records.append((i, prompts[j], pil[j], result.total[j],
                                    {**{n: result.per_reward[n][j] for n in self.rewards.names},
                                     **{n: v[j] for n, v in gold.items()}},
                                    {k: v[j] for k, v in result.metrics.items()}))
        layout = getattr(self.accelerator, "layout", None)
        if world > 1 or (layout is not None and layout.enabled):  # SP: the leaders' records, one copy per replica
            gathered = self.accelerator.gather_for_metrics(records, use_gather_object=True)
        else:
            gathered = records
        gathered = sorted(gathered, key=lambda r: r[0])

        def stat(values):
            vals = [v for v in values if v is not None and not math.isnan(v)]
            return (float(np.mean(vals)), float(np.std(vals)), len(vals)) if vals else (math.nan, math.nan, 0)

        metrics = {}
        metrics[f"{metric_key_prefix}_reward"], metrics[f"{metric_key_prefix}_reward_std"], _ = stat(
            [r[3] for r in gathered])
        names = list(self.rewards.names) + (list(self.gold_rewards.names) if self.gold_rewards else [])
        if self.gold_rewards is not None:  # the gold rewards' weighted sum
            metrics[f"{metric_key_prefix}_gold_reward"], metrics[f"{metric_key_prefix}_gold_reward_std"], _ = stat(
                [r[4][None] for r in gathered])
        for name in names:
            mean, std, count = stat([r[4][name] for r in gathered])
            metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = mean
            metrics[f"{metric_key_prefix}_rewards/{name}/std"] = std
            metrics[f"{metric_key_prefix}_rewards/{name}/count"] = float(count)
        for key in dict.fromkeys(k for r in gathered for k in r[5]):  # reward-defined (RewardOutput.metrics)
            metrics[f"{metric_key_prefix}_rewards/{key}"] = stat([r[5].get(key) for r in gathered])[0]
        # Paired with the first evaluation of the same prompts and seeds (eval_change.py).
        changes = self.baseline.compare(metric_key_prefix, [r[1] for r in gathered],
                                              {name: [r[4][name] for r in gathered] for name in names})
        for name, (change, change_se, _) in changes.items():
            metrics[f"{metric_key_prefix}_rewards/{name}/change"] = change
            metrics[f"{metric_key_prefix}_rewards/{name}/change_se"] = change_se
        if self.is_main_process:
            os.makedirs(args.output_dir, exist_ok=True)
            shown = [r for r in gathered if r[0] % per_prompt == 0]  # the sheet: each prompt's first image
            captions = [f"{r[1][:60]} | {r[3]:.3f}" if r[3] is not None else f"{r[1][:60]} | n/a" for r in shown]
            if self.gold_rewards is not None:  # gold rewards on the sheet too
                captions = [c + " | gold " + ", ".join(_short(n, r[4][n]) for n in self.gold_rewards.names)
                            for c, r in zip(captions, shown)]
            sheet = make_contact_sheet([r[2] for r in shown], captions)
            path = Path(args.output_dir, f"eval_step_{step}{sheet_suffix}.png")
            sheet.save(path)
            if primary:
                self.last_eval = {"metrics": metrics, "contact_sheet": str(path),
                                   "samples": [(r[1], r[2], r[3]) for r in shown[:8]]}
        return metrics

    def _gold_scores(self, prompts: list[str], images: list, columns: dict) -> dict:
        """Gold evaluation rewards per name (and their weighted total under ``None``); {} without any."""
        if self.gold_rewards is None:
            return {}
        result = self.gold_rewards(prompts, images, **columns)
        out = {name: list(result.per_reward[name]) for name in self.gold_rewards.names}
        out[None] = list(result.total)
        return out


def _short(name: str, value) -> str:
    return f"{name}=n/a" if value is None or value != value else f"{name}={value:.2f}"


