"""`vqascore`: VQAScore (Lin et al., 2024), the probability that a vision-language model answers "Yes" when asked
whether the image shows the prompt.

For each (prompt, image) pair the question ``question_template.format(prompt=prompt)`` (by default
``Does this figure show "{prompt}"? Please answer yes or no.``, VQAScore's question) is put in one user turn with
the image, rendered with the model's chat template and its generation prompt. One forward pass (no generation)
gives the logits ``z`` at the last position, where the answer's first token is predicted, and::

    vqascore = softmax(z)[first token of answer]          # softmax over the whole vocabulary

with ``answer="Yes"`` (its first token as the tokenizer encodes it, without special tokens), as t2v_metrics
computes it for its Qwen2-VL-family models from the first generated step's scores. The score lies in [0, 1].
t2v_metrics takes those scores from a greedy ``generate`` call, so a model whose generation config has a repetition
penalty gets it applied there to tokens already in the prompt; here the raw logits are used (identical whenever the
answer token does not occur in the prompt).

Any ``AutoModelForImageTextToText`` with a chat template works; the default is ``Qwen/Qwen2.5-VL-7B-Instruct``
(about 16.6 GB of weights in bfloat16). Images are processed by the model's own processor (for Qwen2.5-VL: resized
to multiples of 28 within the processor's pixel bounds, CLIP mean/std).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .registry import register_reward
from .vlm_models import VLMReward, chat_text, load_vlm, vlm_batch

__all__ = ["DEFAULT_VQASCORE_MODEL", "DEFAULT_VQASCORE_QUESTION", "VQAScore", "answer_token_id"]

DEFAULT_VQASCORE_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
DEFAULT_VQASCORE_QUESTION = 'Does this figure show "{prompt}"? Please answer yes or no.'


def answer_token_id(tokenizer: Any, answer: str) -> int:
    """The first token id of ``answer`` as the tokenizer encodes it without special tokens."""
    ids = tokenizer.encode(answer, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the tokenizer encodes the answer {answer!r} to no tokens")
    return int(ids[0])


@register_reward("vqascore")
class VQAScore(VLMReward):
    """P("Yes") of a vision-language model asked whether the image shows the prompt (see the module docstring).

    Args:
        model_name_or_path: any ``AutoModelForImageTextToText`` (hub id or local folder).
        processor_name_or_path: where its processor comes from (default: the model's folder).
        question_template: the question; ``{prompt}`` is the generation prompt.
        answer: the answer whose first token's probability is the score.
        system_prompt: an optional system turn (the chat template's default otherwise).
        device: where the model runs (alias ``reward_device``; default CUDA when available, else CPU).
        dtype: the model's dtype (default bfloat16 on CUDA, float32 on CPU).
        batch_size: pairs per forward pass.
    """

    def __init__(
        self,
        model_name_or_path: str = DEFAULT_VQASCORE_MODEL,
        processor_name_or_path: str | None = None,
        question_template: str = DEFAULT_VQASCORE_QUESTION,
        answer: str = "Yes",
        system_prompt: str | None = None,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 8,
        reward_device: str | None = None,
    ):
        if "{prompt}" not in question_template:
            raise ValueError(f"question_template must contain '{{prompt}}', got {question_template!r}")
        if not answer:
            raise ValueError("answer must be a non-empty string such as 'Yes'")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.model_name_or_path = model_name_or_path
        self.processor_name_or_path = processor_name_or_path
        self.question_template = question_template
        self.answer = answer
        self.system_prompt = system_prompt
        self.__name__ = "vqascore"

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        return load_vlm(self.model_name_or_path, self.processor_name_or_path, device, dtype)

    def answer_logits(self, prompts: Sequence[str], images: Sequence[Any]) -> Any:
        """Float32 next-token logits at the answer position, shape ``(n, vocab)``."""
        import torch

        model, processor = self.load()
        chunks = []
        for sl in self.chunks(len(prompts)):
            texts = [chat_text(processor, self.question_template.format(prompt=p), self.system_prompt)
                     for p in prompts[sl]]
            batch = vlm_batch(processor, texts, images[sl], model.device)
            chunks.append(model(**batch).logits[:, -1, :].float())
        return torch.cat(chunks)

    def _score(self, prompts: list[str], images: list[Any], **columns: Any) -> Any:
        """P(answer) per pair: the softmax of `answer_logits` at the answer's first token."""
        import torch

        logits = self.answer_logits(prompts, images)
        token = answer_token_id(self.load()[1].tokenizer, self.answer)
        return torch.softmax(logits, dim=-1)[:, token]
