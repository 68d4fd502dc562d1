"""The newer model families as the tests train them: tiny pipelines, datasets with source images, test-sized configs.

Shared by tests/models/test_model_families.py (in process) and tests/distributed/families_ddp_worker.py (two ranks under accelerate).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

SIZE = 32
PROMPTS = ["a red circle", 'a sign that says "hi"', "two blue squares", "a cat"]
EDIT_PROMPTS = ["make it red", 'write "hi" on it', "add a blue square", "turn it upside down"]


@dataclass(frozen=True)
class FamilyCase:
    """One family as tested: the tiny pipeline (and variant) and what its runs need."""

    name: str                 # test id
    family: str               # flowgrpo.testing.TINY_FAMILIES
    variant: str | None = None
    num_frames: int = 1
    guidance_scale: float = 3.0   # FLUX.1 Kontext: embedded guidance; the others: true / ordinary CFG
    source_images: int | None = None  # per row: None = the family's default (1 for editing families), k > 1 a list
    max_sequence_length: int = 16     # FLUX.2 [dev]: its system message alone takes about 80 tokens

    @property
    def images_per_row(self) -> int:
        if self.source_images is not None:
            return self.source_images
        return 1 if self.family in ("flux_kontext", "qwenimage_edit", "wan_i2v") else 0

    @property
    def edits(self) -> bool:
        return self.images_per_row > 0

    @property
    def video(self) -> bool:
        return self.family in VIDEO_FAMILIES


VIDEO_FAMILIES = ("wan", "wan_i2v", "ltx2", "hunyuanvideo15")

CASES = (
    FamilyCase("qwenimage", "qwenimage"),
    FamilyCase("wan", "wan", num_frames=5),
    FamilyCase("wan_two_experts", "wan", "two_experts", num_frames=5),
    FamilyCase("flux_kontext", "flux_kontext", guidance_scale=3.5),
    FamilyCase("qwenimage_edit", "qwenimage_edit"),
    FamilyCase("flux2_klein", "flux2_klein"),
    FamilyCase("zimage", "zimage"),
    FamilyCase("flux2", "flux2", guidance_scale=3.5, source_images=2, max_sequence_length=128),
    FamilyCase("qwenimage_edit_plus", "qwenimage_edit_plus", source_images=2),
    FamilyCase("qwenimage21", "qwenimage21"),
    # Wan 2.1 I2V: its cross-attention assumes 512 text tokens next to the CLIP image tokens.
    FamilyCase("wan_i2v", "wan_i2v", num_frames=5, max_sequence_length=512),
    FamilyCase("wan_i2v_two_experts", "wan_i2v", "two_experts", num_frames=5),
    FamilyCase("wan_i2v_ti2v", "wan_i2v", "ti2v", num_frames=5),
    FamilyCase("ltx2", "ltx2", num_frames=5),
    FamilyCase("hunyuanvideo15", "hunyuanvideo15", num_frames=5),
)
CASE_IDS = [c.name for c in CASES]


def source_image(seed: int, size: int = SIZE) -> Image.Image:
    """A deterministic source image: smooth colour gradients plus a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([x, y, 1 - x * y], axis=-1) * rng.uniform(0.5, 1.0, size=3)
    arr = np.clip(base + rng.normal(0, 0.05, base.shape), 0, 1)
    return Image.fromarray((arr * 255).astype(np.uint8))


def dataset_rows(case: FamilyCase, n: int = 4) -> dict[str, list]:
    """``prompt`` (and ``image`` for editing families) columns of ``n`` rows."""
    k = case.images_per_row
    if k == 1:
        return {"prompt": EDIT_PROMPTS[:n], "image": [source_image(i) for i in range(n)]}
    if k > 1:  # several source images per row, as a list
        return {"prompt": EDIT_PROMPTS[:n], "image": [[source_image(k * i + j) for j in range(k)] for i in range(n)]}
    return {"prompt": PROMPTS[:n]}


def brightness_reward(prompts, images, **columns):
    """Mean brightness in [0, 1] of each image (a video's frames are scored one by one); differentiable (a float
    tensor (N, 3, H, W) in [0, 1] gives a tensor (N,) with its gradient)."""
    if hasattr(images, "requires_grad"):
        return images.mean(dim=(1, 2, 3))
    return [float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


brightness_reward.differentiable = True


def config_kwargs(case: FamilyCase, **overrides) -> dict:
    """Test-sized ``FlowGRPOConfig`` keyword arguments (without ``output_dir``) for ``case``."""
    kwargs = dict(
        report_to=[], per_device_train_batch_size=4, num_generations=2, resolution=SIZE, num_frames=case.num_frames,
        num_inference_steps=3, eval_num_inference_steps=3, guidance_scale=case.guidance_scale, max_steps=1,
        learning_rate=1e-2, beta=0.0, max_sequence_length=case.max_sequence_length, logging_steps=1, save_strategy="no", disable_tqdm=True,
        seed=0, log_images_steps=0, dtype="float32", negative_prompt="",
    )
    kwargs.update(overrides)
    return kwargs
