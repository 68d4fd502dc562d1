"""`geneval2`: GenEval 2's Soft-TIFA (Kamath et al., "GenEval 2: Addressing Benchmark Drift in Text-to-Image
Evaluation", 2025; ``facebookresearch/GenEval2`` ``evaluation.py``), the compositional score a VQA model gives an image
over a prompt's atomic questions, with Qwen3-VL-8B-Instruct.

Each prompt of the benchmark has a ``vqa_list`` of ``[question, answer]`` pairs (one per atom: objects, counts,
attributes, positions, verbs). For each pair the judge sees one user turn ``[image, "{question} Answer in one
word."]`` (its chat template with the generation prompt) and the score of the pair is the probability mass of the
answer's forms at the first generated token::

    p = sum over forms f of softmax(z)[first_token(f)]        # z: the first step's scores, whole vocabulary

as the official ``send_message_with_image`` computes it from greedy ``generate(max_new_tokens=1, do_sample=False,
output_scores=True)``: ``z`` are the generation's processed scores (greedy decoding adds no sampling warpers; a
repetition penalty in the generation config would apply), float32; ``first_token(f)`` is
``tokenizer.encode(f)[0]``, so for Qwen's tokenizer the first token of ``" 7"`` is the bare space; the forms are
summed in order, repeats counted again. The forms (`answer_forms`):

* a question starting with ``"How many"`` and answer ``a``: ``[a, a.capitalize(), " " + a, " " + a.capitalize(),
  digits(a), " " + digits(a)]`` with ``digits`` mapping ``one``..``ten`` to ``1``..``10`` and anything else to
  ``"other"``;
* any other question: ``["Yes", "yes", " yes", " Yes"]`` (the official code ignores the stored answer there; every
  benchmark answer is ``Yes``).

A prompt's score is the arithmetic mean of its pairs' scores (``aggregation="arithmetic"``, Soft-TIFA AM) or their
geometric mean (``"geometric"``, Soft-TIFA GM, scipy's ``gmean``: ``exp(mean(log p))``, 0 when a pair scores 0), in
[0, 1]. The benchmark number is 100 times the mean over prompts (`flowgrpo.evaluate.geneval2_scoring`). The reward
reads the pairs from the dataset column ``vqa_list`` (``scripts/prepare_data.py geneval2`` writes it); it returns
both means as metrics (``rewards/geneval2/soft_tifa_am``, ``.../soft_tifa_gm``).

Images: the official code runs transformers 4.57 with torchvision, whose Qwen3-VL processor has the torchvision image
processor: it resizes to ``smart_resize(h, w, 32, 65536, 16777216)`` (the released processor's bounds) with torch's
uint8 bicubic kernel. transformers without torchvision falls back to its PIL image processor, whose bicubic differs;
so each image is resized here with torch's kernel first (`flowgrpo.rewards.vlm_models.resize_like_torchvision_processor`)
and either processor then keeps it as it is. Without that step, on images the processor resizes, a tiny judge's
question scores differed from the official ones by up to 2.9e-3 relative (9.0e-4 for the arithmetic mean over the
prompts, 8.4e-4 for the geometric); with it, by up to 1.7e-6.

The official code asks one question at a time; here the (image, question) rows of a batch go through one
``generate`` call, left-padded (Qwen3-VL's multimodal positions follow the attention mask): the same scores up to
float rounding. Memory: Qwen3-VL-8B, about 17.5 GB in bfloat16 (the official ``dtype="auto"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .composition import RewardOutput
from .registry import register_reward
from .vlm_models import VLMReward, chat_text, load_vlm, resize_like_torchvision_processor, vlm_batch

__all__ = ["DEFAULT_GENEVAL2_MODEL", "GENEVAL2_AGGREGATIONS", "GENEVAL2_QUESTION", "GenEval2Reward", "answer_forms",
           "soft_tifa_mean"]

DEFAULT_GENEVAL2_MODEL = "Qwen/Qwen3-VL-8B-Instruct"
GENEVAL2_QUESTION = "{question} Answer in one word."
GENEVAL2_AGGREGATIONS = ("arithmetic", "geometric")
_YES_FORMS = ("Yes", "yes", " yes", " Yes")
_DIGITS = {"one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7", "eight": "8",
           "nine": "9", "ten": "10"}


def answer_forms(question: str, answer: str) -> list[str]:
    """The answer forms whose first-token probabilities GenEval2 sums for one question (module docstring)."""
    if question.startswith("How many"):
        digits = _DIGITS.get(answer, "other")
        return [answer, answer.capitalize(), " " + answer, " " + answer.capitalize(), digits, " " + digits]
    return list(_YES_FORMS)


def soft_tifa_mean(scores: Sequence[float], aggregation: str = "arithmetic") -> float:
    """A prompt's Soft-TIFA from its questions' scores: ``sum / n`` (arithmetic) or ``exp(mean(log p))``
    (geometric, in float64 as scipy's ``gmean``; 0 when a score is 0)."""
    import numpy as np

    if not scores:
        raise ValueError("Soft-TIFA needs at least one question score")
    if aggregation == "arithmetic":
        return sum(scores) / len(scores)
    if aggregation == "geometric":
        with np.errstate(divide="ignore"):
            return float(np.exp(np.mean(np.log(np.asarray(scores, dtype=np.float64)))))
    raise ValueError(f"aggregation must be one of {GENEVAL2_AGGREGATIONS}, got {aggregation!r}")


def _pairs(vqa_list: Any, index: int) -> list[tuple[str, str]]:
    """``vqa_list`` of one sample as ``[(question, answer)]``; a JSON string is accepted (CSV/parquet columns)."""
    if isinstance(vqa_list, str):
        import json

        vqa_list = json.loads(vqa_list)
    try:
        pairs = [(str(q), str(a)) for q, a in vqa_list]
    except (TypeError, ValueError):
        raise ValueError(f"geneval2: sample {index}'s vqa_list must be a list of [question, answer] pairs, got "
                         f"{str(vqa_list)[:200]!r}") from None
    if not pairs:
        raise ValueError(f"geneval2: sample {index} has an empty vqa_list")
    return pairs


@register_reward("geneval2")
class GenEval2Reward(VLMReward):
    """Soft-TIFA of each (prompt, image) over the sample's ``vqa_list`` column (see the module docstring).

    Args:
        aggregation: ``"arithmetic"`` (Soft-TIFA AM, the default) or ``"geometric"`` (Soft-TIFA GM) over a prompt's
            questions.
        model_name_or_path: the VQA judge (default ``Qwen/Qwen3-VL-8B-Instruct``, the official one; a local folder
            works); ``processor_name_or_path`` its processor (default: the model's folder).
        question_template: the question sent with the image (``{question}``: the benchmark's question).
        device (alias ``reward_device``), dtype (default bfloat16 on CUDA, float32 on CPU), batch_size (image-question
            rows per ``generate`` call): placement.
    """

    def __init__(
        self,
        aggregation: str = "arithmetic",
        model_name_or_path: str = DEFAULT_GENEVAL2_MODEL,
        processor_name_or_path: str | None = None,
        question_template: str = GENEVAL2_QUESTION,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 8,
        reward_device: str | None = None,
    ):
        if aggregation not in GENEVAL2_AGGREGATIONS:
            raise ValueError(f"aggregation must be 'arithmetic' (Soft-TIFA AM) or 'geometric' (Soft-TIFA GM), got "
                             f"{aggregation!r}")
        if "{question}" not in question_template:
            raise ValueError(f"question_template must contain '{{question}}', got {question_template!r}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.aggregation = aggregation
        self.model_name_or_path = str(model_name_or_path)
        self.processor_name_or_path = processor_name_or_path
        self.question_template = question_template
        self.__name__ = "geneval2"

    def __repr__(self) -> str:
        return f"GenEval2Reward(aggregation={self.aggregation!r}, model={self.model_name_or_path!r})"

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        return load_vlm(self.model_name_or_path, self.processor_name_or_path, device, dtype)

    def answer_probabilities(self, rows: Sequence[tuple[Any, str, list[str]]]) -> list[float]:
        """For ``(image, question, forms)`` rows: the summed first-token probability of the forms (module docstring)."""
        import torch

        model, processor = self.load()
        tokenizer = processor.tokenizer
        resized: dict[int, Any] = {}  # each image once, however many questions it has
        for image, _, _ in rows:
            if id(image) not in resized:
                resized[id(image)] = resize_like_torchvision_processor(image, processor.image_processor)
        out: list[float] = []
        for sl in self.chunks(len(rows)):
            chunk = rows[sl]
            texts = [chat_text(processor, self.question_template.format(question=q)) for _, q, _ in chunk]
            batch = vlm_batch(processor, texts, [resized[id(image)] for image, _, _ in chunk], model.device)
            generated = model.generate(**batch, max_new_tokens=1, do_sample=False, output_scores=True,
                                       return_dict_in_generate=True)
            probs = torch.softmax(generated.scores[0].float(), dim=-1)
            for i, (_, _, forms) in enumerate(chunk):
                total = 0.0
                for form in forms:  # in order, as the official loop adds them
                    total += probs[i, tokenizer.encode(form)[0]].item()
                out.append(total)
        return out

    def question_scores(self, images: Sequence[Any], vqa_lists: Sequence[Any]) -> list[list[float]]:
        """Each image's per-question scores (the official ``score_list``), in ``vqa_list`` order."""
        import torch

        if len(images) != len(vqa_lists):
            raise ValueError(f"geneval2 got {len(images)} images and {len(vqa_lists)} vqa_lists")
        pairs = [_pairs(v, i) for i, v in enumerate(vqa_lists)]
        rows = [(image, q, answer_forms(q, a)) for image, sample in zip(images, pairs) for q, a in sample]
        with self._lock, torch.inference_mode():
            probabilities = self.answer_probabilities(rows)
        out, start = [], 0
        for sample in pairs:
            out.append(probabilities[start:start + len(sample)])
            start += len(sample)
        return out

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> RewardOutput:
        if len(prompts) != len(images):
            raise ValueError(f"geneval2 got {len(prompts)} prompts and {len(images)} images")
        vqa_lists = columns.get("vqa_list")
        if vqa_lists is None:
            raise ValueError("geneval2 needs the dataset column 'vqa_list' (the [question, answer] pairs of each "
                             "prompt, as in GenEval2's geneval2_data.jsonl; `python scripts/prepare_data.py geneval2` "
                             "writes it)")
        if not images:
            return RewardOutput([])
        scores = self.question_scores(list(images), list(vqa_lists))
        am = [soft_tifa_mean(s, "arithmetic") for s in scores]
        gm = [soft_tifa_mean(s, "geometric") for s in scores]
        total = am if self.aggregation == "arithmetic" else gm
        notes = [", ".join(f"{p:.2f}" for p in s) for s in scores]
        for value in total:
            if not math.isfinite(value):
                raise ValueError(f"geneval2 produced a non-finite score {value}")
        return RewardOutput(total, notes=notes, metrics={"soft_tifa_am": am, "soft_tifa_gm": gm})
