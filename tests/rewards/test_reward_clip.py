"""CLIP-family scorers on tiny random CLIP models saved with ``save_pretrained`` (loaded back by model id).

The scoring math is checked against an independent computation from the model's sub-modules: projection,
L2 normalisation, scale, clipping, and invariance to batch size and order.
"""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.rewards import get_reward, resolve_reward_funcs
from flowgrpo.rewards.clip_scorers import (
    AestheticScorer,
    CLIPScore,
    PickScore,
    build_aesthetic_mlp,
    load_aesthetic_mlp,
)
from flowgrpo.rewards.placement import resolve_device

PROJECTION_DIM = 16


def _byte_symbols():
    """The 256 printable stand-ins of byte-level BPE (printable Latin-1 kept, the rest shifted past U+0100)."""
    kept = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    symbols, extra = {}, 0
    for b in range(256):
        if b in kept:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def _write_tokenizer_files(folder):
    symbols = _byte_symbols()
    tokens = symbols + [s + "</w>" for s in symbols] + ["ca", "cat</w>", "do", "dog</w>"]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\nc a\nca t</w>\nd o\ndo g</w>\n")
    return vocab


def _build_tiny_clip(folder, seed, logit_scale=2.0):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    tok_dir = folder / "tok"
    tok_dir.mkdir(parents=True)
    vocab = _write_tokenizer_files(tok_dir)
    tokenizer = CLIPTokenizer.from_pretrained(tok_dir, model_max_length=77)
    eos = vocab["<|endoftext|>"]
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"],
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=PROJECTION_DIM,
        logit_scale_init_value=logit_scale,
    )
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    model.save_pretrained(folder / "model")
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder / "model")
    return str(folder / "model")


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return _build_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), seed=0)


@pytest.fixture(scope="module")
def reference(tiny_clip):
    """Independent embeddings: vision/text towers -> projection -> L2 normalisation, done by hand."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny_clip).eval()
    processor = CLIPProcessor.from_pretrained(tiny_clip)

    def image_embeds(images):
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            pooled = model.vision_model(pixel_values=pixels).pooler_output
            feats = pooled @ model.visual_projection.weight.T
        return feats / torch.linalg.vector_norm(feats, dim=-1, keepdim=True)

    def text_embeds(texts):
        ids = processor.tokenizer(texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        with torch.no_grad():
            pooled = model.text_model(input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]).pooler_output
            feats = pooled @ model.text_projection.weight.T
        return feats / torch.linalg.vector_norm(feats, dim=-1, keepdim=True)

    return model, image_embeds, text_embeds


def _images(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = (40 + 8 * i, 36 + 4 * (i % 3))  # different sizes and aspect ratios
        out.append(Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)))
    return out


PROMPTS = ["a cat", "a dog", "a red cat on a mat", "dogs and cats", "an empty room", "cat cat dog"]


def test_clipscore_math_and_scale(tiny_clip, reference):
    _, image_embeds, text_embeds = reference
    images = _images(len(PROMPTS))
    cos = (image_embeds(images) * text_embeds(PROMPTS)).sum(-1)
    scores = get_reward("clipscore", model_id=tiny_clip, device="cpu")(PROMPTS, images)
    assert scores == pytest.approx((100 * cos.clamp(min=0)).tolist(), abs=1e-4)
    hessel = CLIPScore(model_id=tiny_clip, scale=2.5, device="cpu")(PROMPTS, images)
    assert hessel == pytest.approx((2.5 * cos.clamp(min=0)).tolist(), abs=1e-5)


def test_clipscore_is_clipped_at_zero(tmp_path, tiny_clip):
    # The same model with its text projection negated flips the sign of every cosine: exactly one of the two
    # models scores each pair above zero and their sum is 100 * |cos|.
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny_clip)
    with torch.no_grad():
        model.text_projection.weight.neg_()
    model.save_pretrained(tmp_path / "flipped")
    CLIPProcessor.from_pretrained(tiny_clip).save_pretrained(tmp_path / "flipped")
    images = _images(len(PROMPTS), seed=1)
    a = CLIPScore(model_id=tiny_clip, device="cpu")(PROMPTS, images)
    b = CLIPScore(model_id=str(tmp_path / "flipped"), device="cpu")(PROMPTS, images)
    assert all(min(x, y) == 0.0 and max(x, y) > 0.0 for x, y in zip(a, b))


def test_batch_size_and_order_invariance(tiny_clip):
    images = _images(len(PROMPTS), seed=2)
    full = CLIPScore(model_id=tiny_clip, device="cpu", batch_size=32)(PROMPTS, images)
    chunked = CLIPScore(model_id=tiny_clip, device="cpu", batch_size=2)(PROMPTS, images)
    single = [CLIPScore(model_id=tiny_clip, device="cpu")([p], [im])[0] for p, im in zip(PROMPTS, images)]
    order = list(reversed(range(len(PROMPTS))))
    reversed_scores = CLIPScore(model_id=tiny_clip, device="cpu")([PROMPTS[i] for i in order],
                                                                  [images[i] for i in order])
    assert chunked == pytest.approx(full, abs=1e-4)
    assert single == pytest.approx(full, abs=1e-4)
    assert reversed_scores[::-1] == pytest.approx(full, abs=1e-4)


def test_pickscore_uses_the_model_logit_scale(tmp_path_factory, reference):
    folder = tmp_path_factory.mktemp("tiny-pickscore")
    path = _build_tiny_clip(folder, seed=3, logit_scale=3.0)
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(path)
    assert float(model.logit_scale.detach().exp()) == pytest.approx(np.exp(3.0), rel=1e-5)
    images = _images(4, seed=3)
    prompts = PROMPTS[:4]
    scores = PickScore(model_id=path, processor_id=path, device="cpu")(prompts, images)
    # Independent: the towers of the saved model, normalised by hand.
    from transformers import CLIPProcessor

    processor = CLIPProcessor.from_pretrained(path)
    with torch.no_grad():
        img = model.visual_projection(model.vision_model(**processor(images=images, return_tensors="pt")).pooler_output)
        ids = processor.tokenizer(prompts, padding=True, return_tensors="pt")
        txt = model.text_projection(model.text_model(input_ids=ids["input_ids"],
                                                     attention_mask=ids["attention_mask"]).pooler_output)
    cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
    assert scores == pytest.approx((np.exp(3.0) * cos).tolist(), abs=1e-4)
    scaled = get_reward("pickscore", model_id=path, processor_id=path, divide_by=26.0, device="cpu")(prompts, images)
    assert scaled == pytest.approx([s / 26.0 for s in scores], abs=1e-5)
    with pytest.raises(ValueError, match="divide_by"):
        PickScore(model_id=path, divide_by=0)


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_aesthetic_mlp_on_normalised_embeddings(tmp_path, tiny_clip, reference, fmt):
    torch.manual_seed(5)
    mlp = build_aesthetic_mlp(PROJECTION_DIM)
    state = {k: v.detach().clone() for k, v in mlp.state_dict().items()}
    assert sorted(state) == sorted(f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))
    path = tmp_path / f"aesthetic.{fmt}"
    if fmt == "pth":
        torch.save({f"module.{k}": v for k, v in state.items()}, path)  # DataParallel-style prefix
    else:
        from safetensors.torch import save_file

        save_file(state, str(path))
    loaded = load_aesthetic_mlp(path)
    assert not loaded.training

    _, image_embeds, _ = reference
    images = _images(5, seed=4)
    x = image_embeds(images)
    for i in (0, 2, 4, 6, 7):  # dropout layers (1, 3, 5) are identities at inference
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    scorer = get_reward("aesthetic", mlp_path=str(path), model_id=tiny_clip, device="cpu", batch_size=2)
    scores = scorer(["ignored"] * 5, images)
    assert scores == pytest.approx(x.squeeze(-1).tolist(), abs=1e-4)
    assert scorer(["other prompts"] * 5, images) == pytest.approx(scores, abs=1e-6)


def test_aesthetic_errors(tmp_path, tiny_clip):
    with pytest.raises(ValueError, match="mlp_path"):
        get_reward("aesthetic")
    wrong = tmp_path / "wrong_dim.pth"
    torch.save(build_aesthetic_mlp(PROJECTION_DIM + 1).state_dict(), wrong)
    with pytest.raises(ValueError, match="expects 17-d embeddings"):
        AestheticScorer(mlp_path=wrong, model_id=tiny_clip, device="cpu")(["x"], _images(1))
    not_mlp = tmp_path / "other.pth"
    torch.save({"weight": torch.zeros(2)}, not_mlp)
    with pytest.raises(ValueError, match="not an aesthetic-predictor state dict"):
        load_aesthetic_mlp(not_mlp)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_aesthetic_mlp(tmp_path / "missing.pth")


def test_lazy_loading_shared_cache_and_reward_set(tiny_clip):
    clip = CLIPScore(model_id=tiny_clip, device="cpu")
    pick = PickScore(model_id=tiny_clip, processor_id=tiny_clip, device="cpu")
    assert clip._model is None and pick._model is None  # nothing loaded before the first call
    rs = resolve_reward_funcs(["clipscore", "pickscore"], reward_weights=[1.0, 0.5],
                              reward_kwargs={"clipscore": {"model_id": tiny_clip, "device": "cpu"},
                                             "pickscore": {"model_id": tiny_clip, "processor_id": tiny_clip,
                                                           "device": "cpu"}})
    long_prompt = " ".join(["a cat and a dog"] * 60)  # longer than the 77-token context: truncated
    prompts, images = ["a cat", long_prompt], _images(2, seed=6)
    result = rs.submit(prompts, images).result(timeout=120)
    rs.close()
    assert result.total == pytest.approx(
        [c + 0.5 * p for c, p in zip(result.per_reward["clipscore"], result.per_reward["pickscore"])])
    assert clip(prompts, images) == pytest.approx(result.per_reward["clipscore"], abs=1e-5)
    assert clip.load()[0] is pick.load()[0]  # one model in memory for both scorers
    assert clip.device.type == "cpu"
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")  # the default
    assert clip([], []) == []
