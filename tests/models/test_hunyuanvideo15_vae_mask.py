"""HunyuanVideo 1.5's VAE attention mask: the per-frame build equals diffusers' per-token one, and a loaded VAE's
attention blocks use it."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

from flowgrpo.models.hunyuanvideo15 import frame_causal_attention_mask


@pytest.mark.parametrize(("n_frame", "n_hw", "batch_size", "dtype"), [
    (1, 1, None, torch.float32), (1, 6, 2, torch.float32), (3, 4, None, torch.bfloat16), (4, 5, 1, torch.float32),
    (5, 3, 3, torch.float16), (2, 9, None, torch.float32)])
def test_frame_causal_mask_equals_diffusers_per_token_mask(n_frame, n_hw, batch_size, dtype):
    stock = HunyuanVideo15AttnBlock.prepare_causal_attention_mask(n_frame, n_hw, dtype, "cpu", batch_size=batch_size)
    mask = frame_causal_attention_mask(n_frame, n_hw, dtype, "cpu", batch_size=batch_size)
    assert mask.dtype == stock.dtype and mask.device == stock.device and mask.shape == stock.shape
    assert mask.stride() == stock.stride()  # the same (L, L) storage, expanded as a view over the batch
    assert torch.equal(mask, stock)
    frame = torch.arange(n_frame * n_hw) // n_hw  # the docstring's rule: 0 where j's frame is not after i's
    rule = torch.where(frame[None, :] <= frame[:, None], 0.0, float("-inf")).to(dtype)
    assert torch.equal(mask if batch_size is None else mask[0], rule)


def test_a_loaded_hunyuanvideo15_vae_uses_the_frame_mask_and_decodes_as_before(tiny_pipeline_path):
    from diffusers import DiffusionPipeline

    from flowgrpo.models import get_family_adapter

    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline_path("hunyuanvideo15"))
    latents = torch.randn(1, pipe.vae.config.latent_channels, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = pipe.vae.decode(latents, return_dict=False)[0]
    adapter = get_family_adapter(pipe, num_frames=5)
    blocks = [m for m in pipe.vae.modules() if isinstance(m, HunyuanVideo15AttnBlock)]
    assert blocks and all(b.prepare_causal_attention_mask is frame_causal_attention_mask for b in blocks)
    # an attribute of each instance: the diffusers class keeps its own
    assert HunyuanVideo15AttnBlock.prepare_causal_attention_mask is not frame_causal_attention_mask
    with torch.no_grad():
        assert torch.equal(adapter.pipeline.vae.decode(latents, return_dict=False)[0], stock)
