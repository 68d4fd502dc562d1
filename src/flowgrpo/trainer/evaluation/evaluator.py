"""Evaluation every online-RL trainer shares (composed into `OnlineRLTrainer`): deterministic sampling with fixed
seeds on the eval set, rewards, the paired change since the first evaluation (``eval_change.py``) and a contact sheet.

What the class using it provides: the rollout pipeline's ``_encode_unique`` and ``_sample``, ``_generation_context``,
``_eval_ode_solver``, ``ema``, ``_eval_baseline``, ``reward_set``, ``_audio_rewards`` and ``Trainer``'s ``log`` and
callbacks.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from ..data.condition_images import IMAGE_COLUMN
from ..data.datasets import INDEX_COLUMN, IndexedPromptDataset
from ..outputs.contact_sheet import make_contact_sheet
from ..rollout.pipeline import _load_images, _seed_for, _to_pil
from ..rollout.sliced_decode import decode_in_slices
from ..rollout.sound import audio_columns


class Evaluation:
    """``Trainer.evaluate`` for flow-matching pipelines."""

    #: the gold evaluation rewards (``eval_reward_funcs``), or None
    gold_reward_set = None
    #: the names of the training and gold rewards that score sound (their samples' audio is decoded for them)
    _audio_rewards: list = []

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Deterministic sampling (``_eval_ode_solver``: Euler for Flow-GRPO, DiffusionNFT's ``sampler``) at the eval
        step count with fixed seeds, once per guidance scale (``eval_guidance_scale``, then any other
        ``eval_guidance_scales``); rewards on the eval set.

        Logs ``eval_reward``, ``eval_reward_std`` and ``eval_rewards/<name>/{mean,std,count}`` (``count``: the images
        the reward scored, so that ``std / sqrt(count)`` is the standard error of the mean), the rewards' own metrics
        ``eval_rewards/<name>/<key>`` (e.g. GenEval's accuracy per task) and, from the second
        evaluation of the same prompts on, ``eval_rewards/<name>/{change,change_se}``: the change since the first
        evaluation and its standard error, paired image by image (same prompts and seeds; ``eval_change.py``);
        writes a contact sheet of prompts, images and scores to ``output_dir/eval_step_<N>.png``. With
        ``eval_images_per_prompt = k``, sample ``i`` is image ``i % k`` of prompt ``i // k`` and is drawn from its own
        seed, so evaluations at different steps compare the same noise; the metrics use every image, the sheet each
        prompt's first. At another guidance scale s the same keys are prefixed ``eval_cfg<s>`` instead of ``eval``
        (``eval_cfg3_reward``), and the sheet is ``eval_step_<N>_cfg<s>.png``. Gold rewards (``eval_reward_funcs``,
        never trained on) are logged under the same keys, their weighted sum as ``eval_gold_reward``, and shown on the
        sheet; after the evaluation the hacking alarm compares them with their best (``health/hacking_alarm``).
        """
        dataset = IndexedPromptDataset.wrap(eval_dataset, "eval_dataset") if eval_dataset is not None else \
            self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass one to the trainer or to evaluate()).")
        metrics: dict[str, float] = {}
        for k, scale in enumerate(self.args.evaluation_guidance_scales):
            suffix = "" if k == 0 else f"_cfg{scale:g}"
            metrics.update(self._evaluate_at(dataset, scale, metric_key_prefix + suffix, suffix, primary=k == 0))
        if self._last_eval is not None and self.is_world_process_zero():
            self._last_eval["metrics"] = dict(metrics)  # the model card lists every scale's scores
        self._health_after_evaluate(metrics, metric_key_prefix)  # the hacking alarm: health/hacking_alarm
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _evaluate_at(self, dataset, guidance_scale: float, metric_key_prefix: str, sheet_suffix: str,
                     primary: bool) -> dict[str, float]:
        """One evaluation of ``dataset`` at ``guidance_scale``: its metrics, named with ``metric_key_prefix``."""
        args = self.args
        height, width = args.image_size
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per_prompt = args.eval_images_per_prompt
        indices = list(range(len(dataset) * per_prompt))[rank::world]
        ema_ctx = self.ema.swapped_in(self._trainable_parameters()) if self.ema is not None else nullcontext()
        records = []
        with ema_ctx, self._generation_context() as model:
            for start in range(0, len(indices), args.per_device_eval_batch_size):
                idx = indices[start:start + args.per_device_eval_batch_size]
                rows = [dataset[i // per_prompt] for i in idx]
                prompts = [r["prompt"] for r in rows]
                cols = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", INDEX_COLUMN)}
                if IMAGE_COLUMN in cols:
                    cols[IMAGE_COLUMN] = _load_images(cols[IMAGE_COLUMN])
                embeds, row_map = self._encode_unique(prompts, self.accelerator.device, cols.get(IMAGE_COLUMN),
                                                      guidance_scale)
                embeds = embeds.index_select(row_map)
                gens = [torch.Generator().manual_seed(_seed_for(args.seed, 7919, i)) for i in idx]
                final, _ = self._sample(model, embeds, args.eval_num_inference_steps, guidance_scale, 0.0,
                                        (0, 0), gens, record=False, ode_solver=self._eval_ode_solver())
                final = final.to(self.model_dtype)
                pil = _to_pil(decode_in_slices(self.adapter.decode, final, height, width, args.vae_decode_batch_size))
                if self._audio_rewards:  # the sound too, for the (training or gold) rewards that score it
                    cols.update(audio_columns(self.adapter, final, height, width, args.vae_decode_batch_size))
                result = self.reward_set(prompts, pil, **cols)
                gold = self._gold_scores(prompts, pil, cols)  # eval_reward_funcs: scored here only, never trained on
                for j, i in enumerate(idx):
                    records.append((i, prompts[j], pil[j], result.total[j],
                                    {**{n: result.per_reward[n][j] for n in self.reward_set.names},
                                     **{n: v[j] for n, v in gold.items()}},
                                    {k: v[j] for k, v in result.metrics.items()}))
        gathered = self.accelerator.gather_for_metrics(records, use_gather_object=True) if world > 1 else records
        gathered = sorted(gathered, key=lambda r: r[0])

        def stat(values):
            vals = [v for v in values if v is not None and not math.isnan(v)]
            return (float(np.mean(vals)), float(np.std(vals)), len(vals)) if vals else (math.nan, math.nan, 0)

        metrics = {}
        metrics[f"{metric_key_prefix}_reward"], metrics[f"{metric_key_prefix}_reward_std"], _ = stat(
            [r[3] for r in gathered])
        names = list(self.reward_set.names) + (list(self.gold_reward_set.names) if self.gold_reward_set else [])
        if self.gold_reward_set is not None:  # the gold rewards' weighted sum
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
        changes = self._eval_baseline.compare(metric_key_prefix, [r[1] for r in gathered],
                                              {name: [r[4][name] for r in gathered] for name in names})
        for name, (change, change_se, _) in changes.items():
            metrics[f"{metric_key_prefix}_rewards/{name}/change"] = change
            metrics[f"{metric_key_prefix}_rewards/{name}/change_se"] = change_se
        if self.is_world_process_zero():
            os.makedirs(args.output_dir, exist_ok=True)
            shown = [r for r in gathered if r[0] % per_prompt == 0]  # the sheet: each prompt's first image
            captions = [f"{r[1][:60]} | {r[3]:.3f}" if r[3] is not None else f"{r[1][:60]} | n/a" for r in shown]
            if self.gold_reward_set is not None:  # gold rewards on the sheet too
                captions = [c + " | gold " + ", ".join(_short(n, r[4][n]) for n in self.gold_reward_set.names)
                            for c, r in zip(captions, shown)]
            sheet = make_contact_sheet([r[2] for r in shown], captions)
            path = Path(args.output_dir, f"eval_step_{self.state.global_step}{sheet_suffix}.png")
            sheet.save(path)
            if primary:
                self._last_eval = {"metrics": metrics, "contact_sheet": str(path),
                                   "samples": [(r[1], r[2], r[3]) for r in shown[:8]]}
        return metrics

    def _gold_scores(self, prompts: list[str], images: list, columns: dict) -> dict:
        """Gold evaluation rewards per name (and their weighted total under ``None``); {} without any."""
        return {}

    def _health_after_evaluate(self, metrics: dict[str, float], prefix: str) -> None:
        """Act on an evaluation's metrics (`HealthGuards`: the hacking alarm)."""


def _short(name: str, value) -> str:
    return f"{name}=n/a" if value is None or value != value else f"{name}={value:.2f}"


__all__ = ["Evaluation"]
