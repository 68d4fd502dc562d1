"""Model card (``README.md``) for a LoRA or transformer trained with flowgrpo.

The metadata says ``library_name: diffusers`` (so the Hub shows diffusers' loading code, not transformers'),
``pipeline_tag: text-to-image``, the ``base_model`` when it is a Hub id, the tags and a ``widget`` gallery of the
last evaluation's samples. The body has a ``load_lora_weights`` snippet (``from_pretrained`` of the transformer
for full fine-tuning), the rewards, the training setup, the evaluation scores and the sample images.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

#: How the card's first sentence names each task.
_TASK_WORDS = {"text-to-image": "text-to-image", "image-to-image": "image-editing", "text-to-video": "text-to-video"}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def is_hub_id(name: str | None) -> bool:
    """``namespace/name`` or ``name`` with Hub characters only (a local path such as ``/tmp/x`` or ``./x`` is not)."""
    return bool(name) and bool(_HUB_ID.match(str(name))) and ".." not in str(name)


def card_tag(name: str) -> str:
    """A Hub tag from a reward name or path: lowercase, ``[a-z0-9-_.]`` only."""
    return re.sub(r"[^a-z0-9_.-]+", "-", str(name).lower()).strip("-") or "reward"


@dataclass
class CardSample:
    """One evaluation sample shown on the card: the image's path relative to the card, its prompt and score."""

    image: str
    prompt: str
    score: float | None = None


def _score(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.4f}"


def _escape_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_model_card(repo_id: str, base_model: str | None, rewards: Sequence[str], tags: Sequence[str],
                      trainer_name: str = "Flow-GRPO", paper: dict | None = None, dataset_name: str | None = None,
                      extra_sections: str = "", samples: Sequence[CardSample] = (),
                      contact_sheet: str | None = None, metrics: dict[str, float] | None = None,
                      is_lora: bool = True, license: str | None = None, pipeline_tag: str = "text-to-image",
                      second_expert_lora: str | None = None) -> str:
    """The card's text.

    Args:
        repo_id: where users load the weights from (a Hub repo id, or a local folder).
        base_model: the pipeline the weights apply to (Hub id or local path; only a Hub id enters the metadata).
        rewards: reward names, shown in the text.
        tags: metadata tags.
        extra_sections: markdown added after the usage section (the trainer's training setup and scores).
        samples: evaluation images (paths relative to the card) with prompts and scores.
        contact_sheet: path (relative to the card) of the evaluation contact sheet.
        metrics: evaluation scores, rendered only when ``extra_sections`` has no evaluation section of its own.
        is_lora: LoRA (``load_lora_weights``) or a full transformer (``from_pretrained(subfolder="transformer")``).
        pipeline_tag: the Hub task (``text-to-image``, ``image-to-image`` for editing, ``text-to-video``).
        second_expert_lora: the file of the second expert's LoRA (Wan 2.2 A14B), loaded into ``transformer_2``.
    """
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        library_name="diffusers",
        base_model=base_model if is_hub_id(base_model) else None,
        pipeline_tag=pipeline_tag,
        tags=list(dict.fromkeys(tags)),
        datasets=[dataset_name] if is_hub_id(dataset_name) else None,
        license=license,
        widget=[{"text": s.prompt, "output": {"url": s.image}} for s in samples] or None,
    )
    base = base_model or "<base model id>"
    base_link = f"[{base}](https://huggingface.co/{base})" if is_hub_id(base_model) else f"`{base}`"
    kind = "A LoRA" if is_lora else "A fine-tuned transformer"
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {repo_id.rstrip('/').split('/')[-1]}", "",
        f"{kind} for {base_link} trained with {trainer_name} (online reinforcement learning of a flow-matching "
        f"{_TASK_WORDS.get(pipeline_tag, pipeline_tag)} model) using the flowgrpo library.", "",
        f"Rewards: {', '.join(f'`{r}`' for r in rewards) if rewards else 'n/a'}.", "",
        "## Usage", "", "```python", "import torch", "from diffusers import DiffusionPipeline", "",
    ]
    if is_lora:
        lines += [
            f'pipe = DiffusionPipeline.from_pretrained("{base}", torch_dtype=torch.bfloat16).to("cuda")',
            f'pipe.load_lora_weights("{repo_id}")',
        ]
        if second_expert_lora:
            lines += [f'pipe.load_lora_weights("{repo_id}", weight_name="{second_expert_lora}", '
                      "load_into_transformer_2=True)"]
    else:
        lines += [
            "from diffusers import AutoModel", "",
            f'transformer = AutoModel.from_pretrained("{repo_id}", subfolder="transformer", '
            "torch_dtype=torch.bfloat16)",
            f'pipe = DiffusionPipeline.from_pretrained("{base}", transformer=transformer, '
            'torch_dtype=torch.bfloat16).to("cuda")',
        ]
    if pipeline_tag == "text-to-video":
        lines += ['frames = pipe("a cat walking on a sunny beach", num_frames=81).frames[0]', "```", ""]
    elif pipeline_tag == "image-to-image":
        lines += ["from diffusers.utils import load_image", "",
                  'image = pipe(image=load_image("source.png"), prompt="make the sky purple").images[0]', "```", ""]
    else:
        lines += ['image = pipe("a photo of a cat holding a sign that says \\"hello\\"").images[0]', "```", ""]
    if is_lora:
        lines += ["The weights are `pytorch_lora_weights.safetensors` in diffusers' LoRA format (keys prefixed "
                  "`transformer.`, the LoRA configuration in the file's metadata)"
                  + (f"; the low-noise expert's are `{second_expert_lora}`." if second_expert_lora else "."), ""]
    if dataset_name:
        lines += [f"Prompts: `{dataset_name}`.", ""]
    if extra_sections:
        lines += [extra_sections.rstrip(), ""]
    if metrics and "## Evaluation" not in (extra_sections or ""):
        lines += ["## Evaluation (last run)", ""] + [f"- {k}: {_score(v)}" for k, v in metrics.items()] + [""]
    if samples or contact_sheet:
        lines += ["## Samples from the last evaluation", ""]
        if samples:
            lines += ["| image | prompt | reward |", "| --- | --- | --- |"]
            lines += [f"| ![sample {i}]({s.image}) | {_escape_cell(s.prompt)} | {_score(s.score)} |"
                      for i, s in enumerate(samples)]
            lines += [""]
        if contact_sheet:
            lines += [f"All evaluation prompts: ![contact sheet]({contact_sheet})", ""]
    if paper:
        title = paper.get("title")
        if title and paper.get("id"):
            lines += [f"Method: [{title}](https://huggingface.co/papers/{paper['id']}).", ""]
        if paper.get("citation"):
            lines += ["## Citation", "", "```bibtex", paper["citation"].strip(), "```", ""]
    return "\n".join(lines)


__all__ = ["CardSample", "card_tag", "is_hub_id", "render_model_card"]
