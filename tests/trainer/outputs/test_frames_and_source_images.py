"""Videos and source images outside the models: rewards on frames, contact sheets, GIFs, the ``image`` column."""

from __future__ import annotations

import functools
import io

import numpy as np
import pytest
from PIL import Image

from flowgrpo.rewards import resolve_reward_funcs
from flowgrpo.rewards.composition import accepts_video
from flowgrpo.trainer.data.condition_images import image_key, load_condition_image, load_condition_images
from flowgrpo.trainer.outputs.contact_sheet import make_contact_sheet
from flowgrpo.trainer.outputs.media import encode_gif, key_frames, video_grid


def frame(value: int, size: int = 8) -> Image.Image:
    return Image.new("RGB", (size, size), (value, value, value))


def brightness(prompts, images, **columns):
    return [np.asarray(im, dtype=np.float64).mean() / 255 for im in images]


def test_image_rewards_average_frames_and_video_rewards_get_videos():
    received = {}

    def first_frame_only(prompts, videos, **columns):
        received["videos"] = [len(v) for v in videos]
        received["columns"] = columns
        return [np.asarray(v[0], dtype=np.float64).mean() / 255 for v in videos]

    first_frame_only.accepts_video = True

    def skips_dark(prompts, images, tag):
        received.setdefault("tags", []).extend(tag)
        return [None if np.asarray(im).mean() < 10 else 1.0 for im in images]

    rewards = resolve_reward_funcs([brightness, first_frame_only, skips_dark])
    videos = [[frame(0), frame(51), frame(102)], [frame(255), frame(255), frame(0)]]
    result = rewards(["a", "b"], videos, tag=["x", "y"])
    assert result.per_reward["brightness"] == pytest.approx([0.2, 2 / 3])   # mean over each video's frames
    assert result.per_reward["first_frame_only"] == pytest.approx([0.0, 1.0])
    assert result.per_reward["skips_dark"] == [1.0, 1.0]                      # unscored frames left out
    assert received["videos"] == [3, 3] and received["columns"] == {"tag": ["x", "y"]}
    assert received["tags"] == ["x", "x", "x", "y", "y", "y"]                 # columns repeated per frame
    assert rewards(["a"], [[frame(0), frame(1)]], tag=["z"]).per_reward["skips_dark"] == [None]
    with pytest.raises(ValueError, match="mixes images and videos"):
        rewards(["a", "b"], [frame(0), [frame(0)]], tag=["x", "y"])
    # The marker survives keyword binding (rewards configured through reward_kwargs).
    assert accepts_video(functools.partial(first_frame_only, scale=1)) and not accepts_video(brightness)


def test_contact_sheet_shows_first_middle_and_last_frame():
    videos = [[frame(v) for v in (10, 20, 30, 40, 50)], [frame(v) for v in (60, 70, 80, 90, 100)]]
    sheet = make_contact_sheet(videos, ["one", "two"], cell=16)
    assert sheet.size == (2 * 3 * 16, 16 + 3 * 12 + 4)
    shown = [sheet.getpixel((x * 16 + 8, 8))[0] for x in range(6)]
    assert shown == [10, 30, 50, 60, 80, 100]
    assert [f.getpixel((0, 0))[0] for f in key_frames([frame(1), frame(2)])] == [1, 2]
    assert make_contact_sheet([frame(5)], cell=16).size == (16, 16 + 40)  # images keep one cell


def test_gif_and_video_grid():
    video = [frame(v, 8) for v in (0, 120, 240)]
    gif = Image.open(io.BytesIO(encode_gif(video, fps=4)))
    assert gif.n_frames == 3 and gif.info["duration"] == 250 and gif.info.get("loop") == 0
    grid = video_grid([video, video[:2], video, video, video])
    assert len(grid) == 3 and grid[0].size == (3 * 8, 2 * 8)  # 5 videos on a 3 x 2 grid
    assert grid[2].getpixel((12, 4))[0] == 120  # the shorter video holds its last frame


def test_source_images_from_paths_pil_bytes_and_arrays(tmp_path):
    image = Image.fromarray(np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3))
    image.save(tmp_path / "a.png")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    variants = [str(tmp_path / "a.png"), tmp_path / "a.png", image.convert("RGBA"), {"bytes": buffer.getvalue(),
                "path": None}, {"bytes": None, "path": str(tmp_path / "a.png")}, np.asarray(image)]
    keys = {image_key(load_condition_image(v)) for v in variants}
    assert keys == {image_key(image)}
    assert image_key(image) != image_key(image.transpose(Image.FLIP_LEFT_RIGHT))
    with pytest.raises(ValueError, match=r"missing\.png.*does not exist"):
        load_condition_image(str(tmp_path / "missing.png"))
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(ValueError, match="cannot be read as an image"):
        load_condition_image(tmp_path / "bad.png")
    with pytest.raises(TypeError, match="column holds a int"):
        load_condition_image(3)


def test_a_row_may_hold_several_source_images(tmp_path):
    """Qwen-Image-Edit-Plus and FLUX.2 read a list of images per row: loaded in order, keyed by every image in order
    (the trainer's encoding key and the prompt cache's)."""
    from flowgrpo.trainer.data.prompt_cache import prompt_cache_key

    a, b = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("L", (8, 8), 7)
    b.save(tmp_path / "b.png")
    row = load_condition_images([a, str(tmp_path / "b.png")])
    assert [im.mode for im in row] == ["RGB", "RGB"] and row[1].getpixel((0, 0)) == (7, 7, 7)
    assert load_condition_images(a) is a  # one image stays one image
    assert image_key(row) == image_key(list(row)) != image_key(row[::-1])
    assert image_key(row) not in (image_key(row[0]), image_key(row[1]))
    assert prompt_cache_key("p", row) == prompt_cache_key("p", [im.copy() for im in row])
    assert prompt_cache_key("p", row) != prompt_cache_key("p", row[::-1])
    with pytest.raises(ValueError, match="empty list"):
        load_condition_images([])


def test_synthetic_ocr_edit_set_loads_with_resolved_image_paths(tmp_path, monkeypatch):
    from flowgrpo.cli import ScriptArguments, load_prompt_dataset
    from flowgrpo.cli.ocr_prompts import write_ocr_edit_files
    from flowgrpo.rewards.ocr import extract_quoted_targets

    write_ocr_edit_files(tmp_path / "edit", num_train=3, num_test=1, seed=0, size=32)
    write_ocr_edit_files(tmp_path / "again", num_train=3, num_test=1, seed=0, size=32)
    assert (tmp_path / "edit" / "train.jsonl").read_text() == (tmp_path / "again" / "train.jsonl").read_text()
    assert (tmp_path / "edit/images/train_0002.png").read_bytes() == (tmp_path / "again/images/train_0002.png").read_bytes()
    monkeypatch.chdir(tmp_path / "again")  # relative paths are read against the prompt file's folder, not the cwd
    train, test = load_prompt_dataset(ScriptArguments(dataset_name=str(tmp_path / "edit")))
    assert len(train) == 3 and len(test) == 1
    for row in train:
        assert row["image"].startswith(str(tmp_path / "edit")) and load_condition_image(row["image"]).size == (32, 32)
        assert extract_quoted_targets(row["prompt"]) == [row["ocr_text"]]  # only the new text is a target


def test_cards_and_rank_logs_take_videos(tmp_path):
    from flowgrpo.cli.rank_log import _sample_digest
    from flowgrpo.trainer.outputs.hub import write_card_images
    from flowgrpo.trainer.outputs.model_card import render_model_card

    video = [frame(v) for v in (0, 100, 200)]
    samples, _ = write_card_images(tmp_path, {"samples": [("a cat walking", video, 0.5), ("a dog", frame(9), 0.1)]})
    assert [s.image for s in samples] == ["images/sample_0.gif", "images/sample_1.png"]
    assert Image.open(tmp_path / "images" / "sample_0.gif").n_frames == 3
    card = render_model_card("you/wan-lora", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", ["pickscore"], ["flow-grpo"],
                             pipeline_tag="text-to-video",
                             second_expert_lora="pytorch_lora_weights_transformer_2.safetensors")
    assert "pipeline_tag: text-to-video" in card and "text-to-video model" in card
    assert ('pipe.load_lora_weights("you/wan-lora", weight_name="pytorch_lora_weights_transformer_2.safetensors", '
            "load_into_transformer_2=True)") in card and "num_frames=" in card
    assert _sample_digest(video) != _sample_digest(video[:2]) and _sample_digest(frame(9)) == _sample_digest([frame(9)])
