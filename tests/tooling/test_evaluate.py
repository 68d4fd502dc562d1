"""`flowgrpo evaluate`: GenEval's layout, resuming, scoring another tool's folder, LoRA loading, bad input, and the
`flowgrpo` command's dispatch. Everything runs on the tiny SD3 pipeline (64 px, 2 steps) and the project's real
scorers (the toy world's attribute checks); nothing is mocked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.evaluate import layout
from flowgrpo.evaluate import main as evaluate_main

TOY_PROMPTS = ["one red circle on the left", "two blue squares at the top", "three green triangles on the right"]
FAST = ["--resolution", "64", "--num_inference_steps", "2", "--max_sequence_length", "16"]


def _toy_run(model, prompts: Path, output: Path, *extra: str) -> int:
    return evaluate_main(["--benchmark", "toy", "--model", str(model), "--metadata", str(prompts),
                          "--output", str(output), "--images_per_prompt", "2", "--batch_size", "2", *FAST, *extra])


def _stamps(output: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(output)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(output.glob("[0-9]*/samples/*.png"))}


def test_toy_benchmark_writes_genevals_layout_scores_and_resumes(tiny_sd3_path, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(TOY_PROMPTS) + "\n")
    out = tmp_path / "out"
    assert _toy_run(tiny_sd3_path, prompts, out) == 0
    captured = capsys.readouterr()
    assert "toy: generating" in captured.err and "| toy_geneval |" in captured.out

    # GenEval's layout: 5-digit prompt folders with the prompt's metadata line, 4-digit samples, a grid
    for i, prompt in enumerate(TOY_PROMPTS):
        folder = out / f"{i:05d}"
        assert json.loads((folder / "metadata.jsonl").read_text()) == {"prompt": prompt}
        assert sorted(p.name for p in (folder / "samples").iterdir()) == ["0000.png", "0001.png"]
        assert Image.open(folder / "samples" / "0000.png").size == (64, 64)
        assert Image.open(folder / "grid.png").size == (2 * 66 + 2, 68)
    records = layout.read_jsonl(out / "results.jsonl")
    assert [(r["index"], r["sample"]) for r in records] == [(i, n) for i in range(3) for n in range(2)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["images"] == 6 and summary["prompts"] == 3
    for name in ("toy_color", "toy_shape", "toy_count", "toy_position", "toy_geneval"):
        scores = [r[name] for r in records]
        assert all(s in (0.0, 1.0) for s in scores)
        assert summary["rewards"][name]["mean"] == pytest.approx(sum(scores) / 6)
    assert (out / "summary.md").read_text().startswith("# toy")
    assert json.loads((out / "evaluation.json").read_text())["protocol"]["num_inference_steps"] == 2

    # a second run finds every image and generates nothing
    before = _stamps(out)
    assert _toy_run(tiny_sd3_path, prompts, out) == 0
    assert "generating" not in capsys.readouterr().err
    assert _stamps(out) == before
    # a lost image is generated again, from its own seed: the same image
    lost = out / "00001" / "samples" / "0001.png"
    original = np.asarray(Image.open(lost), dtype=np.int16)
    lost.unlink()
    assert _toy_run(tiny_sd3_path, prompts, out) == 0
    assert "0/1 [" in capsys.readouterr().err  # that one image only
    # drawn alone instead of in a batch of two: the same noise, so the same image up to batched arithmetic's rounding
    assert np.abs(np.asarray(Image.open(lost), dtype=np.int16) - original).max() <= 1
    assert len(layout.read_jsonl(out / "results.jsonl")) == 6

    # the guidance was the tiny SD3 pipeline's own (StableDiffusion3Pipeline's 7): no toy_world.json in its folder
    assert json.loads((out / "evaluation.json").read_text())["protocol"]["guidance_scale"] == 7.0
    # resuming with other sampler settings would mix images: refused before anything loads
    assert _toy_run(tiny_sd3_path, prompts, out, "--guidance_scale", "2.0") == 2
    assert "guidance_scale: 7.0 -> 2.0" in capsys.readouterr().err


def test_images_mode_scores_a_folder_made_by_another_tool(tmp_path):
    """Rendered toy scenes in GenEval's layout (5-digit sample names, as GenEval's own generator writes): the toy
    checks must find every attribute."""
    from flowgrpo.toy import parse_caption, render

    images = tmp_path / "made_elsewhere"
    for i, prompt in enumerate(TOY_PROMPTS):
        folder = images / f"{i:05d}"
        (folder / "samples").mkdir(parents=True)
        (folder / "metadata.jsonl").write_text(json.dumps({"prompt": prompt}))
        for n in range(2):
            render(parse_caption(prompt), size=64, rng=n).save(folder / "samples" / f"{n:05d}.png")
    (images / "notes").mkdir()  # not a prompt folder: ignored, as by GenEval's evaluate_images.py
    assert evaluate_main(["--benchmark", "toy", "--images", str(images)]) == 0
    summary = json.loads((images / "summary.json").read_text())
    assert summary["images"] == 6
    assert summary["rewards"]["toy_geneval"]["mean"] == 1.0
    assert summary["rewards"]["toy_count"]["mean"] == 1.0


def test_lora_or_fine_tuned_transformer_is_loaded_and_changes_the_images(tiny_sd3_path, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model

    from flowgrpo.trainer.outputs.lora_export import save_diffusers_lora

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_path)
    peft_model = get_peft_model(pipe.transformer, LoraConfig(r=2, lora_alpha=8, init_lora_weights=False,
                                                             target_modules=["to_q", "to_k", "to_v"]))
    save_diffusers_lora(StableDiffusion3Pipeline, tmp_path / "lora", peft_model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TOY_PROMPTS[0] + "\n")
    common = ["--images_per_prompt", "1", "--skip_scoring", "--skip_grid"]
    assert _toy_run(tiny_sd3_path, prompts, tmp_path / "base", *common) == 0
    assert _toy_run(tiny_sd3_path, prompts, tmp_path / "tuned", "--lora", str(tmp_path / "lora"), *common) == 0
    base = (tmp_path / "base" / "00000" / "samples" / "0000.png").read_bytes()
    assert (tmp_path / "tuned" / "00000" / "samples" / "0000.png").read_bytes() != base
    assert not (tmp_path / "base" / "results.jsonl").exists()  # --skip_scoring

    # a fully fine-tuned transformer, as a run without LoRA writes it (<output_dir>/transformer)
    from diffusers import SD3Transformer2DModel

    full = SD3Transformer2DModel.from_pretrained(tiny_sd3_path, subfolder="transformer")
    with torch.no_grad():
        full.proj_out.bias.add_(0.5)
    full.save_pretrained(tmp_path / "full_run" / "transformer")
    assert _toy_run(tiny_sd3_path, prompts, tmp_path / "full", "--transformer", str(tmp_path / "full_run"),
                    *common) == 0
    assert (tmp_path / "full" / "00000" / "samples" / "0000.png").read_bytes() != base
    from flowgrpo.evaluate.generation import load_lora

    with pytest.raises(ValueError, match="pass it with --transformer"):
        load_lora(pipe, str(tmp_path / "full_run"))

    (tmp_path / "peft_only").mkdir()
    (tmp_path / "peft_only" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="adapter_model.safetensors, peft's format"):
        load_lora(pipe, str(tmp_path / "peft_only"))


def test_bad_input_is_named_before_any_model_loads(tmp_path, capsys):
    assert evaluate_main(["--benchmark", "gen_eval", "--output", str(tmp_path)]) == 2
    assert "Did you mean 'geneval'" in capsys.readouterr().err
    missing = tmp_path / "nowhere.jsonl"
    assert evaluate_main(["--benchmark", "geneval", "--metadata", str(missing), "--output", str(tmp_path)]) == 2
    assert "python scripts/prepare_data.py geneval" in capsys.readouterr().err
    assert evaluate_main(["--benchmark", "geneval"]) == 2
    assert "--output DIR is required" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a photo of a dog"}\n')
    assert evaluate_main(["--metadata", str(bad), "--output", str(tmp_path / "o")]) == 2
    assert "lacks ['tag', 'include']" in capsys.readouterr().err
    assert evaluate_main(["--images", str(tmp_path / "empty_dir_missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TOY_PROMPTS[0] + "\n")
    video_model = tmp_path / "wan"  # a video pipeline is refused from its model_index.json, before loading
    video_model.mkdir()
    (video_model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    assert _toy_run(video_model, prompts, tmp_path / "w") == 2
    assert "WanPipeline generates videos" in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_recipe_settings_then_flags(tmp_path):
    from flowgrpo.evaluate.cli import build_parser, settings_from_args

    repo = Path(__file__).resolve().parents[2]
    args = build_parser().parse_args(["--benchmark", "ocr", "--recipe", str(repo / "recipes" / "ocr.yaml"),
                                      "--output", str(tmp_path), "--guidance-scale", "3"])
    settings = settings_from_args(args)
    protocol = settings.protocol
    assert (protocol.num_inference_steps, protocol.height, protocol.max_sequence_length) == (40, 512, 256)
    assert protocol.guidance_scale == 3.0  # the flag (dashed spelling) beats the recipe's 4.5
    assert settings.reward_kwargs == {"ocr": {"backend": "rapidocr"}}
    assert settings.model == "stabilityai/stable-diffusion-3.5-medium"
    args = build_parser().parse_args(["--recipe", str(repo / "recipes" / "geneval.yaml"), "--output", str(tmp_path),
                                      "--reward_kwargs", '{"geneval": {"dtype": "bfloat16"}}'])
    assert settings_from_args(args).reward_kwargs == {"geneval": {"dtype": "bfloat16"}}  # not the training options
    args = build_parser().parse_args(["--output", str(tmp_path)])
    geneval = settings_from_args(args).protocol  # GenEval's published protocol for SD3.5-M in Flow-GRPO
    assert (geneval.images_per_prompt, geneval.num_inference_steps, geneval.guidance_scale, geneval.height,
            geneval.seed) == (4, 40, 4.5, 512, 42)


def test_flowgrpo_command_dispatches_each_subcommand(capsys):
    from flowgrpo.cli.command import SUBCOMMANDS, Subcommand, main

    assert main([]) == 2 and "reward-server" in capsys.readouterr().out
    for argv, expected in ((["train", "--help"], "usage: flowgrpo train [RECIPE.yaml]"),
                           (["evaluate", "--help"], "usage: flowgrpo evaluate"),
                           (["reward-server", "--help"], "--rewards")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        assert expected in capsys.readouterr().out
    assert main(["evalute"]) == 2 and "Did you mean 'evaluate'" in capsys.readouterr().err
    import importlib.util

    if importlib.util.find_spec("flowgrpo.plan") is not None:  # flowgrpo.plan.main(argv) -> int
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--help"])
        assert exit_info.value.code == 0 and "usage: flowgrpo plan" in capsys.readouterr().out
    missing = Subcommand("plan", "flowgrpo.no_such_module", "main", "")
    original = SUBCOMMANDS["plan"]
    SUBCOMMANDS["plan"] = missing
    try:
        with pytest.raises(SystemExit, match="has no flowgrpo.no_such_module module"):
            main(["plan", "recipes/ocr.yaml"])
    finally:
        SUBCOMMANDS["plan"] = original


# ---- GenEval -------------------------------------------------------------------------------------------------------

GENEVAL_METADATA = [  # one line per task; 'person' is the class the tiny detector is made to find
    {"tag": "single_object", "include": [{"class": "person", "count": 1}], "prompt": "a photo of a person"},
    {"tag": "two_object", "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}],
     "prompt": "a photo of a bench and a sports ball"},
    {"tag": "counting", "include": [{"class": "person", "count": 2}], "exclude": [{"class": "person", "count": 3}],
     "prompt": "a photo of two persons"},
    {"tag": "colors", "include": [{"class": "person", "count": 1, "color": "blue"}],
     "prompt": "a photo of a blue person"},
    {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                    {"class": "person", "count": 1, "position": ["right of", 0]}],
     "prompt": "a photo of a person right of a teddy bear"},
    {"tag": "color_attr", "include": [{"class": "person", "count": 1, "color": "purple"},
                                      {"class": "apple", "count": 1, "color": "black"}],
     "prompt": "a photo of a purple person and a black apple"},
]


@pytest.fixture(scope="module")
def tiny_geneval_kwargs(tmp_path_factory):
    """The geneval scorer's options for the tiny random Mask2Former (made to detect 'person') and CLIP, built
    offline: the real scoring code on models that fit a test."""
    from flowgrpo.rewards.geneval import COCO_OBJECT_NAMES
    from flowgrpo.testing.tiny_geneval import save_tiny_geneval_models

    paths = save_tiny_geneval_models(tmp_path_factory.mktemp("geneval-models"),
                                     favoured_class=COCO_OBJECT_NAMES.index("person"))
    return json.dumps({"geneval": {"detector": paths["detector"], "clip_model": paths["clip"],
                                   "detector_image_size": 64}})


def test_geneval_benchmark_official_layout_results_summary_resume_and_images_mode(tiny_sd3_path, tiny_geneval_kwargs,
                                                                                   tmp_path, capsys):
    from flowgrpo.rewards.geneval import RESULT_FIELDS, Detection, judge

    metadata = tmp_path / "evaluation_metadata.jsonl"
    metadata.write_text("".join(json.dumps(line) + "\n" for line in GENEVAL_METADATA))
    out = tmp_path / "geneval"
    argv = ["evaluate", "--benchmark", "geneval", "--model", str(tiny_sd3_path), "--metadata", str(metadata),
            "--output", str(out), "--reward_kwargs", tiny_geneval_kwargs, *FAST]
    from flowgrpo.cli.command import main as flowgrpo_main  # the `flowgrpo` command

    assert flowgrpo_main(argv) == 0
    captured = capsys.readouterr()
    assert "| Overall | Single object | Two object | Counting | Colors | Position | Color attribution |" \
        in captured.out
    for i, line in enumerate(GENEVAL_METADATA):  # the protocol: 4 images per prompt
        assert json.loads((out / f"{i:05d}" / "metadata.jsonl").read_text()) == line
        assert sorted(p.name for p in (out / f"{i:05d}" / "samples").iterdir()) == [f"{n:04d}.png" for n in range(4)]
    records = layout.read_jsonl(out / "results.jsonl")
    assert len(records) == 24 and all(tuple(r) == RESULT_FIELDS for r in records)
    assert [r["filename"] for r in records] == [str(out / f"{i:05d}" / "samples" / f"{n:04d}.png")
                                               for i in range(6) for n in range(4)]
    for r in records:
        assert isinstance(r["correct"], bool) and json.loads(r["metadata"])["prompt"] == r["prompt"]
        if r["tag"] not in ("colors", "color_attr"):  # no colour to classify: the kept boxes decide the verdict
            kept = [Detection(label, tuple(box[:4]), box[4]) for label, boxes in json.loads(r["details"]).items()
                    for box in boxes]
            assert judge(json.loads(r["metadata"]), kept).correct == r["correct"]
    summary = json.loads((out / "summary.json").read_text())
    tasks = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
    assert list(summary["accuracy"]) == [*tasks, "overall"]
    for tag in tasks:
        mine = [r["correct"] for r in records if r["tag"] == tag]
        assert summary["accuracy"][tag] == pytest.approx(sum(mine) / 4)
    assert summary["accuracy"]["overall"] == pytest.approx(sum(summary["accuracy"][t] for t in tasks) / 6)
    assert summary["accuracy"]["single_object"] == 1.0  # the tiny detector finds a person in every image
    assert summary["protocol"]["protocol"]["images_per_prompt"] == 4
    assert "Overall score (avg. over tasks)" in (out / "summary.md").read_text()

    # resumed: nothing to generate, the same results
    before = _stamps(out)
    assert flowgrpo_main(argv) == 0
    assert "generating" not in capsys.readouterr().err
    assert _stamps(out) == before and layout.read_jsonl(out / "results.jsonl") == records

    # --images: the same folder scored as another tool's, results written elsewhere
    scored = tmp_path / "scored"
    assert evaluate_main(["--images", str(out), "--output", str(scored), "--reward_kwargs", tiny_geneval_kwargs]) == 0
    assert [(r["filename"], r["correct"]) for r in layout.read_jsonl(scored / "results.jsonl")] == \
        [(r["filename"], r["correct"]) for r in records]
    assert json.loads((scored / "summary.json").read_text())["accuracy"] == summary["accuracy"]


def test_ocr_benchmark_scores_rendered_text_with_the_ocr_reward(tmp_path):
    """The ocr benchmark's scorer (the `ocr` reward, rapidocr's bundled models, offline) on text drawn with PIL in
    GenEval's layout: the words are read back."""
    pytest.importorskip("rapidocr")
    from PIL import ImageDraw, ImageFont

    images = tmp_path / "ocr"
    prompts = ['A sign that says "OPEN"', 'A poster with the words "HELLO WORLD"']
    for i, prompt in enumerate(prompts):
        (images / f"{i:05d}" / "samples").mkdir(parents=True)
        (images / f"{i:05d}" / "metadata.jsonl").write_text(json.dumps({"prompt": prompt}))
        image = Image.new("RGB", (256, 96), "white")
        ImageDraw.Draw(image).text((10, 25), prompt.split('"')[1], fill="black", font=ImageFont.load_default(size=36))
        image.save(images / f"{i:05d}" / "samples" / "0000.png")
    assert evaluate_main(["--benchmark", "ocr", "--images", str(images)]) == 0
    scores = [r["ocr"] for r in layout.read_jsonl(images / "results.jsonl")]
    assert len(scores) == 2 and min(scores) >= 0.8
    assert json.loads((images / "summary.json").read_text())["rewards"]["ocr"]["count"] == 2


@pytest.mark.slow
def test_toy_benchmark_on_two_processes_reproduces_the_toy_worlds_accuracy(tmp_path):
    """`accelerate launch -m flowgrpo.evaluate --benchmark toy` on two CPU processes (gloo), with the defaults: the
    toy world (shipped with the package) and its own settings (toy_world.json: 32 px, 20 steps, CFG 3), its 43
    held-out prompts x 4 images. Process k generates and scores prompts k, k + 2, ...; the main process merges the
    results in prompt order and writes the one summary. The accuracies must match those the toy world's builder
    measured on the same prompts with the diffusers pipeline's own sampling (other seeds: within 0.1)."""
    import os
    import subprocess
    import sys

    from flowgrpo.toy.build import cached_toy_world

    world = json.loads((cached_toy_world() / "toy_world.json").read_text())
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_ddp.yaml",
           "-m", "flowgrpo.evaluate", "--benchmark", "toy", "--output", str(out), "--batch_size", "64",
           "--skip_grid"]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("# toy") == 1  # one summary, from the main process
    records = layout.read_jsonl(out / "results.jsonl")
    assert [(r["index"], r["sample"]) for r in records] == [(i, n) for i in range(43) for n in range(4)]
    assert not list(out.glob("results.rank*.jsonl"))
    protocol = json.loads((out / "evaluation.json").read_text())["protocol"]
    assert (protocol["height"], protocol["num_inference_steps"], protocol["guidance_scale"]) == (32, 20, 3.0)
    summary = json.loads((out / "summary.json").read_text())["rewards"]
    expected = world["eval_accuracy"]
    for attribute in ("color", "shape", "count", "position"):
        assert abs(summary[f"toy_{attribute}"]["mean"] - expected[attribute]) < 0.1, (attribute, summary)
    assert abs(summary["toy_geneval"]["mean"] - expected["all"]) < 0.1
