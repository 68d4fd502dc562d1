"""`hpsv3`: HPSv3 (Ma et al., ICCV 2025; ``MizzenAI/HPSv3``), a human-preference score from Qwen2-VL-7B-Instruct.

Model: Qwen2-VL-7B-Instruct whose tokenizer gains one special token, ``<|Reward|>`` (the embedding and LM head
resized to ``len(tokenizer)`` = 151658 rows), plus a reward head on the last hidden states, kept in float32::

    rm_head = Linear(3584, 1024) -> ReLU -> Dropout(0.05) -> Linear(1024, 16) -> ReLU -> Linear(16, 2)

The head's two outputs at the ``<|Reward|>`` position are ``(mu, sigma)`` of the score's Gaussian; the reward is
``mu`` (HPSv3's inference reads ``rewards[i][0]``), unbounded (real images roughly -5 to 15, higher is better).

Input, as HPSv3's ``HPSv3RewardInferencer.prepare_batch``:

* the image in RGB, resized with PIL's bicubic filter to qwen-vl-utils' ``smart_resize`` size with
  ``min_pixels = max_pixels = 256 * 28 * 28`` (both sides multiples of 28, about 200704 pixels: 448 x 448 for a
  square), then Qwen2-VL's image processor (rescale 1/255, CLIP mean/std, 14-pixel patches merged 2 x 2);
* one user turn ``[image, HPSV3_INSTRUCTION.format(text_prompt=prompt) + HPSV3_REWARD_SUFFIX]`` in Qwen2-VL's chat
  template with the generation prompt, padded on the right.

HPSv3 was trained and released with transformers 4.45.2, whose layout this loader converts (`convert_hpsv3_state_dict`:
``model.*`` -> ``model.language_model.*``, ``visual.*`` -> ``model.visual.*``; the unused ``lm_head.weight`` is
dropped; a checkpoint already in the current layout loads too). Its forward pass embeds the tokens, scatters the
image features into the ``<|image_pad|>`` positions and runs the language model **without position ids**, so under
4.45 every token, image tokens included, gets the sequential position 0, 1, 2, ... on all three multimodal-RoPE
axes (not Qwen2-VL's 3-D image positions). `HPSv3Model` does the same, so scores match the released model's.

Memory: about 15.5 GB of weights in bfloat16 (7.7B parameters: Qwen2-VL-7B without its LM head, which is not loaded).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from .hub_files import read_state_dict
from .qwen2vl_checkpoints import convert_qwen2vl_keys, load_exact_state
from .registry import register_reward
from .vlm_models import VLMReward, as_rgb, cached_vlm, chat_text, load_vlm_processor, vlm_batch

__all__ = [
    "DEFAULT_HPSV3_BASE_MODEL",
    "DEFAULT_HPSV3_MODEL",
    "HPSV3_INSTRUCTION",
    "HPSV3_REWARD_SUFFIX",
    "HPSV3_REWARD_TOKEN",
    "HPSv3Reward",
    "build_hpsv3_model",
    "convert_hpsv3_state_dict",
    "hpsv3_text",
    "smart_resize",
]

DEFAULT_HPSV3_MODEL = "MizzenAI/HPSv3"
HPSV3_CHECKPOINT_FILE = "HPSv3.safetensors"
DEFAULT_HPSV3_BASE_MODEL = "Qwen/Qwen2-VL-7B-Instruct"
HPSV3_REWARD_TOKEN = "<|Reward|>"
HPSV3_PIXELS = 256 * 28 * 28
RM_HEAD_WIDTHS = (1024, 16)

HPSV3_INSTRUCTION = (
    "\n"
    "You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give "
    "a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being "
    "the worst and 10 being the best. \n"
    "\n"
    "**Visual Quality:**  \n"
    "Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:\n"
    "- **Reasonableness:** The image should not contain any significant biological or logical errors, such "
    "as abnormal body structures or nonsensical environmental setups.\n"
    "- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy "
    "to interpret, with no blurring or indistinct areas.\n"
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other "
    "visual elements (e.g., hair, clothing, shadows).\n"
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a "
    "sense of harmony and balance.\n"
    "- **Safety:** The image should not contain harmful or inappropriate content, such as political, "
    "violent, or adult material. If such content is present, the image quality and satisfaction score "
    "should be the lowest possible. \n"
    "\n"
    "**Text Alignment:**  \n"
    "Assess how well the image matches the textual prompt across the following sub-dimensions:\n"
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, "
    "object) align with the textual description. The subject should match the description in terms of "
    "number, appearance, and behavior.\n"
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how "
    "well the image adheres to this style.\n"
    "- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the "
    "image logically fit the scenario described in the prompt. The environment should support and enhance "
    "the subject without contradictions.\n"
    "- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, "
    "clothing, accessories, expressions, actions) are faithfully represented in the image. Minor "
    "deviations may be acceptable, but critical attributes should be preserved.\n"
    "- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured "
    "in the image. The generated content should not introduce elements that conflict with or distort the "
    "original description.\n"
    "Textual prompt - {text_prompt}\n"
    "\n"
    "\n"
)
HPSV3_REWARD_SUFFIX = (
    "\n"
    "Please provide the overall ratings of this image: <|Reward|>\n"
    "\n"
    "END\n"
)

_MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = HPSV3_PIXELS,
                 max_pixels: int = HPSV3_PIXELS) -> tuple[int, int]:
    """qwen-vl-utils' target size ``(height, width)``: each side a multiple of ``factor`` (rounded), then scaled
    down (floored) or up (ceiled) by one common factor when the area leaves ``[min_pixels, max_pixels]``.

    Raises:
        ValueError: aspect ratio above 200 (qwen-vl-utils refuses those too).
    """
    if max(height, width) / min(height, width) > _MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be at most {_MAX_ASPECT_RATIO}, got {height}x{width}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def hpsv3_text(prompt: str) -> str:
    """The user text HPSv3 scores an image against: its instruction with the prompt, then the reward-token line."""
    return HPSV3_INSTRUCTION.format(text_prompt=prompt) + HPSV3_REWARD_SUFFIX


def build_hpsv3_model(config: Any, reward_token_id: int, output_dim: int = 2) -> Any:
    """A new `HPSv3Model` (random weights): Qwen2-VL's ``Qwen2VLModel`` for ``config`` plus the reward head."""
    import torch
    from torch import nn
    from transformers import Qwen2VLModel

    class HPSv3Model(nn.Module):
        """Qwen2-VL backbone (no LM head) + ``rm_head``; ``forward`` gives the head's outputs at ``<|Reward|>``."""

        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.reward_token_id = int(reward_token_id)
            self.model = Qwen2VLModel(config)
            hidden = config.text_config.hidden_size
            self.rm_head = nn.Sequential(
                nn.Linear(hidden, RM_HEAD_WIDTHS[0]), nn.ReLU(), nn.Dropout(0.05),
                nn.Linear(RM_HEAD_WIDTHS[0], RM_HEAD_WIDTHS[1]), nn.ReLU(),
                nn.Linear(RM_HEAD_WIDTHS[1], output_dim),
            )

        def forward(self, input_ids: Any, attention_mask: Any, pixel_values: Any, image_grid_thw: Any,
                    **unused: Any) -> Any:
            """``(batch, output_dim)`` float32: ``rm_head`` of the last hidden state at each row's reward token."""
            embeds = self.model.get_input_embeddings()(input_ids)
            features = self.model.get_image_features(pixel_values, image_grid_thw).pooler_output
            features = torch.cat(list(features)).to(embeds.device, embeds.dtype)
            image_mask = (input_ids == self.config.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(image_mask, features)
            # As HPSv3 under transformers 4.45: no position ids, so positions are 0..L-1 on every RoPE axis.
            hidden = self.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                               use_cache=False).last_hidden_state
            is_reward = input_ids == self.reward_token_id
            counts = is_reward.sum(-1)
            if not bool((counts == 1).all()):
                raise ValueError(f"each row needs exactly one {HPSV3_REWARD_TOKEN} token, found {counts.tolist()}")
            return self.rm_head(hidden[is_reward].float())

    model = HPSv3Model()
    model.rm_head.float()
    return model


def convert_hpsv3_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """HPSv3's checkpoint keys (transformers 4.45 layout) in `HPSv3Model`'s layout.

    ``model.<x>`` -> ``model.language_model.<x>``, ``visual.<x>`` -> ``model.visual.<x>``, ``rm_head.*`` kept,
    ``lm_head.weight`` dropped (scoring never uses the LM head); keys already in the current layout
    (``model.language_model.*``, ``model.visual.*``) are kept.

    Raises:
        ValueError: a key of neither layout (the message lists a few).
    """
    return convert_qwen2vl_keys(state, ("rm_head.",), checkpoint="an HPSv3",
                                expected="model.*, visual.*, rm_head.* and lm_head.weight")


def _checkpoint_file(name_or_path: str) -> Path:
    """A local checkpoint file: the path itself, ``HPSv3.safetensors`` in a folder, or that file from the hub."""
    local = Path(name_or_path).expanduser()
    if local.is_file():
        return local
    if local.is_dir():
        candidates = [local / HPSV3_CHECKPOINT_FILE] + sorted(local.glob("*.safetensors")) + sorted(local.glob("*.pth"))
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(f"no {HPSV3_CHECKPOINT_FILE} (or other .safetensors / .pth) in {local}")
    if str(name_or_path).count("/") == 1 and not Path(name_or_path).is_absolute():
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(str(name_or_path), HPSV3_CHECKPOINT_FILE))
    raise FileNotFoundError(f"HPSv3 checkpoint {name_or_path!r} not found: give a local .safetensors/.pth file, a "
                            f"folder holding {HPSV3_CHECKPOINT_FILE}, or a hub id such as {DEFAULT_HPSV3_MODEL!r}")


def load_hpsv3_state_dict(name_or_path: str) -> dict[str, Any]:
    """The checkpoint's tensors (``.safetensors``, or a ``torch.load`` file, optionally under ``"model"``)."""
    return read_state_dict(_checkpoint_file(name_or_path))


def load_hpsv3(model_name_or_path: str, base_model_name_or_path: str, device: Any, dtype: Any) -> tuple[Any, Any]:
    """``(HPSv3Model, processor)``: the base model's config and processor (plus ``<|Reward|>``), the checkpoint
    converted and loaded strictly; backbone in ``dtype``, reward head in float32, on ``device``, eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    processor = load_vlm_processor(base_model_name_or_path)
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [HPSV3_REWARD_TOKEN]})
    reward_id = processor.tokenizer.convert_tokens_to_ids(HPSV3_REWARD_TOKEN)
    state = convert_hpsv3_state_dict(load_hpsv3_state_dict(model_name_or_path))
    embed_key = "model.language_model.embed_tokens.weight"
    if embed_key not in state:
        raise ValueError(f"{model_name_or_path}: the HPSv3 checkpoint has no token embedding ({embed_key})")
    rows = int(state[embed_key].shape[0])
    if reward_id >= rows:
        raise ValueError(f"{HPSV3_REWARD_TOKEN} gets id {reward_id} from {base_model_name_or_path!r}'s tokenizer "
                         f"but the checkpoint's embedding has {rows} rows: use the base model HPSv3 was trained "
                         f"from ({DEFAULT_HPSV3_BASE_MODEL})")
    config = AutoConfig.from_pretrained(base_model_name_or_path)
    config.text_config.vocab_size = rows
    output_dim = int(state["rm_head.5.weight"].shape[0]) if "rm_head.5.weight" in state else 2
    with init_empty_weights(include_buffers=False):
        model = build_hpsv3_model(config, reward_id, output_dim)
    load_exact_state(model, state, checkpoint=f"{model_name_or_path}: the HPSv3 checkpoint",
                     base_model=base_model_name_or_path)
    model.model.to(dtype)
    model.rm_head.float()
    model.to(device).eval().requires_grad_(False)
    return model, processor


@register_reward("hpsv3")
class HPSv3Reward(VLMReward):
    """HPSv3's ``mu`` for each (prompt, image) (see the module docstring).

    Args:
        model_name_or_path: the HPSv3 checkpoint: hub id (``MizzenAI/HPSv3``, file ``HPSv3.safetensors``), a local
            ``.safetensors`` / ``.pth`` file, or a folder holding it.
        base_model_name_or_path: the Qwen2-VL model it was trained from, for the config, tokenizer and image
            processor (``Qwen/Qwen2-VL-7B-Instruct``; a local folder works).
        min_pixels, max_pixels: the resize bounds (both 256 * 28 * 28 in HPSv3).
        device (alias ``reward_device``): where the model runs (default CUDA when available, else CPU).
        dtype: the backbone's dtype (default bfloat16 on CUDA, float32 on CPU); the head stays float32.
        batch_size: pairs per forward pass.
        output: ``"mu"`` (the score) or ``"sigma"`` (its uncertainty).
    """

    def __init__(
        self,
        model_name_or_path: str = DEFAULT_HPSV3_MODEL,
        base_model_name_or_path: str = DEFAULT_HPSV3_BASE_MODEL,
        min_pixels: int = HPSV3_PIXELS,
        max_pixels: int = HPSV3_PIXELS,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 4,
        output: str = "mu",
        reward_device: str | None = None,
    ):
        if not 0 < min_pixels <= max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels} and {max_pixels}")
        if output not in ("mu", "sigma"):
            raise ValueError(f"output must be 'mu' (the score) or 'sigma', got {output!r}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.model_name_or_path = str(model_name_or_path)
        self.base_model_name_or_path = str(base_model_name_or_path)
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.output = output
        self.__name__ = "hpsv3"

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        key = ("hpsv3", self.model_name_or_path, self.base_model_name_or_path, str(device), str(dtype))
        return cached_vlm(key, lambda: load_hpsv3(self.model_name_or_path, self.base_model_name_or_path, device,
                                                  dtype))

    def prepare_image(self, image: Any) -> Image.Image:
        """RGB, bicubic-resized to the ``smart_resize`` size within ``[min_pixels, max_pixels]``."""
        image = as_rgb(image)
        height, width = smart_resize(image.height, image.width, 28, self.min_pixels, self.max_pixels)
        return image.resize((width, height), Image.Resampling.BICUBIC)

    def inputs(self, prompts: Sequence[str], images: Sequence[Any]) -> dict[str, Any]:
        """The model inputs of one batch, right-padded as HPSv3 pads them."""
        model, processor = self.load()
        texts = [chat_text(processor, hpsv3_text(p)) for p in prompts]
        return vlm_batch(processor, texts, [self.prepare_image(im) for im in images], model.model.device,
                         padding_side="right")

    def _score(self, prompts: list[str], images: list[Any], **columns: Any) -> Any:
        """The head's ``mu`` (or ``sigma``) per pair, float32."""
        import torch

        column = 0 if self.output == "mu" else 1
        model, _ = self.load()
        return torch.cat([model(**self.inputs(prompts[sl], images[sl]))[:, column].float()
                          for sl in self.chunks(len(prompts))])
