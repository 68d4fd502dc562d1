"""`unifiedreward`: UnifiedReward (Wang et al., 2025) as Flow-GRPO's reference scores with it.

Each image is resized to 512x512 (PIL bicubic) and shown to the judge with the reference's question
(`UNIFIEDREWARD_PROMPT`, the caption in ``[...]``, ``<image>\\n`` kept at its start as the reference sends it). The
first ``Final Score: x`` in the answer, with ``x`` a digit from 1 to 5 and optional decimals (the reference's
pattern ``Final Score:\\s*([1-5](?:\\.\\d+)?)``), gives the reward ``x / 5``, in [0.2, 1]. An answer without one
scores 0, as in the reference (``on_unparsable`` chooses another policy).

Two backends:

* ``backend="server"`` (default, the reference's way): an OpenAI-compatible chat-completions server, e.g.
  ``python -m sglang.launch_server --model-path CodeGoat24/UnifiedReward-7b-v1.5 --port 17140 --chat-template
  chatml-llava`` or ``vllm serve CodeGoat24/UnifiedReward-qwen-7b``; requests go through `VLMJudgeReward`
  (temperature 0, no length limit unless ``max_tokens`` is given, bounded concurrency, retries, ``None`` for a
  request that keeps failing).
* ``backend="transformers"``: the judge runs in the training process with ``AutoModelForImageTextToText`` and
  greedy ``generate`` (``max_new_tokens``), for the Qwen2.5-VL-based (``CodeGoat24/UnifiedReward-qwen-7b``, about
  16.6 GB in bfloat16) and Qwen3-VL-based (``CodeGoat24/UnifiedReward-2.0-qwen3vl-8b``) checkpoints. The question
  goes in one user turn after the image, rendered with the model's chat template.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from PIL import Image

from .registry import register_reward
from .vlm_judge import VLMJudgeReward
from .vlm_models import VLMReward, as_rgb, chat_text, load_vlm, vlm_batch

logger = logging.getLogger(__name__)

__all__ = [
    "UNIFIEDREWARD_PROMPT",
    "UnifiedReward",
    "UnifiedRewardUnparsableError",
    "parse_final_score",
]

UNIFIEDREWARD_PROMPT = (
    "<image>\nYou are given a text caption and a generated image based on that caption. Your task is to evaluate "
    "this image based on two key criteria:\n1. Alignment with the Caption: Assess how well this image aligns with "
    "the provided caption. Consider the accuracy of depicted objects, their relationships, and attributes as "
    "described in the caption.\n2. Overall Image Quality: Examine the visual quality of this image, including "
    "clarity, detail preservation, color accuracy, and overall aesthetic appeal.\nBased on the above criteria, "
    "assign a score from 1 to 5 after 'Final Score:'.\nYour task is provided as follows:\nText Caption: [{prompt}]"
)
DEFAULT_SERVER_MODEL = "UnifiedReward-7b-v1.5"
DEFAULT_SERVER_URL = "http://127.0.0.1:17140/v1"
DEFAULT_INPROCESS_MODEL = "CodeGoat24/UnifiedReward-qwen-7b"
IMAGE_SIZE = 512
_FINAL_SCORE = re.compile(r"Final Score:\s*([1-5](?:\.\d+)?)")
_POLICIES = ("zero", "none", "raise")


class UnifiedRewardUnparsableError(ValueError):
    """The judge's answer has no ``Final Score: x`` (raised under ``on_unparsable="raise"``)."""


def parse_final_score(text: str | None) -> float | None:
    """``x`` of the first ``Final Score: x`` (x in 1-5, optional decimals) in ``text``; ``None`` when there is none."""
    if not text:
        return None
    match = _FINAL_SCORE.search(text)
    return float(match.group(1)) if match else None


def _check_policy(on_unparsable: Any) -> str | float:
    if isinstance(on_unparsable, bool):
        raise ValueError(f"on_unparsable must be 'zero', 'none', 'raise' or a number, got {on_unparsable!r}")
    if isinstance(on_unparsable, (int, float)):
        return float(on_unparsable)
    policy = str(on_unparsable).lower()
    if policy not in _POLICIES:
        raise ValueError(f"on_unparsable must be 'zero' (the reference: score 0), 'none' (score None, excluded from "
                         f"the statistics), 'raise' or a number, got {on_unparsable!r}")
    return policy


class _UnifiedRewardJudge(VLMJudgeReward):
    """`VLMJudgeReward` sending the image resized to 512x512 and reading ``Final Score:`` with the chosen policy."""

    def __init__(self, owner: UnifiedReward, **kwargs: Any):
        self._owner = owner
        super().__init__(**kwargs)
        self.__name__ = "unifiedreward"

    def build_request(self, prompt: str, image: Image.Image, row: dict[str, Any] | None = None) -> dict:
        return super().build_request(prompt, self._owner.prepare_image(image), row)

    def _parse(self, text: str | None) -> float | None:
        return self._owner.score_answer(text)


@register_reward("unifiedreward")
class UnifiedReward(VLMReward):
    """UnifiedReward's ``Final Score`` / 5 (see the module docstring).

    Args:
        backend: ``"server"`` (an OpenAI-compatible server) or ``"transformers"`` (in-process).
        model: the served model name (server; default ``UnifiedReward-7b-v1.5``, the reference's) or the checkpoint
            (transformers; hub id or local folder, default ``CodeGoat24/UnifiedReward-qwen-7b``); alias
            ``model_name_or_path``.
        on_unparsable: an answer without ``Final Score``: ``"zero"`` (default, the reference), ``"none"`` (scored
            ``None``, excluded), ``"raise"``, or a number to score instead.
        prompt_template: the question (``{prompt}`` is the caption).
        image_size: the square side images are resized to (512 in the reference; ``None`` keeps them as they are).
        base_url, api_key_env, max_concurrency, timeout, max_retries, max_tokens, on_failure, health_check, image_format:
            the server backend's settings (`VLMJudgeReward`); ``max_tokens=None`` leaves the length to the server.
        processor_name_or_path, device (alias ``reward_device``), dtype, batch_size, max_new_tokens: the
            transformers backend's settings (bfloat16 on CUDA, float32 on CPU by default).
    """

    def __init__(
        self,
        backend: str = "server",
        model: str | None = None,
        on_unparsable: str | float = "zero",
        prompt_template: str = UNIFIEDREWARD_PROMPT,
        image_size: int | None = IMAGE_SIZE,
        base_url: str = DEFAULT_SERVER_URL,
        api_key_env: str | None = "OPENAI_API_KEY",
        max_concurrency: int = 8,
        timeout: float = 300.0,
        max_retries: int = 2,
        max_tokens: int | None = None,
        on_failure: str = "skip",
        health_check: bool = True,
        image_format: str = "png",
        processor_name_or_path: str | None = None,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 4,
        max_new_tokens: int = 512,
        reward_device: str | None = None,
        model_name_or_path: str | None = None,
    ):
        if model is not None and model_name_or_path is not None and model != model_name_or_path:
            raise ValueError(f"give the judge once: model={model!r} and model_name_or_path={model_name_or_path!r}")
        model = model if model is not None else model_name_or_path
        if backend not in ("server", "transformers"):
            raise ValueError(f"backend must be 'server' (an OpenAI-compatible server) or 'transformers' "
                             f"(in-process), got {backend!r}")
        if image_size is not None and int(image_size) < 1:
            raise ValueError(f"image_size must be a positive side length or None, got {image_size}")
        if batch_size < 1 or max_new_tokens < 1:
            raise ValueError(f"batch_size and max_new_tokens must be >= 1, got {batch_size} and {max_new_tokens}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.backend = backend
        self.on_unparsable = _check_policy(on_unparsable)
        self.prompt_template = prompt_template
        self.image_size = None if image_size is None else int(image_size)
        self.__name__ = "unifiedreward"
        self._judge: _UnifiedRewardJudge | None = None
        if backend == "server":
            self.model = model or DEFAULT_SERVER_MODEL
            self._judge = _UnifiedRewardJudge(
                self, model=self.model, base_url=base_url, api_key_env=api_key_env, prompt_template=prompt_template,
                max_concurrency=max_concurrency, timeout=timeout, max_retries=max_retries, image_format=image_format,
                max_tokens=max_tokens, temperature=0.0, on_failure=on_failure, health_check=health_check,
            )
        else:
            if "{prompt}" not in prompt_template:
                raise ValueError("prompt_template must contain '{prompt}'")
            self.model = model or DEFAULT_INPROCESS_MODEL
        self.processor_name_or_path = processor_name_or_path
        self.max_new_tokens = int(max_new_tokens)

    def __repr__(self) -> str:
        return f"UnifiedReward(backend={self.backend!r}, model={self.model!r})"

    def prepare_image(self, image: Any) -> Image.Image:
        """The image the judge sees: RGB, resized to ``image_size`` x ``image_size`` with PIL's bicubic filter."""
        image = as_rgb(image)
        if self.image_size is not None:
            image = image.resize((self.image_size, self.image_size), Image.Resampling.BICUBIC)
        return image

    def score_answer(self, text: str | None) -> float | None:
        """``Final Score / 5`` of one answer, or the ``on_unparsable`` policy's value."""
        value = parse_final_score(text)
        if value is not None:
            return value / 5.0
        if self.on_unparsable == "raise":
            raise UnifiedRewardUnparsableError(f"unifiedreward: no 'Final Score: x' in the judge's answer "
                                               f"{(text or '')[:300]!r}; pass on_unparsable='zero' or 'none' to go on")
        if self.on_unparsable == "none":
            return None
        return 0.0 if self.on_unparsable == "zero" else float(self.on_unparsable)

    # ---- in-process backend ------------------------------------------------------------------------------------

    def to(self, device: Any = None) -> UnifiedReward:
        """Move the in-process judge to ``device`` (the server backend has no local weights: nothing happens)."""
        return self if self._judge is not None else super().to(device)

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        return load_vlm(self.model, self.processor_name_or_path, device, dtype)

    def generate_answers(self, prompts: Sequence[str], images: Sequence[Any]) -> list[str]:
        """The in-process judge's greedy answers, one per (prompt, image)."""
        model, processor = self.load()
        answers: list[str] = []
        for sl in self.chunks(len(prompts)):
            texts = [chat_text(processor, self.prompt_template.format(prompt=p)) for p in prompts[sl]]
            chunk = [self.prepare_image(im) for im in images[sl]]
            batch = vlm_batch(processor, texts, chunk, model.device)
            output = model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False)
            new_tokens = output[:, batch["input_ids"].shape[1]:]
            answers += processor.batch_decode(new_tokens, skip_special_tokens=True)
        return answers

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> list[float | None]:
        if len(prompts) != len(images):
            raise ValueError(f"unifiedreward got {len(prompts)} prompts and {len(images)} images")
        if self._judge is not None:
            return self._judge(prompts, images, **columns)
        if not images:
            return []
        import torch

        with self._lock, torch.inference_mode():
            answers = self.generate_answers(list(prompts), list(images))
        scores = [self.score_answer(text) for text in answers]
        for text, score in zip(answers, scores):
            if parse_final_score(text) is None:
                logger.warning("unifiedreward: no 'Final Score' in %r; scored %s", text[:200], score)
        return scores
