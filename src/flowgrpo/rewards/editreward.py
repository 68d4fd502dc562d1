"""`editreward`: EditReward (Wu et al., ICLR 2026; ``TIGER-AI-Lab/EditReward``), a reward model for instruction-guided
image editing that sees the source image, the edited image and the instruction together.

Model: a Qwen2.5-VL backbone (``Qwen/Qwen2.5-VL-7B-Instruct`` for ``TIGER-Lab/EditReward-Qwen2.5-VL-7B``; the
MiMo-VL-7B variant is the same architecture) whose tokenizer gains ``<|Reward|>``, plus two reward heads kept in
float32, one per scoring dimension::

    rm_heads.head_i = Linear(H, 1024) -> ReLU -> Dropout(0.05) -> Linear(1024, 16) -> ReLU -> Linear(16, 2)

Scoring, as the official ``EditRewardInferencer`` with ``rm_head_type="ranknet_multi_head"``: each (instruction,
source, edited) triple is shown twice, once with the instruction-following prompt (read by ``head_0``) and once with
the visual-quality prompt (read by ``head_1``); each pass is one user turn ``[source image, edited image,
prompt.format(text_prompt=instruction) + EDITREWARD_REWARD_SUFFIX]`` in the chat template with the generation
prompt, padded on the right. Each head's two outputs at the ``<|Reward|>`` position are ``(mu, log sigma)``; the
model averages the two heads (``pooling_strategy="mean"``) and the reward is the averaged **mu**, the first value
(the maintainers' reading of the output; its second value is the log-uncertainty, not a score)::

    reward = (head_0(h_following)[0] + head_1(h_quality)[0]) / 2

unbounded, higher is better. `EditRewardModel` also reports each head's mu (the metrics ``following`` and
``quality`` of the reward's output).

Input details of the official path: both images in RGB, bicubic-resized with PIL to qwen-vl-utils' ``smart_resize``
size at ``min_pixels = max_pixels = 256 * 28 * 28`` (448 x 448 for a square; 256 merged image tokens each), then the
Qwen2.5-VL image processor. The official forward embeds the tokens, scatters the image features into the
``<|image_pad|>`` positions and calls the backbone without position ids, which under the transformers release it
ships with (4.57) gives every token the position ``cumsum(attention_mask) - 1`` on all three multimodal-RoPE axes
(sequential, image tokens included; not Qwen2.5-VL's 3-D image positions). `EditRewardModel` passes exactly those
positions.

The source image comes from the dataset's ``image`` column (`flowgrpo.rewards.edit_inputs`); a batch without it is
refused before anything loads.

Checkpoint: the official ``model.pth`` / ``model.safetensors`` (the reward model's full state dict: ``model.*``,
``lm_head.weight``, ``rm_heads.*``, in the in-memory layout of transformers 4.57, which is also today's; the older
layout with ``model.layers.*`` and ``visual.*`` converts too). The LM head is not loaded. Memory: about 15.5 GB of
weights in bfloat16 (7.75 B parameters: Qwen2.5-VL-7B without its LM head); each scoring runs the backbone twice per
sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from .composition import RewardOutput
from .edit_inputs import source_images
from .hpsv3 import smart_resize
from .hub_files import read_state_dict
from .qwen2vl_checkpoints import convert_qwen2vl_keys, load_exact_state
from .registry import register_reward
from .vlm_models import VLMReward, as_rgb, cached_vlm, chat_content_text, load_vlm_processor

__all__ = [
    "DEFAULT_EDITREWARD_BASE_MODEL",
    "DEFAULT_EDITREWARD_MODEL",
    "EDITREWARD_FOLLOWING_INSTRUCTION",
    "EDITREWARD_QUALITY_INSTRUCTION",
    "EDITREWARD_REWARD_SUFFIX",
    "EDITREWARD_REWARD_TOKEN",
    "EditReward",
    "build_editreward_model",
    "convert_editreward_state_dict",
    "editreward_text",
    "sequential_positions",
]

DEFAULT_EDITREWARD_MODEL = "TIGER-Lab/EditReward-Qwen2.5-VL-7B"
DEFAULT_EDITREWARD_BASE_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
EDITREWARD_CHECKPOINT_FILES = ("model.pth", "model.safetensors")  # the official inferencer's order
EDITREWARD_REWARD_TOKEN = "<|Reward|>"
EDITREWARD_PIXELS = 256 * 28 * 28
RM_HEAD_WIDTHS = (1024, 16)
NUM_HEADS = 2
#: which prompt each head reads: head_0 instruction following, head_1 visual quality
DIMENSIONS = ("following", "quality")

EDITREWARD_FOLLOWING_INSTRUCTION = (
    "\n"
    "You are tasked with evaluating an edited image **in comparison with the original source image** "
    "based on **Instruction Following & Semantic Fidelity**, and assigning a score from 1 to 4, with 1 "
    "being the worst and 4 being the best.  \n"
    "This dimension focuses on how accurately, completely, and exclusively the model executed the given "
    "text instruction.\n"
    "\n"
    "**Inputs Provided:**  \n"
    "- Source Image (before editing)  \n"
    "- Edited Image (after applying the instruction)  \n"
    "- Text Instruction  \n"
    "\n"
    "**Sub-Dimensions to Evaluate:**\n"
    "\n"
    "- **Semantic Accuracy:**  \n"
    "  Assess whether the edited content accurately captures the semantics of the instruction. The "
    "edited result should precisely match the intended meaning. For example, if the instruction is "
    '"replace apples with oranges," the object must clearly be oranges, not other fruits.\n'
    "\n"
    "- **Completeness of Editing:**  \n"
    "  Check whether **all parts** of the instruction are fully executed. For multi-step edits (e.g., "
    '"replace a red car with a blue bicycle"), both the color change and the object replacement must be '
    "done without omissions.\n"
    "\n"
    "- **Exclusivity of Edit (No Over-Editing):**  \n"
    "  Ensure that only the requested parts are changed. The rest of the image (as seen in the source) "
    "should remain unaltered. For example, if the instruction only involves replacing an object, the "
    "background, lighting, and unrelated objects should not be unnecessarily modified.\n"
    "\n"
    "**Scoring Criteria:**\n"
    "- **4 (Very Good):** Perfectly accurate, complete, and exclusive execution of the instruction.  \n"
    "- **3 (Relatively Good):** Largely correct, but with minor omissions or slight over-editing.  \n"
    "- **2 (Relatively Poor):** Major misinterpretation, incomplete edits, or noticeable unintended "
    "changes.  \n"
    "- **1 (Very Poor):** Instruction ignored or completely wrong execution.\n"
    "\n"
    "Text instruction - {text_prompt}\n"
)
EDITREWARD_QUALITY_INSTRUCTION = (
    "\n"
    "You are tasked with evaluating an edited image **in comparison with the original source image** "
    "based on **Visual Quality & Realism**, and assigning a score from 1 to 4, with 1 being the worst "
    "and 4 being the best.  \n"
    "This dimension focuses on how realistic, artifact-free, and aesthetically appealing the edited "
    "image is, while remaining consistent with the source image.\n"
    "\n"
    "**Inputs Provided:**  \n"
    "- Source Image (before editing)  \n"
    "- Edited Image (after applying the instruction)  \n"
    "- Text Instruction  \n"
    "\n"
    "**Sub-Dimensions to Evaluate:**\n"
    "\n"
    "- **Plausibility & Physical Consistency:**  \n"
    "  Check whether the edit aligns with the laws of physics and the scene context. Lighting, shadows, "
    "reflections, perspective, size, and interactions with the environment should all appear natural "
    "compared to the source image.\n"
    "\n"
    "- **Artifact-Free Quality:**  \n"
    "  Look for technical flaws such as blur, distortions, pixel misalignment, unnatural textures, or "
    "seams around edited regions. High-quality results should be free from such visible artifacts.\n"
    "\n"
    "- **Aesthetic Quality:**  \n"
    "  Evaluate the overall harmony and visual appeal. The image should look natural, balanced, and "
    "pleasant. Colors, composition, and atmosphere should enhance the image rather than degrade it.\n"
    "\n"
    "**Scoring Criteria:**\n"
    "- **4 (Very Good):** Perfectly realistic, artifact-free, seamless, and aesthetically pleasing.  \n"
    "- **3 (Relatively Good):** Mostly realistic and clean, with only minor flaws that do not "
    "significantly distract.  \n"
    "- **2 (Relatively Poor):** Noticeable physical inconsistencies or visible artifacts that make the "
    "edit unnatural.  \n"
    "- **1 (Very Poor):** Severe artifacts, incoherent composition, or visually unusable result.\n"
    "\n"
    "Text instruction - {text_prompt}\n"
)
EDITREWARD_REWARD_SUFFIX = (
    "\n"
    "Please provide the overall ratings of this image: <|Reward|>\n"
    "\n"
    "END\n"
)


def editreward_text(instruction: str, dimension: str) -> str:
    """The user text of one scoring pass: the dimension's prompt with the instruction, then the reward-token lines.

    Raises:
        ValueError: ``dimension`` is not ``"following"`` or ``"quality"``.
    """
    templates = {"following": EDITREWARD_FOLLOWING_INSTRUCTION, "quality": EDITREWARD_QUALITY_INSTRUCTION}
    if dimension not in templates:
        raise ValueError(f"dimension must be one of {DIMENSIONS}, got {dimension!r}")
    return templates[dimension].format(text_prompt=instruction) + EDITREWARD_REWARD_SUFFIX


def sequential_positions(attention_mask: Any) -> Any:
    """The positions the official forward gets, ``(3, batch, length)``: ``cumsum(mask) - 1`` on every RoPE axis, with
    padded positions set to 1 (what transformers 4.57's Qwen2.5-VL computes when it receives no input ids)."""
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(attention_mask == 0, 1)
    return positions.unsqueeze(0).expand(3, -1, -1)


def build_editreward_model(config: Any, reward_token_id: int, num_heads: int = NUM_HEADS, output_dim: int = 2) -> Any:
    """A new `EditRewardModel` (random weights): Qwen2.5-VL's ``Qwen2_5_VLModel`` for ``config`` plus the heads."""
    import torch
    from torch import nn
    from transformers import Qwen2_5_VLModel

    def head(hidden: int) -> nn.Module:
        return nn.Sequential(
            nn.Linear(hidden, RM_HEAD_WIDTHS[0]), nn.ReLU(), nn.Dropout(0.05),
            nn.Linear(RM_HEAD_WIDTHS[0], RM_HEAD_WIDTHS[1]), nn.ReLU(),
            nn.Linear(RM_HEAD_WIDTHS[1], output_dim),
        )

    class EditRewardModel(nn.Module):
        """Qwen2.5-VL backbone (no LM head) + ``rm_heads``; `head_outputs` runs one head on one prompt's batch."""

        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.reward_token_id = int(reward_token_id)
            self.model = Qwen2_5_VLModel(config)
            hidden = config.text_config.hidden_size
            self.rm_heads = nn.ModuleDict({f"head_{i}": head(hidden) for i in range(num_heads)})

        def head_outputs(self, head_index: int, input_ids: Any, attention_mask: Any, pixel_values: Any,
                         image_grid_thw: Any, **unused: Any) -> Any:
            """``(batch, output_dim)`` float32: ``rm_heads.head_<i>`` of the last hidden state at each row's reward
            token, with the official forward's embedding and positions (module docstring)."""
            embeds = self.model.get_input_embeddings()(input_ids)
            features = self.model.get_image_features(pixel_values, image_grid_thw).pooler_output
            features = torch.cat(list(features)).to(embeds.device, embeds.dtype)
            image_mask = (input_ids == self.config.image_token_id).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(image_mask, features)
            hidden = self.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                               position_ids=sequential_positions(attention_mask),
                                               use_cache=False).last_hidden_state
            is_reward = input_ids == self.reward_token_id
            counts = is_reward.sum(-1)
            if not bool((counts == 1).all()):
                raise ValueError(f"each row needs exactly one {EDITREWARD_REWARD_TOKEN} token, found {counts.tolist()}")
            return self.rm_heads[f"head_{head_index}"](hidden[is_reward].float())

    model = EditRewardModel()
    model.rm_heads.float()
    return model


def convert_editreward_state_dict(state: Mapping[str, Any]) -> dict[str, Any]:
    """An EditReward checkpoint's keys in `EditRewardModel`'s layout.

    ``model.language_model.*``, ``model.visual.*`` and ``rm_heads.*`` are kept (the official layout); the older
    Qwen2.5-VL layout converts (``model.<x>`` -> ``model.language_model.<x>``, ``visual.<x>`` -> ``model.visual.<x>``);
    ``lm_head.weight`` is dropped (scoring never uses it).

    Raises:
        ValueError: a key of neither layout, e.g. a single-head checkpoint (``rm_head.*``), which this reward does not
            score.
    """
    return convert_qwen2vl_keys(state, ("rm_heads.",), checkpoint="a two-head EditReward",
                                expected="model.*, rm_heads.head_0/1.* and lm_head.weight")


def _checkpoint_file(name_or_path: str) -> Path:
    """The checkpoint file: the path itself, ``model.pth`` / ``model.safetensors`` in a folder, or from the hub."""
    local = Path(name_or_path).expanduser()
    if local.is_file():
        return local
    if local.is_dir():
        for name in EDITREWARD_CHECKPOINT_FILES:
            if (local / name).is_file():
                return local / name
        raise FileNotFoundError(f"no {' or '.join(EDITREWARD_CHECKPOINT_FILES)} in {local}")
    if str(name_or_path).count("/") == 1 and not Path(name_or_path).is_absolute():
        from huggingface_hub import hf_hub_download

        error: Exception | None = None
        for name in EDITREWARD_CHECKPOINT_FILES:
            try:
                return Path(hf_hub_download(str(name_or_path), name))
            except Exception as exc:  # noqa: BLE001 - the repository holds one of the two names
                error = exc
        raise FileNotFoundError(f"{name_or_path}: neither {' nor '.join(EDITREWARD_CHECKPOINT_FILES)} could be "
                                f"downloaded ({error})")
    raise FileNotFoundError(f"EditReward checkpoint {name_or_path!r} not found: give a local model.pth / "
                            f"model.safetensors file, a folder holding one, or a hub id such as "
                            f"{DEFAULT_EDITREWARD_MODEL!r}")


def load_editreward_state_dict(name_or_path: str) -> dict[str, Any]:
    """The checkpoint's tensors (``.safetensors``, or a ``torch.load`` file, optionally under ``"model"``, as the
    official inferencer reads them)."""
    return read_state_dict(_checkpoint_file(name_or_path))


def load_editreward(model_name_or_path: str, base_model_name_or_path: str, device: Any, dtype: Any
                    ) -> tuple[Any, Any]:
    """``(EditRewardModel, processor)``: the base model's config and processor (plus ``<|Reward|>``), the checkpoint
    converted and loaded strictly; backbone in ``dtype``, heads in float32, on ``device``, eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    state = convert_editreward_state_dict(load_editreward_state_dict(model_name_or_path))
    processor = load_vlm_processor(base_model_name_or_path)
    processor.tokenizer.add_special_tokens({"additional_special_tokens": [EDITREWARD_REWARD_TOKEN]})
    reward_id = processor.tokenizer.convert_tokens_to_ids(EDITREWARD_REWARD_TOKEN)
    embed_key = "model.language_model.embed_tokens.weight"
    if embed_key not in state:
        raise ValueError(f"{model_name_or_path}: the EditReward checkpoint has no token embedding ({embed_key})")
    rows = int(state[embed_key].shape[0])
    if reward_id >= rows:
        raise ValueError(f"{EDITREWARD_REWARD_TOKEN} gets id {reward_id} from {base_model_name_or_path!r}'s tokenizer "
                         f"but the checkpoint's embedding has {rows} rows: use the base model this EditReward "
                         f"checkpoint was trained from (e.g. {DEFAULT_EDITREWARD_BASE_MODEL})")
    config = AutoConfig.from_pretrained(base_model_name_or_path)
    if getattr(config, "model_type", None) != "qwen2_5_vl":
        raise ValueError(f"{base_model_name_or_path!r} is a {getattr(config, 'model_type', '?')!r} model; EditReward's "
                         f"two-head checkpoints are built on Qwen2.5-VL (e.g. {DEFAULT_EDITREWARD_BASE_MODEL})")
    config.text_config.vocab_size = rows
    output_dim = int(state["rm_heads.head_0.5.weight"].shape[0]) if "rm_heads.head_0.5.weight" in state else 2
    with init_empty_weights(include_buffers=False):
        model = build_editreward_model(config, reward_id, NUM_HEADS, output_dim)
    load_exact_state(model, state, checkpoint=f"{model_name_or_path}: the EditReward checkpoint",
                     base_model=base_model_name_or_path)
    model.model.to(dtype)
    model.rm_heads.float()
    model.to(device).eval().requires_grad_(False)
    return model, processor


@register_reward("editreward")
class EditReward(VLMReward):
    """EditReward's mu for each (instruction, source image, edited image) (see the module docstring).

    Called as ``reward(prompts, edited_images, image=source_images)``; in training the ``image`` column of an editing
    dataset is that argument. Returns a `RewardOutput` whose metrics ``following`` and ``quality`` are each head's mu.

    Args:
        model_name_or_path: the checkpoint: hub id (``TIGER-Lab/EditReward-Qwen2.5-VL-7B``), a local ``model.pth`` /
            ``model.safetensors``, or a folder holding one.
        base_model_name_or_path: the Qwen2.5-VL model it was trained from, for the config, tokenizer and image
            processor (``Qwen/Qwen2.5-VL-7B-Instruct``; ``XiaomiMiMo/MiMo-VL-7B-SFT-2508`` for the MiMo variant).
        min_pixels, max_pixels: the resize bounds of both images (both 256 * 28 * 28 in EditReward).
        device (alias ``reward_device``): where the model runs (default CUDA when available, else CPU).
        dtype: the backbone's dtype (default bfloat16 on CUDA, as the official inference; float32 on CPU); the heads
            stay float32.
        batch_size: triples per forward pass (each pass runs the backbone once per head).
    """

    def __init__(
        self,
        model_name_or_path: str = DEFAULT_EDITREWARD_MODEL,
        base_model_name_or_path: str = DEFAULT_EDITREWARD_BASE_MODEL,
        min_pixels: int = EDITREWARD_PIXELS,
        max_pixels: int = EDITREWARD_PIXELS,
        device: str | None = None,
        dtype: Any = None,
        batch_size: int = 4,
        reward_device: str | None = None,
    ):
        if not 0 < min_pixels <= max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels} and {max_pixels}")
        super().__init__(device=device, dtype=dtype, batch_size=batch_size, reward_device=reward_device)
        self.model_name_or_path = str(model_name_or_path)
        self.base_model_name_or_path = str(base_model_name_or_path)
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.__name__ = "editreward"

    def __repr__(self) -> str:
        return f"EditReward(model={self.model_name_or_path!r}, base={self.base_model_name_or_path!r})"

    def _load_vlm(self, device: Any, dtype: Any) -> tuple[Any, Any]:
        key = ("editreward", self.model_name_or_path, self.base_model_name_or_path, str(device), str(dtype))
        return cached_vlm(key, lambda: load_editreward(self.model_name_or_path, self.base_model_name_or_path,
                                                       device, dtype))

    def prepare_image(self, image: Any) -> Image.Image:
        """RGB, bicubic-resized to the ``smart_resize`` size within ``[min_pixels, max_pixels]`` (qwen-vl-utils)."""
        image = as_rgb(image)
        height, width = smart_resize(image.height, image.width, 28, self.min_pixels, self.max_pixels)
        return image.resize((width, height), Image.Resampling.BICUBIC)

    def inputs(self, instructions: Sequence[str], sources: Sequence[Any], edited: Sequence[Any], dimension: str
               ) -> dict[str, Any]:
        """One dimension's model inputs for a batch: one user turn ``[source, edited, text]`` per triple, right-padded
        as the official processor pads."""
        model, processor = self.load()
        content = [{"type": "image"}, {"type": "image"}]
        texts = [chat_content_text(processor, content + [{"type": "text", "text": editreward_text(p, dimension)}])
                 for p in instructions]
        images = [self.prepare_image(im) for pair in zip(sources, edited) for im in pair]
        batch = processor(text=texts, images=images, padding=True, padding_side="right", return_tensors="pt")
        device = model.model.device
        return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}

    def head_scores(self, instructions: Sequence[str], sources: Sequence[Any], edited: Sequence[Any]) -> Any:
        """``(batch, 2, output_dim)`` float32: each head's output (``[:, 0]`` following, ``[:, 1]`` quality)."""
        import torch

        model, _ = self.load()
        outputs = [model.head_outputs(i, **self.inputs(instructions, sources, edited, dimension))
                   for i, dimension in enumerate(DIMENSIONS)]
        return torch.stack(outputs, dim=1)

    def __call__(self, prompts: Sequence[str], images: Sequence[Any], **columns: Any) -> RewardOutput:
        prompts, images = list(prompts), list(images)
        if len(prompts) != len(images):
            raise ValueError(f"editreward got {len(prompts)} prompts and {len(images)} images")
        sources = source_images(columns, len(images), "editreward")
        if not images:
            return RewardOutput([])
        import torch

        with self._lock, torch.inference_mode():
            heads = torch.cat([self.head_scores(prompts[sl], sources[sl], images[sl])
                               for sl in self.chunks(len(prompts))])
        mu = heads[:, :, 0].float().cpu()
        return RewardOutput(mu.mean(dim=1).tolist(),
                            metrics={name: mu[:, i].tolist() for i, name in enumerate(DIMENSIONS)})
