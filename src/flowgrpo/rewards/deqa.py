"""`deqa`: DeQA-Score's expected quality level, as an in-process scorer for any transformers vision-language model.

DeQA-Score (You et al., 2025; ``zhiyuanyou/DeQA-Score-Mix3``) asks its model
``USER: How would you rate the quality of this image?\\n<|image|>\\nASSISTANT: The quality of the image is`` and
reads the next-token logits ``z`` of the five level words. Its score, and this reward::

    p = softmax(z[excellent], z[good], z[fair], z[poor], z[bad])     # over the five level tokens only
    deqa = (p . [5, 4, 3, 2, 1]) / 5                                 # in [0.2, 1]

(the division by 5 is Flow-GRPO's scale for DeQA). Each level token is the first token of the word as it follows
"is" (with a leading space for byte-level BPE tokenizers; DeQA's LLaMA tokenizer gives the same "▁word" piece).

**The official checkpoint does not load here.** ``zhiyuanyou/DeQA-Score-Mix3`` is an mPLUG-Owl2 model whose
``trust_remote_code`` modelling targets transformers 4.36 (up to 4.46 with the authors' patch): it builds
``LlamaRotaryEmbedding(dim, max_position_embeddings, base)`` and imports LLaMA attention classes that transformers
5 no longer has. So this reward applies the same scorer to any ``AutoModelForImageTextToText`` (a Qwen2.5-VL by
default): the question goes in a user turn with the image, rendered with the model's chat template, followed by the
assistant prefix ``The quality of the image is``. To score with the official DeQA-Score model, run its own code in
an environment with transformers 4.36 behind flowgrpo's reward server and use the ``remote`` reward (see
docs/rewards.md, "deqa").

``pad_to_square`` reproduces DeQA's ``expand2square`` (the image centred on a square filled with the image
processor's mean colour) before the model's own preprocessing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PIL import Image

from .registry import register_reward
from .vlm_models import VLMReward, as_rgb, chat_text, load_vlm, vlm_batch

__all__ = ["DEFAULT_DEQA_MODEL", "DEQA_LEVELS", "DEQA_QUESTION", "DeQAScore", "expand_to_square", "level_token_ids"]

DEFAULT_DEQA_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
DEQA_QUESTION = "How would you rate the quality of this image?"
DEQA_ANSWER_PREFIX = "The quality of the image is"
#: The level words from best to worst, with their values.
DEQA_LEVELS = (("excellent", 5.0), ("good", 4.0), ("fair", 3.0), ("poor", 2.0), ("bad", 1.0))


def level_token_ids(tokenizer: Any, words: Sequence[str], prefix: str = " ") -> list[int]:
    """The first token of ``prefix + word`` for each level word; the tokens must be distinct."""
    ids = []
    for word in words:
        encoded = tokenizer.encode(prefix + word, add_special_tokens=False)
        if not encoded:
            raise ValueError(f"the tokenizer encodes the level word {word!r} to no tokens")
        ids.append(int(encoded[0]))
    if len(set(ids)) != len(ids):
        raise ValueError(f"the level words {list(words)} share first tokens {ids}; this tokenizer cannot tell them "
                         f"apart with level_token_prefix={prefix!r}")
    return ids


def expand_to_square(image: Image.Image, fill: tuple[int, ...]) -> Image.Image:
    """DeQA's ``expand2square``: ``image`` pasted centred (offset ``(long - short) // 2``) on a square of ``fill``."""
    width, height = image.size
    if width == height:
        return image
    side = max(width, height)
    square = Image.new(image.mode, (side, side), fill)
    square.paste(image, ((side - width) // 2, (side - height) // 2))
    return square


@register_reward("deqa")
class DeQAScore(VLMReward):
    """DeQA-Score's expected level score in [0.2, 1] from any transformers VLM (see the module docstring).

    Args:
        model_name_or_path: an ``AutoModelForImageTextToText`` (hub id or local folder).
        processor_name_or_path: its processor (default: the model's folder).
        question, answer_prefix: the user question and the assistant's opening words before the level word.
        levels: ``(word, value)`` pairs; the softmax runs over the words' first tokens.
        level_token_prefix: text before each level word when finding its token (" " for byte-level BPE tokenizers
            such as Qwen's, "" for SentencePiece ones such as LLaMA's, which mark the word start themselves).
        divide_by: the expected value is divided by this (5: Flow-GRPO's scale; 1: DeQA's 1-5 scale).
        pad_to_square: apply DeQA's ``expand2square`` first.
        device (alias ``reward_device``), dtype, batch_size: placement, precision (bfloat16 on CUDA, float32 on CPU
            by default) and chunking.
    """

    def __init__(
        self,
        model_name_or_path: str = DEFAULT_DEQA_MODEL,
        processor_name_or_path: str | None = None,
        question: str = DEQA_QUESTION,
        answer_prefix: str = DEQA_ANSWER_PREFIX,
        levels: Sequence[tuple[str, float]] = DEQA_LEVELS,
        level_token_prefix: str = " ",
        divide_by: float = 5.0,
        pad_to_square: bool = False,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 8,
        reward_device: str | None = None,
    ):
        levels = [(str(word), float(value)) for word, value in levels]
        if len(levels) < 2:
            raise ValueError(f"levels needs at least two (word, value) pairs, got {levels}")
        if divide_by <= 0:
            raise ValueError(f"divide_by must be positive, got {divide_by}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.model_name_or_path = model_name_or_path
        self.processor_name_or_path = processor_name_or_path
        self.question = question
        self.answer_prefix = answer_prefix
        self.levels = levels
        self.level_token_prefix = level_token_prefix
        self.divide_by = float(divide_by)
        self.pad_to_square = bool(pad_to_square)
        self.__name__ = "deqa"

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        return load_vlm(self.model_name_or_path, self.processor_name_or_path, device, dtype)

    def _prepare(self, image: Any, processor: Any) -> Image.Image:
        image = as_rgb(image)
        if self.pad_to_square:
            mean = getattr(processor.image_processor, "image_mean", None) or (0.0, 0.0, 0.0)
            image = expand_to_square(image, tuple(int(x * 255) for x in mean))
        return image

    def level_probabilities(self, images: Sequence[Any]) -> Any:
        """Float32 softmax over the level tokens, shape ``(n, len(levels))``, in the order of ``levels``."""
        import torch

        model, processor = self.load()
        token_ids = level_token_ids(processor.tokenizer, [w for w, _ in self.levels], self.level_token_prefix)
        text = chat_text(processor, self.question) + self.answer_prefix
        chunks = []
        for sl in self.chunks(len(images)):
            chunk = [self._prepare(im, processor) for im in images[sl]]
            batch = vlm_batch(processor, [text] * len(chunk), chunk, model.device)
            logits = model(**batch).logits[:, -1, :].float()
            chunks.append(torch.softmax(logits[:, token_ids], dim=-1))
        return torch.cat(chunks)

    def _score(self, prompts: list[str], images: list[Any], **columns: Any) -> Any:
        """The expected level value per image, divided by ``divide_by`` (the prompts are not used)."""
        import torch

        probs = self.level_probabilities(images)
        values = torch.tensor([v for _, v in self.levels], dtype=probs.dtype, device=probs.device)
        return probs @ values / self.divide_by
