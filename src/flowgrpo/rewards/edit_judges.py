"""Editing judges: generative VLMs that grade an edit from the source image, the edited image and the instruction.

Three judges, each reproducing its authors' prompts, parsing and reduction to one number:

* `editscore` (EditScore, ``VectorSpaceLab/EditScore``; ``EditScore/EditScore-7B``, a LoRA on Qwen2.5-VL-7B): two
  questions per edit, each answered as JSON ``{"reasoning": ..., "score": [...]}`` on a 0-``score_range`` scale
  (25): **SC** (semantic consistency) sees both images and scores ``[editing success, over-editing]``; **PQ**
  (perceptual quality) scores ``[naturalness, artifacts]``; in the authors' batch path, which their RL reward server
  uses, PQ is shown both images too (``pq_inputs="source_and_edited"``, the default; their single-edit ``evaluate``
  shows it the edited image only: ``pq_inputs="edited"``). Each is the minimum of its
  list divided by ``score_range / 10`` (a 0-10 scale); ``overall = sqrt(SC * PQ)``; the RL reward (the authors'
  reward server) is ``overall / 10``, in [0, 1]. The authors' batch path (the one their RL server uses) parses with a
  repairing JSON reader, counts an answer without scores as ``score_range / 2`` and a value outside [0, 10] after
  scaling as ``score_range / 2`` too (12.5, as written there: more than the scale's top; ``on_unparsable="official"``
  keeps both). Sampling as released: temperature 0.7, top-p 0.9, top-k 20, 512 new tokens, seed 42 (+ the pass);
  ``num_pass`` answers averaged (``average_last``). Each image goes through qwen-vl-utils' resize first
  (``smart_resize`` with its defaults, 4 to 16384 patches of 28 px, bicubic). The prompt lays the images out as
  ``<img1>: <image><img2>: <image>{question}`` in one user turn with the default system prompt, as the authors'
  hand-made chat template does.
* `unifiedreward_edit` (UnifiedReward-Edit, ``CodeGoat24/UnifiedReward``, pointwise mode): two questions per edit
  with the authors' prompts (0-25 scores): **instruction following** sees ``[source, edited]`` and scores
  ``[editing success, over-editing]``; **quality** sees the edited image and scores ``[naturalness, artifacts]``.
  Images before the text, JPEG at quality 95, as the authors' client sends them. Reduced to one number as the
  authors' RL code (Pref-GRPO's ``unifiedreward_edit_pointwise``) does: each question's weighted mean of its two
  scores (weights ``following_weights`` and ``quality_weights``, 1 and 1 by default; their scripts use 0.6 / 0.4),
  then the mean of the two questions (Pref-GRPO weighs them 0.5 / 0.5), divided by 25: in [0, 1]. Pref-GRPO
  normalises the two questions separately before summing; to train exactly that way, use two instances with
  ``dimensions=["following"]`` and ``["quality"]`` and ``reward_aggregation: normalize_then_sum``. An answer whose
  JSON does not parse or has fewer than two scores counts as ``[0, 0]``, as in Pref-GRPO (``on_unparsable="zero"``).
* `rationalrewards_edit` (RationalRewards, ``TIGER-Lab/RationalRewards-8B-Edit``, Qwen3-VL-8B): one question per
  edit with the authors' system prompt and rubric; the answer scores four aspects from 1 to 4 on ``## Score:``
  lines (text faithfulness, image faithfulness, physical and visual quality, text rendering, which may be N/A).
  ``aggregation="authors"`` (default; the authors' diffusion-RL code): the mean of text faithfulness, physical
  quality and text rendering (N/A skipped, values not clamped), mapped ``(mean - 1) / 3``; parsed as their code
  parses (blocks split at the aspect headers, the last readable ``## Score:`` of a block). ``aggregation=
  "flow_factory"`` (Flow-Factory's ``rational_rewards_edit``): the mean of all four aspects (``aspects`` chooses),
  each clamped to [1, 4], mapped ``(mean - 1) / 3`` and clamped to [0, 1]; parsed as Flow-Factory parses (numbered
  headers, the first readable ``Score:`` line, any case). Both sample at temperature 0.1 with 2048 new tokens and
  score 0 when nothing can be read (``on_unparsable="zero"``).

Backends: ``backend="server"`` (default) sends chat-completions requests to an OpenAI-compatible server (vLLM,
sglang) through `flowgrpo.rewards.vlm_judge.VLMJudgeReward` (bounded concurrency, retries, health check,
``on_failure``); ``backend="transformers"`` generates in the training process with ``AutoModelForImageTextToText``
(`flowgrpo.rewards.vlm_models`), the same content rendered with the model's chat template (sampling under a forked
RNG seeded with ``seed``).

Every judge takes the source image from the dataset's ``image`` column (`flowgrpo.rewards.edit_inputs`) and returns
a `flowgrpo.rewards.RewardOutput` whose metrics are its parts (EditScore ``sc`` / ``pq`` / ``overall``; UnifiedReward-
Edit ``following`` / ``quality``; RationalRewards one per aspect). A sample whose request kept failing scores
``None`` and is counted as failed. ``on_unparsable`` chooses what an answer that cannot be read gives: the
judge's official fallback (the default, above), ``"none"`` (``None``, excluded), ``"raise"``, or a number.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from .composition import RewardOutput
from .edit_inputs import source_images
from .failures import report_failed_samples
from .hpsv3 import smart_resize
from .registry import register_reward
from .remote import encode_image
from .vlm_judge import VLMJudgeReward
from .vlm_models import VLMReward, as_rgb, chat_content_text, load_vlm, load_vlm_processor, vlm_batch

logger = logging.getLogger(__name__)

__all__ = [
    "EDITSCORE_CONTEXT",
    "EDITSCORE_PQ_RULE",
    "EDITSCORE_SC_RULE",
    "EDITSCORE_TWO_IMAGE_RULE",
    "RATIONALREWARDS_EDIT_GUIDELINE",
    "RATIONALREWARDS_EDIT_SYSTEM_PROMPT",
    "RATIONALREWARDS_ASPECTS",
    "UNIFIEDREWARD_EDIT_FOLLOWING_PREFIX",
    "UNIFIEDREWARD_EDIT_QUALITY_PROMPT",
    "ChatTurn",
    "EditJudge",
    "EditJudgeUnparsableError",
    "EditScoreJudge",
    "RationalRewardsEditJudge",
    "UnifiedRewardEditJudge",
    "aggregate_rational_scores",
    "editscore_prompts",
    "parse_editscore_answer",
    "parse_rational_scores",
    "parse_unifiedreward_edit_scores",
]

EDITSCORE_CONTEXT = (
    "You are a professional digital artist. You will have to evaluate the effectiveness of the "
    "AI-generated image(s) based on given rules.\n"
    "All the input images are AI-generated. All human in the images are AI-generated too. so you need "
    "not worry about the privacy confidentials.\n"
    "\n"
    "IMPORTANT: You will have to give your output in this way (Keep your reasoning concise and short.):\n"
    "{\n"
    '"reasoning" : "...",\n'
    '"score" : [...]\n'
    "}\n"
)
EDITSCORE_TWO_IMAGE_RULE = (
    "RULES:\n"
    "\n"
    "Two images will be provided: The first being the original AI-generated image and the second being "
    "an edited version of the first.\n"
    "The objective is to evaluate how successfully the editing instruction has been executed in the "
    "second image.\n"
    "\n"
    "Note that sometimes the two images might look identical due to the failure of image edit.\n"
)
EDITSCORE_SC_RULE = (
    "\n"
    "From scale 0 to 10: \n"
    "A score from 0 to 10 will be given based on the success of the editing. (0 indicates that the scene "
    "in the edited image does not follow the editing instruction at all. 10 indicates that the scene in "
    "the edited image follow the editing instruction text perfectly.)\n"
    "A second score from 0 to 10 will rate the degree of overediting in the second image. (0 indicates "
    "that the scene in the edited image is completely different from the original. 10 indicates that the "
    "edited image can be recognized as a minimal edited yet effective version of original.)\n"
    "Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the "
    "editing success and 'score2' evaluates the degree of overediting.\n"
    "\n"
    "Editing instruction: <instruction>\n"
)
EDITSCORE_PQ_RULE = (
    "RULES:\n"
    "\n"
    "The image is an AI-generated image.\n"
    "The objective is to evaluate how successfully the image has been generated.\n"
    "\n"
    "From scale 0 to 10: \n"
    "A score from 0 to 10 will be given based on image naturalness. \n"
    "(\n"
    "    0 indicates that the scene in the image does not look natural at all or give a unnatural "
    "feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. \n"
    "    10 indicates that the image looks natural.\n"
    ")\n"
    "A second score from 0 to 10 will rate the image artifacts. \n"
    "(\n"
    "    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, "
    "or blurred faces, or unusual body parts, or subjects not harmonized. \n"
    "    10 indicates the image has no artifacts.\n"
    ")\n"
    "Put the score in a list such that output score = [naturalness, artifacts]\n"
)
UNIFIEDREWARD_EDIT_QUALITY_PROMPT = (
    "You are a professional digital artist. You will have to evaluate the effectiveness of the "
    "AI-generated image(s) based on given rules.\n"
    "All the input images are AI-generated. All human in the images are AI-generated too. so you need "
    "not worry about the privacy confidentials.\n"
    "\n"
    "IMPORTANT: You will have to give your output in this way (Keep your reasoning concise and short.):\n"
    "{\n"
    "\n"
    '"reasoning" : "...",\n'
    '"score" : [...],\n'
    "}\n"
    "\n"
    "RULES:\n"
    "\n"
    "The image is an AI-generated image.\n"
    "The objective is to evaluate how successfully the image has been generated.\n"
    "\n"
    "From scale 0 to 25: \n"
    "A score from 0 to 25 will be given based on image naturalness. \n"
    "(\n"
    "    0 indicates that the scene in the image does not look natural at all or give a unnatural "
    "feeling such as wrong sense of distance, or wrong shadow, or wrong lighting. \n"
    "    25 indicates that the image looks natural.\n"
    ")\n"
    "A second score from 0 to 25 will rate the image artifacts. \n"
    "(\n"
    "    0 indicates that the image contains a large portion of distortion, or watermark, or scratches, "
    "or blurred faces, or unusual body parts, or subjects not harmonized. \n"
    "    25 indicates the image has no artifacts.\n"
    ")\n"
    "Put the score in a list such that output score = [naturalness, artifacts]\n"
)
UNIFIEDREWARD_EDIT_FOLLOWING_PREFIX = (
    "You are a professional digital artist. You will have to evaluate the effectiveness of the "
    "AI-generated image(s) based on given rules.\n"
    "All the input images are AI-generated. All human in the images are AI-generated too. so you need "
    "not worry about the privacy confidentials.\n"
    "\n"
    "IMPORTANT: You will have to give your output in this way (Keep your reasoning concise and short.):\n"
    "{\n"
    "\n"
    '"reasoning" : "...",\n'
    '"score" : [...],\n'
    "}\n"
    "\n"
    "RULES:\n"
    "\n"
    "Two images will be provided: The first being the original AI-generated image and the second being "
    "an edited version of the first.\n"
    "The objective is to evaluate how successfully the editing instruction has been executed in the "
    "second image.\n"
    "\n"
    "Note that sometimes the two images might look identical due to the failure of image edit.\n"
    "\n"
    "\n"
    "From scale 0 to 25: \n"
    "A score from 0 to 25 will be given based on the success of the editing. (0 indicates that the scene "
    "in the edited image does not follow the editing instruction at all. 25 indicates that the scene in "
    "the edited image follow the editing instruction text perfectly.)\n"
    "A second score from 0 to 25 will rate the degree of overediting in the second image. (0 indicates "
    "that the scene in the edited image is completely different from the original. 25 indicates that the "
    "edited image can be recognized as a minimal edited yet effective version of original.)\n"
    "Put the score in a list such that output score = [score1, score2], where 'score1' evaluates the "
    "editing success and 'score2' evaluates the degree of overediting.\n"
    "\n"
    "Editing instruction:"
)
RATIONALREWARDS_EDIT_SYSTEM_PROMPT = (
    "You are an expert image editing evaluator. Your task is to evaluate the quality of an edited image "
    "based on a source image and a user instruction. Afterwards, you need to suggest how to refine the "
    "original user request to produce better image edits (if any)."
)
RATIONALREWARDS_EDIT_GUIDELINE = (
    "To do this, you must first assess the image on four critical aspects, provide justifications and "
    "absolute scores in 1-4 scale.\n"
    "\n"
    "### Critical Aspects & Scoring Rubric\n"
    "**1. Text Faithfulness** (How accurately does the output follow the instruction?)\n"
    "- **4 (Full match):** All key elements (objects, colors, actions) are represented exactly as "
    "described. No hallucinations or unrequested changes.\n"
    "- **3 (Minor mismatch):** Most key elements are present, but minor details are missing, incorrect, "
    "or slightly inaccurate.\n"
    "- **2 (Some mismatch):** Some key elements are missing, altered, or interpreted incorrectly.\n"
    "- **1 (Major deviations):** Key elements are completely missing, altered, or contradicted. "
    "Instruction is ignored.\n"
    "\n"
    "**2. Image Faithfulness** (How well are the non-edited parts and key input elements preserved?)\n"
    "- **4 (Uses input fully):** All relevant elements from the input (background, style, lighting, "
    "identity) are accurately preserved or transformed as instructed.\n"
    "- **3 (Minor mismatch):** Most relevant elements are preserved, but a few aspects (e.g., background "
    "details, lighting consistency) are missing or incorrectly handled.\n"
    "- **2 (Partial mismatch):** Some elements are carried over, but key aspects of the original image "
    "are lost or distorted.\n"
    "- **1 (Fails to use input):** Key elements of the input image are ignored, misinterpreted, or "
    "destroyed.\n"
    "\n"
    "**3. Physical and Visual Quality** (Technical errors, composition, realism, and physics)\n"
    "- **4 (No noticeable flaws):** The image is physically plausible (correct lighting, shadows, "
    "geometry, anatomy). No visible artifacts (seams, blurring, noise).\n"
    "- **3 (Minor flaws):** Small inaccuracies that are noticeable but not strongly disruptive (e.g., "
    "slight lighting mismatch, minor texture issues).\n"
    "- **2 (Some flaws):** Clear physical or visual errors that disrupt the image (e.g., incorrect "
    'perspective, "floating" objects, wrong shadow direction, obvious seams).\n'
    "- **1 (Severe flaws):** Major physical/visual errors (e.g., impossible geometry, distorted anatomy, "
    "garbled objects, severe artifacts).\n"
    "\n"
    "**4. Text Rendering** (Only if the instruction involves generating text)\n"
    "- **4 (Full match):** Text is correct, legible, and integrated well.\n"
    "- **3 (Mostly match):** Minor misspellings or inconsistent capitalization.\n"
    "- **2 (Partial match):** Major misspellings or distorted text.\n"
    "- **1 (Major deviations):** Text is unreadable, severely distorted, or missing. (Use N/A if no text "
    "generation is required).\n"
    "\n"
    "### Scoring Methodology (CRITICAL)\n"
    "During assessment for each aspect, recall the initial user request, source image and the scoring "
    "rubrics of the aspect, provide scores with detailed justifications for each image and reflect "
    "fine-grained preferences.\n"
    "1. **Anchor:** Have a global inspection based on the user request and the resulting generation. "
    "Determine the rough integer score level (1, 2, 3, or 4) according to the definitions provided .\n"
    "2. **Justify and Adjust:** Do careful visual analysis and identify specific flaws in generation. "
    "Justify the score with concrete evidence and scoring logic. Fine-tune this anchor score into a "
    "float value. Add small increments for exceptional execution or deduct points for specific flaws.\n"
    "   - *Example:* deduct points from 4.0 for slight flaws if the assessed dimension is close to "
    "satisfaction. add increments from 1.0 or 2.0 based on severity of flaws.\n"
    "\n"
    "Afterwards, try to construct a refined user request that helps the visual generation model to "
    "produce better image edits.\n"
    "Think of the weaknesses identified in the judgement, then map them to instruction details and apply "
    "specific fixes.\n"
    "Provide a final new user request that enrich the initial user request.\n"
    "\n"
    "Output your evaluation in the following format:\n"
    "# User Request Analysis\n"
    "[ understanding the user request, try to analyze or decompose the user request deeper. Think of "
    "what the request might imply or what needs to be inferred to successfully execute the request. ]\n"
    "# Detailed Judgement\n"
    "1. Text Faithfulness:\n"
    "## Justification: [ Analysis of the user request and the assessment of the resulting generation. "
    "How it comes to a final score. ]\n"
    "## Score: [ float score ]\n"
    "2. Image Faithfulness:\n"
    "## Justification: [ Similar to above. Analysis and assessment. ]\n"
    "## Score: [ float score ]\n"
    "3. Physical and Visual Quality:\n"
    "## Justification: [ Similar to above. Analysis and assessment. ]\n"
    "## Score: [ float score ]\n"
    "4. Text Rendering:\n"
    "## Justification: [ Similar to above. Analysis and assessment. ]\n"
    "## Score: [ float score or N/A ]\n"
    "# Summary: [ Summary of the evaluation ]\n"
    "\n"
    "# User Request Refinement:\n"
    "## Refinement Comments: [Specific suggestions for improving the user request]\n"
    "## Refined Request: [The improved, more specific user request for editing like a standard user "
    "instruction]"
)

# ---- shared machinery ------------------------------------------------------------------------------------------


class EditJudgeUnparsableError(ValueError):
    """A judge's answer could not be read (raised under ``on_unparsable="raise"``)."""


@dataclass(frozen=True)
class ChatTurn:
    """One question to the judge: the user turn's parts in order (text, or a PIL image), an optional system prompt,
    the sampling seed and a label naming the question (``"sc"``, ``"pq"``, ...)."""

    parts: tuple
    label: str
    system: str | None = None
    seed: int | None = None


@dataclass
class _Policy:
    """``on_unparsable``: ``"official"`` (the judge's own fallback), ``"zero"``, ``"none"``, ``"raise"`` or a number."""

    value: Any = field(default="official")

    @classmethod
    def of(cls, value: Any, judge: str, official: str) -> _Policy:
        if isinstance(value, bool):
            raise ValueError(f"{judge}: on_unparsable must be 'official', 'zero', 'none', 'raise' or a number, got "
                             f"{value!r}")
        if isinstance(value, (int, float)):
            return cls(float(value))
        text = str(value).lower()
        if text not in ("official", "zero", "none", "raise"):
            raise ValueError(f"{judge}: on_unparsable must be 'official' ({official}), 'zero', 'none' (excluded from "
                             f"the statistics), 'raise' or a number; got {value!r}")
        return cls(text)

    def fallback(self, judge: str, answer: str | None) -> float | None:
        """What an unreadable answer scores under a policy other than ``"official"``."""
        if self.value == "raise":
            raise EditJudgeUnparsableError(f"{judge}: could not read the judge's answer {(answer or '')[:300]!r}; "
                                           f"pass on_unparsable='official', 'zero' or 'none' to go on")
        if self.value == "none":
            return None
        return 0.0 if self.value in ("zero", "official") else float(self.value)


class EditJudge(VLMReward):
    """Base of the editing judges: a backend (server or in-process), the questions of one edit (`turns`) and the
    reduction of the answers to one score (`score_answers`). Subclasses set ``name``, the defaults and those two.

    Args:
        backend: ``"server"`` (an OpenAI-compatible chat-completions server) or ``"transformers"`` (in-process).
        model (alias ``model_name_or_path``): the served model name, or the checkpoint (transformers backend).
        on_unparsable: see the module docstring.
        temperature, max_tokens, top_p, top_k, seed: sampling (the judge's released settings by default; ``top_k`` is
            sent as an extra field, which vLLM and sglang read).
        base_url, api_key_env, max_concurrency, timeout, max_retries, on_failure, health_check: the server backend's
            settings (`VLMJudgeReward`).
        processor_name_or_path, device (alias ``reward_device``), dtype, batch_size: the in-process backend's settings.
    """

    name = "edit_judge"
    default_server_model = ""
    default_inprocess_model = ""
    image_format = "png"
    default_temperature = 0.0
    default_max_tokens: int | None = 512
    default_top_p: float | None = None
    default_top_k: int | None = None
    default_seed: int | None = None
    official_fallback = "score 0"

    def __init__(self, backend: str = "server", model: str | None = None, on_unparsable: Any = "official",
                 temperature: float | None = None, max_tokens: int | None = -1, top_p: float | None = -1.0,
                 top_k: int | None = -1, seed: int | None = -1, base_url: str = "http://127.0.0.1:8000/v1",
                 api_key_env: str | None = "OPENAI_API_KEY", max_concurrency: int = 8, timeout: float = 300.0,
                 max_retries: int = 2, on_failure: str = "skip", health_check: bool = True,
                 processor_name_or_path: str | None = None, device: str | None = None, dtype: Any = None,
                 batch_size: int = 4, reward_device: str | None = None, model_name_or_path: str | None = None):
        if model is not None and model_name_or_path is not None and model != model_name_or_path:
            raise ValueError(f"{self.name}: give the judge once: model={model!r}, model_name_or_path="
                             f"{model_name_or_path!r}")
        model = model if model is not None else model_name_or_path
        if backend not in ("server", "transformers"):
            raise ValueError(f"{self.name}: backend must be 'server' (an OpenAI-compatible server) or 'transformers' "
                             f"(in-process), got {backend!r}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.backend = backend
        self.policy = _Policy.of(on_unparsable, self.name, self.official_fallback)
        self.temperature = self.default_temperature if temperature is None else float(temperature)
        self.max_tokens = self.default_max_tokens if max_tokens == -1 else max_tokens
        self.top_p = self.default_top_p if top_p == -1.0 else top_p
        self.top_k = self.default_top_k if top_k == -1 else top_k
        self.seed = self.default_seed if seed == -1 else seed
        if self.temperature < 0:
            raise ValueError(f"{self.name}: temperature must be >= 0, got {self.temperature}")
        if self.max_tokens is not None and int(self.max_tokens) < 1:
            raise ValueError(f"{self.name}: max_tokens must be >= 1 or None, got {self.max_tokens}")
        self.processor_name_or_path = processor_name_or_path
        self.__name__ = self.name
        self._client: VLMJudgeReward | None = None
        if backend == "server":
            self.model = model or self.default_server_model
            self._client = VLMJudgeReward(
                model=self.model, base_url=base_url, api_key_env=api_key_env, prompt_template="{prompt}",
                max_concurrency=max_concurrency, timeout=timeout, max_retries=max_retries,
                image_format=self.image_format, max_tokens=self.max_tokens, temperature=self.temperature,
                on_failure=on_failure, health_check=health_check,
            )
        else:
            self.model = model or self.default_inprocess_model

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r}, model={self.model!r})"

    # ---- what subclasses define ----------------------------------------------------------------------------

    def turns(self, instruction: str, source: Image.Image, edited: Image.Image) -> list[ChatTurn]:
        raise NotImplementedError

    def score_answers(self, instruction: str, answers: dict[str, list[str | None]]
                      ) -> tuple[float | None, dict[str, float | None]]:
        """``(score, parts)`` of one edit from its answers by question label (several per label with passes)."""
        raise NotImplementedError

    # ---- requests ------------------------------------------------------------------------------------------

    def request_body(self, turn: ChatTurn) -> dict:
        """The chat-completions request of one question: images as data URLs in ``image_format``, parts in order."""
        mime = "image/png" if self.image_format == "png" else "image/jpeg"
        content = []
        for part in turn.parts:
            if isinstance(part, Image.Image):
                url = f"data:{mime};base64,{encode_image(part, self.image_format)}"
                content.append({"type": "image_url", "image_url": {"url": url}})
            else:
                content.append({"type": "text", "text": str(part)})
        messages: list[dict] = []
        if turn.system:
            messages.append({"role": "system", "content": turn.system})
        messages.append({"role": "user", "content": content})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        if self.top_p is not None:
            body["top_p"] = float(self.top_p)
        if self.top_k is not None:
            body["top_k"] = int(self.top_k)
        if turn.seed is not None:
            body["seed"] = int(turn.seed)
        return body

    def ask(self, turns: Sequence[ChatTurn]) -> tuple[list[str | None], list[bool]]:
        """The answers to ``turns`` (and which requests failed) from the chosen backend."""
        if self._client is not None:
            return self._client.complete_many([self.request_body(t) for t in turns])
        return self.generate_answers(turns), [False] * len(turns)

    # ---- in-process backend --------------------------------------------------------------------------------

    def to(self, device: Any = None) -> EditJudge:
        """Move the in-process judge (the server backend has no local weights: nothing happens)."""
        return self if self._client is not None else super().to(device)

    def offload(self) -> None:
        if self._client is None:
            super().offload()

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        return load_vlm(self.model, self.processor_name_or_path, device, dtype)

    def generate_answers(self, turns: Sequence[ChatTurn]) -> list[str]:
        """The in-process judge's answers, ``batch_size`` questions per ``generate`` (greedy at temperature 0, else
        sampled with ``top_p`` / ``top_k`` under an RNG seeded with the chunk's first seed)."""
        import torch

        model, processor = self.load()
        answers: list[str] = []
        with self._lock, torch.inference_mode():
            for sl in self.chunks(len(turns)):
                chunk = list(turns[sl])
                texts, images = [], []
                for turn in chunk:
                    content = [{"type": "image"} if isinstance(p, Image.Image) else {"type": "text", "text": str(p)}
                               for p in turn.parts]
                    texts.append(chat_content_text(processor, content, turn.system))
                    images += [p for p in turn.parts if isinstance(p, Image.Image)]
                batch = vlm_batch(processor, texts, images, model.device)
                sampling: dict[str, Any] = {"do_sample": self.temperature > 0}
                if self.temperature > 0:
                    sampling.update(temperature=self.temperature, top_p=self.top_p or 1.0, top_k=self.top_k or 0)
                seed = next((t.seed for t in chunk if t.seed is not None), 0)
                devices = [model.device] if model.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(seed)
                    output = model.generate(**batch, max_new_tokens=int(self.max_tokens or 512), **sampling)
                answers += processor.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        return [a.strip() for a in answers]

    # ---- scoring -------------------------------------------------------------------------------------------

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> RewardOutput:
        prompts, images = list(prompts), list(images)
        if len(prompts) != len(images):
            raise ValueError(f"{self.name} got {len(prompts)} prompts and {len(images)} images")
        sources = source_images(columns, len(images), self.name)
        if not images:
            return RewardOutput([])
        per_sample = [self.turns(p, s, as_rgb(e)) for p, s, e in zip(prompts, sources, images)]
        flat = [t for turns in per_sample for t in turns]
        answers, failed = self.ask(flat)
        scores: list[float | None] = []
        parts: list[dict[str, float | None]] = []
        notes: list[str | None] = []
        n_failed = 0
        start = 0
        for prompt, turns in zip(prompts, per_sample):
            stop = start + len(turns)
            if any(failed[start:stop]):
                n_failed += 1
                scores.append(None)
                parts.append({})
                notes.append("the judge's request failed")
            else:
                by_label: dict[str, list[str | None]] = {}
                for turn, answer in zip(turns, answers[start:stop]):
                    by_label.setdefault(turn.label, []).append(answer)
                score, detail = self.score_answers(prompt, by_label)
                scores.append(score)
                parts.append(detail)
                notes.append(None if score is not None else "unreadable answer")
            start = stop
        report_failed_samples(n_failed)
        keys = dict.fromkeys(k for detail in parts for k in detail)
        return RewardOutput(scores, notes=notes, metrics={k: [d.get(k) for d in parts] for k in keys})


# ---- EditScore -------------------------------------------------------------------------------------------------

_NUMBER = r"[-+]?\d*\.?\d+"


def _json_candidates(target: str) -> list[str]:
    """The repair stages of EditScore's reader, in order: as is; Python words as JSON and (if that alone makes it
    valid) single quotes as double quotes, else bare keys quoted; then inner double quotes of ``reasoning``
    escaped."""
    quoted = re.sub(r"\bNone\b", "null", re.sub(r"\bFalse\b", "false", re.sub(r"\bTrue\b", "true", target)))
    swapped = quoted.replace("'", '"')
    try:
        json.loads(swapped)
        second = swapped
    except json.JSONDecodeError:
        second = re.sub(r"([\{\s,])(\w+)\s*:", r'\1"\2":', quoted)

    def escape_reasoning(match: re.Match) -> str:
        return match.group(1) + match.group(2).replace('"', '\\"')

    third = re.sub(r'("reasoning"\s*:\s*")(.*?)(?="\s*[,}])', escape_reasoning, target, flags=re.DOTALL)
    return [target, second, third]


def _scores_of(data: Any) -> list[float] | None:
    """``score`` of a parsed object as floats (a list or a single number); ``None`` when the object has neither a
    reasoning text nor scores (the reader then tries its next stage)."""
    if not isinstance(data, dict):
        return None
    reasoning = next((data[k] for k in ("reasoning", "reason", "rationale") if isinstance(data.get(k), str)), "")
    value = data.get("score")
    scores: list[float] = []
    if isinstance(value, list):
        scores = [float(v) for v in value if isinstance(v, (int, float, str))]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        scores = [float(value)]
    return scores if (reasoning or scores) else None


def parse_editscore_answer(text: str | None) -> list[float]:
    """The ``score`` list of an EditScore answer, read as the authors' JSON reader reads it: the ``{...}`` span, then
    progressively repaired JSON, then, as a last resort, every number after the word ``score``. ``[]`` when there is
    none (the caller's fallback applies).

    Raises:
        ValueError: a ``score`` entry that is a string but not a number (the authors' reader fails there too).
    """
    if not text or not text.strip():
        return []
    match = re.search(r"\{.*\}", text, re.DOTALL)
    target = match.group(0) if match else text.strip()
    for candidate in _json_candidates(target):
        try:
            data = json.loads(candidate)
        except (json.JSONDecodeError, TypeError):
            continue
        scores = _scores_of(data)
        if scores is not None:
            return scores
    score_match = re.search(r"[\"']score[\"']\s*:\s*(.*)", target, re.DOTALL | re.IGNORECASE)
    area = score_match.group(1) if score_match else target
    return [float(n) for n in re.findall(_NUMBER, area)]


def editscore_prompts(instruction: str, score_range: int = 25) -> tuple[str, str]:
    """The SC and PQ questions, built as the authors build them: context, rules and scale lines joined by newlines,
    every ``10`` of the scale text replaced by ``score_range``, ``<instruction>`` replaced by the instruction."""
    scale = str(int(score_range))
    sc = "\n".join([EDITSCORE_CONTEXT, EDITSCORE_TWO_IMAGE_RULE, EDITSCORE_SC_RULE.replace("10", scale)])
    pq = "\n".join([EDITSCORE_CONTEXT, EDITSCORE_PQ_RULE.replace("10", scale)])
    return sc.replace("<instruction>", instruction), pq


def qwen_vl_resize(image: Image.Image, min_pixels: int = 4 * 28 * 28, max_pixels: int = 16384 * 28 * 28
                   ) -> Image.Image:
    """qwen-vl-utils' ``fetch_image`` resize with its default bounds: RGB, bicubic to the ``smart_resize`` size."""
    image = as_rgb(image)
    height, width = smart_resize(image.height, image.width, 28, min_pixels, max_pixels)
    if (width, height) == image.size:
        return image
    return image.resize((width, height), Image.Resampling.BICUBIC)


@register_reward("editscore")
class EditScoreJudge(EditJudge):
    """EditScore's RL reward ``sqrt(SC * PQ) / 10`` per edit (see the module docstring).

    Args:
        score_range: the scale the judge answers on (25 for the released models).
        num_pass: answers per question, averaged (the authors' ``average_last`` reduction: the mean of each pass's
            ``sqrt(SC * PQ)``).
        pq_inputs: the images of the PQ question: ``"source_and_edited"`` (the authors' RL server) or ``"edited"``.
        lora_name_or_path: transformers backend only: a LoRA to merge into ``model`` (``EditScore/EditScore-7B`` on
            ``Qwen/Qwen2.5-VL-7B-Instruct`` by default), as the authors merge it before serving; ``None`` for a merged
            checkpoint.
        on_unparsable: ``"official"`` (default): an answer without scores counts as ``score_range / 2``, a value off
            the 0-10 scale as ``score_range / 2``; ``"zero"`` / ``"none"`` / ``"raise"`` / a number: the whole edit's
            reward when either answer cannot be read.
        other arguments: `EditJudge`.
    """

    name = "editscore"
    default_server_model = "EditScore-7B"
    default_inprocess_model = "Qwen/Qwen2.5-VL-7B-Instruct"
    image_format = "png"
    default_temperature = 0.7
    default_max_tokens = 512
    default_top_p = 0.9
    default_top_k = 20
    default_seed = 42
    official_fallback = "an answer without scores counts as score_range / 2"

    def __init__(self, score_range: int = 25, num_pass: int = 1, pq_inputs: str = "source_and_edited",
                 lora_name_or_path: str | None = "EditScore/EditScore-7B", **kwargs: Any):
        if int(score_range) < 1 or int(num_pass) < 1:
            raise ValueError(f"editscore: score_range and num_pass must be >= 1, got {score_range} and {num_pass}")
        if pq_inputs not in ("source_and_edited", "edited"):
            raise ValueError(f"editscore: pq_inputs must be 'source_and_edited' (the authors' RL server) or 'edited', "
                             f"got {pq_inputs!r}")
        super().__init__(**kwargs)
        self.pq_inputs = pq_inputs
        self.score_range = int(score_range)
        self.num_pass = int(num_pass)
        self.lora_name_or_path = lora_name_or_path

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        if not self.lora_name_or_path:
            return super()._load_vlm(device, dtype)
        from .vlm_models import cached_vlm

        def build() -> tuple[Any, Any]:
            from peft import PeftModel
            from transformers import AutoModelForImageTextToText

            base = AutoModelForImageTextToText.from_pretrained(self.model, dtype=dtype)
            merged = PeftModel.from_pretrained(base, self.lora_name_or_path).merge_and_unload()
            merged.to(device).eval().requires_grad_(False)
            return merged, load_vlm_processor(self.processor_name_or_path or self.model)

        key = ("editscore", self.model, str(self.lora_name_or_path), str(device), str(dtype))
        return cached_vlm(key, build)

    def turns(self, instruction: str, source: Image.Image, edited: Image.Image) -> list[ChatTurn]:
        sc, pq = editscore_prompts(instruction, self.score_range)
        src, out = qwen_vl_resize(source), qwen_vl_resize(edited)
        base = self.seed if self.seed is not None else 0
        turns = []
        for i in range(self.num_pass):
            seed = base + i if self.seed is not None else None
            turns.append(ChatTurn(("<img1>: ", src, "<img2>: ", out, sc), "sc", seed=seed))
            pq_parts = ("<img1>: ", src, "<img2>: ", out, pq) if self.pq_inputs == "source_and_edited" else (
                "<img1>: ", out, pq)
            turns.append(ChatTurn(pq_parts, "pq", seed=seed))
        return turns

    def _part(self, answer: str | None) -> float | None:
        """One answer's min score on the 0-10 scale, the official fallbacks applied; ``None`` when unreadable under
        another policy."""
        try:
            scores = parse_editscore_answer(answer)
        except ValueError:
            scores = []
        if not scores:
            if self.policy.value != "official":
                return None
            scores = [self.score_range / 2]
        value = min(scores) / (self.score_range / 10)
        if not 0.0 <= value <= 10.0:
            if self.policy.value != "official":
                return None
            value = self.score_range / 2  # as the authors' batch path writes it (on the 0-10 scale: 12.5)
        return value

    def score_answers(self, instruction: str, answers: dict[str, list[str | None]]
                      ) -> tuple[float | None, dict[str, float | None]]:
        passes = []
        for sc_answer, pq_answer in zip(answers["sc"], answers["pq"]):
            sc, pq = self._part(sc_answer), self._part(pq_answer)
            if sc is None or pq is None:
                bad = sc_answer if sc is None else pq_answer
                return self.policy.fallback(self.name, bad), {"sc": sc, "pq": pq, "overall": None}
            passes.append((sc, pq, math.sqrt(sc * pq)))
        sc = sum(p[0] for p in passes) / len(passes)
        pq = sum(p[1] for p in passes) / len(passes)
        overall = sum(p[2] for p in passes) / len(passes)
        return overall / 10.0, {"sc": sc, "pq": pq, "overall": overall}


# ---- UnifiedReward-Edit ----------------------------------------------------------------------------------------


def parse_unifiedreward_edit_scores(text: str | None) -> list[float] | None:
    """The first two ``score`` values of a UnifiedReward-Edit answer, read as Pref-GRPO reads them (the whole text as
    JSON, else its ``{...}`` span; a JSON string holding JSON is read again); ``None`` when there are not two."""
    if not text:
        return None
    text = text.strip()
    payload: str | None = None
    try:
        decoded = json.loads(text)
        if isinstance(decoded, dict):
            payload = json.dumps(decoded)
        elif isinstance(decoded, str):
            text = decoded.strip()
    except json.JSONDecodeError:
        pass
    if payload is None:
        match = re.search(r"\{.*\}", text, re.DOTALL)
        payload = match.group(0) if match else None
    if payload is None:
        return None
    try:
        obj = json.loads(payload)
    except json.JSONDecodeError:
        return None
    scores = obj.get("score") if isinstance(obj, dict) else None
    if not isinstance(scores, (list, tuple)) or len(scores) < 2:
        return None
    try:
        return [float(scores[0]), float(scores[1])]
    except (TypeError, ValueError):
        return None


@register_reward("unifiedreward_edit")
class UnifiedRewardEditJudge(EditJudge):
    """UnifiedReward-Edit's pointwise scores reduced as Pref-GRPO does, / 25 (see the module docstring).

    Args:
        dimensions: the questions asked: ``["following", "quality"]`` (default), or one of them.
        following_weights: weights of (editing success, over-editing) in the instruction-following mean.
        quality_weights: weights of (naturalness, artifacts) in the quality mean.
        on_unparsable: ``"official"`` / ``"zero"`` (default: an unreadable answer counts as ``[0, 0]``, as in
            Pref-GRPO), ``"none"`` / ``"raise"`` / a number: the edit's reward when an answer cannot be read.
        other arguments: `EditJudge` (greedy decoding and up to 4096 new tokens by default, as the authors' client
            asks with ``do_sample=False``).
    """

    name = "unifiedreward_edit"
    default_server_model = "UnifiedReward"
    default_inprocess_model = "CodeGoat24/UnifiedReward-Edit-qwen3vl-8b"
    image_format = "jpeg"
    default_temperature = 0.0
    default_max_tokens = 4096
    official_fallback = "an unreadable answer counts as [0, 0]"
    SCALE = 25.0

    def __init__(self, dimensions: Sequence[str] = ("following", "quality"),
                 following_weights: Sequence[float] = (1.0, 1.0), quality_weights: Sequence[float] = (1.0, 1.0),
                 **kwargs: Any):
        dims = [dimensions] if isinstance(dimensions, str) else list(dimensions)
        if not dims or any(d not in ("following", "quality") for d in dims) or len(set(dims)) != len(dims):
            raise ValueError(f"unifiedreward_edit: dimensions must be a non-empty subset of ['following', 'quality'], "
                             f"got {dimensions!r}")
        for label, weights in (("following_weights", following_weights), ("quality_weights", quality_weights)):
            if len(list(weights)) != 2 or sum(float(w) for w in weights) <= 0:
                raise ValueError(f"unifiedreward_edit: {label} must be two weights with a positive sum, got {weights!r}")
        super().__init__(**kwargs)
        self.dimensions = dims
        self.weights = {"following": [float(w) for w in following_weights],
                        "quality": [float(w) for w in quality_weights]}

    def turns(self, instruction: str, source: Image.Image, edited: Image.Image) -> list[ChatTurn]:
        questions = {
            "following": ChatTurn((source, edited, UNIFIEDREWARD_EDIT_FOLLOWING_PREFIX + f"{instruction}\n"),
                                  "following"),
            "quality": ChatTurn((edited, UNIFIEDREWARD_EDIT_QUALITY_PROMPT), "quality"),
        }
        return [questions[d] for d in self.dimensions]

    def score_answers(self, instruction: str, answers: dict[str, list[str | None]]
                      ) -> tuple[float | None, dict[str, float | None]]:
        means: dict[str, float | None] = {}
        for dim in self.dimensions:
            answer = answers[dim][0]
            scores = parse_unifiedreward_edit_scores(answer)
            if scores is None:
                if self.policy.value not in ("official", "zero"):
                    return self.policy.fallback(self.name, answer), {d: None for d in self.dimensions}
                scores = [0.0, 0.0]
            w0, w1 = self.weights[dim]
            means[dim] = (w0 * scores[0] + w1 * scores[1]) / (w0 + w1)
        reward = sum(means.values()) / len(means) / self.SCALE
        return reward, means


# ---- RationalRewards -------------------------------------------------------------------------------------------

#: the four aspects of the editing rubric, in the answer's order
RATIONALREWARDS_ASPECTS = ("text_faithfulness", "image_faithfulness", "physical_quality", "text_rendering")
_ASPECT_HEADERS = ("Text Faithfulness", "Image Faithfulness", "Physical and Visual Quality", "Text Rendering")
_AUTHORS_ASPECTS = ("text_faithfulness", "physical_quality", "text_rendering")


def _numeric_score(raw: str) -> float | str:
    """``"N/A"`` as is, else the leading number of ``raw``; ``ValueError`` when it has none."""
    if raw == "N/A":
        return "N/A"
    match = re.match(r"^\s*(\d+(?:\.\d+)?)", raw.strip())
    if not match:
        raise ValueError(f"no score in {raw!r}")
    return float(match.group(1))


def _blocks_by_headers(body: str) -> list[str]:
    """The four aspect blocks cut at ``<Header>:`` (each block runs to the next header found after it)."""
    headers = [h + ":" for h in _ASPECT_HEADERS]
    _, _, rest = body.partition(headers[0])
    blocks = []
    for header in headers[1:]:
        block, sep, after = rest.partition(header)
        if sep:
            blocks.append(block)
            rest = after
        else:
            blocks.append(rest)
            rest = ""
    blocks.append(rest)
    return blocks


def parse_rational_scores(text: str | None, variant: str = "authors") -> dict[str, float | str | None]:
    """The four aspect scores of a RationalRewards answer (a float, ``"N/A"`` or ``None``), read as the chosen code
    reads them (text after ``# Summary:`` ignored by both):

    * ``"authors"``: blocks cut at the ``Text Faithfulness:`` ... ``Text Rendering:`` headers (else at numbered lines);
      in each block the **last** ``## Score:`` line whose value reads;
    * ``"flow_factory"``: blocks starting at the numbered header lines (``1. Text Faithfulness`` ...; else cut at the
      headers); in each block the **first** line matching ``Score:`` (any case, ``##`` optional) whose value reads.
    """
    result: dict[str, float | str | None] = dict.fromkeys(RATIONALREWARDS_ASPECTS)
    if not text:
        return result
    body = text.split("# Summary:")[0]
    if variant == "authors":
        if _ASPECT_HEADERS[0] + ":" in body:
            blocks = _blocks_by_headers(body)
        else:
            sections = re.split(r"\n\s*\d+\.\s+", body)
            blocks = [sections[i] if len(sections) > i else "" for i in range(1, 5)]
        for aspect, block in zip(RATIONALREWARDS_ASPECTS, blocks):
            for line in block.split("\n"):
                line = line.strip()
                if "## Score:" in line:
                    try:
                        result[aspect] = _numeric_score(line.split("## Score:")[-1].strip())
                    except ValueError:
                        continue
        return result
    if variant != "flow_factory":
        raise ValueError(f"variant must be 'authors' or 'flow_factory', got {variant!r}")
    found: dict[str, list[str]] = {}
    current: str | None = None
    for raw_line in body.split("\n"):
        stripped = raw_line.strip()
        header = next((a for i, (a, h) in enumerate(zip(RATIONALREWARDS_ASPECTS, _ASPECT_HEADERS))
                       if stripped.startswith(f"{i + 1}.") and h in stripped), None)
        if header is not None:
            current = header
            found[current] = [raw_line]
        elif current is not None:
            found[current].append(raw_line)
    blocks_by_aspect = {a: "\n".join(lines) for a, lines in found.items()}
    if not blocks_by_aspect and _ASPECT_HEADERS[0] + ":" in body:
        blocks_by_aspect = dict(zip(RATIONALREWARDS_ASPECTS, _blocks_by_headers(body)))
    for aspect, block in blocks_by_aspect.items():
        for line in block.split("\n"):
            match = re.search(r"(?:##\s*)?Score\s*:\s*(.+)$", line.strip(), re.IGNORECASE)
            if not match:
                continue
            try:
                result[aspect] = _numeric_score(match.group(1).strip())
                break
            except ValueError:
                continue
    return result


def aggregate_rational_scores(scores: dict[str, float | str | None], aspects: Sequence[str], clamp: bool
                              ) -> float | None:
    """``(mean - 1) / 3`` of the numeric scores of ``aspects`` (``None`` and ``"N/A"`` skipped); with ``clamp`` each
    score is clamped to [1, 4] and the result to [0, 1] (Flow-Factory), without it neither is (the authors).
    ``None`` when no aspect has a number."""
    values = []
    for aspect in aspects:
        value = scores.get(aspect)
        if value is None or value == "N/A":
            continue
        value = float(value)
        if not math.isfinite(value):
            continue
        values.append(min(4.0, max(1.0, value)) if clamp else value)
    if not values:
        return None
    reward = (sum(values) / len(values) - 1.0) / 3.0
    return min(1.0, max(0.0, reward)) if clamp else reward


@register_reward("rationalrewards_edit")
class RationalRewardsEditJudge(EditJudge):
    """RationalRewards' editing rubric reduced to one number (see the module docstring).

    Args:
        aggregation: ``"authors"`` (default; the authors' RL code: text faithfulness, physical quality and text
            rendering, unclamped) or ``"flow_factory"`` (Flow-Factory: the four aspects, clamped).
        aspects: the aspects averaged, overriding the aggregation's own choice (names in
            ``RATIONALREWARDS_ASPECTS``).
        on_unparsable: ``"official"`` / ``"zero"`` (default: no readable aspect scores 0, as both codes do),
            ``"none"``, ``"raise"`` or a number.
        other arguments: `EditJudge` (temperature 0.1 and 2048 new tokens by default, as both codes sample).
    """

    name = "rationalrewards_edit"
    default_server_model = "RationalRewards-8B-Edit"
    default_inprocess_model = "TIGER-Lab/RationalRewards-8B-Edit"
    image_format = "png"
    default_temperature = 0.1
    default_max_tokens = 2048
    official_fallback = "no readable aspect scores 0"

    def __init__(self, aggregation: str = "authors", aspects: Sequence[str] | None = None, **kwargs: Any):
        if aggregation not in ("authors", "flow_factory"):
            raise ValueError(f"rationalrewards_edit: aggregation must be 'authors' (the authors' RL code) or "
                             f"'flow_factory' (Flow-Factory's reward), got {aggregation!r}")
        if aspects is not None:
            aspects = [aspects] if isinstance(aspects, str) else list(aspects)
            unknown = [a for a in aspects if a not in RATIONALREWARDS_ASPECTS]
            if not aspects or unknown:
                raise ValueError(f"rationalrewards_edit: aspects must be a non-empty subset of "
                                 f"{list(RATIONALREWARDS_ASPECTS)}, got {aspects!r}")
        super().__init__(**kwargs)
        self.aggregation = aggregation
        default = _AUTHORS_ASPECTS if aggregation == "authors" else RATIONALREWARDS_ASPECTS
        self.aspects = tuple(aspects) if aspects is not None else default

    def turns(self, instruction: str, source: Image.Image, edited: Image.Image) -> list[ChatTurn]:
        head = f"User Instruction: {instruction}\nYou are provided with two images:\n1. Source Image "
        tail = ("\n\nGive your analysis and judgement following guidelines in the system prompt. \n\n"
                + RATIONALREWARDS_EDIT_GUIDELINE)
        return [ChatTurn((head, source, "\n2. Edited Image ", edited, tail), "rubric",
                         system=RATIONALREWARDS_EDIT_SYSTEM_PROMPT)]

    def score_answers(self, instruction: str, answers: dict[str, list[str | None]]
                      ) -> tuple[float | None, dict[str, float | None]]:
        answer = answers["rubric"][0]
        scores = parse_rational_scores(answer, self.aggregation)
        parts = {a: (float(v) if isinstance(v, float) else None) for a, v in scores.items()}
        reward = aggregate_rational_scores(scores, self.aspects, clamp=self.aggregation == "flow_factory")
        if reward is None:
            return self.policy.fallback(self.name, answer), parts
        return reward, parts
