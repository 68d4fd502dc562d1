"""`flowgrpo evaluate --benchmark geneval2` and `scripts/prepare_data.py geneval2` on a small local file in GenEval2's
format (tests/rewards/data/geneval2_sample.jsonl), the tiny SD3 pipeline (64 px, 2 steps) and the tiny Qwen3-VL
judge; nothing is downloaded, nothing is mocked."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowgrpo.evaluate import layout
from flowgrpo.evaluate import main as evaluate_main

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "rewards" / "data" / "geneval2_sample.jsonl"
FAST = ["--resolution", "64", "--num_inference_steps", "2", "--max_sequence_length", "16"]


def _prepare_data():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_data_geneval2_from_a_local_copy_and_the_pinned_download(tmp_path, capsys):
    module = _prepare_data()
    plan = module.plan_downloads(module.build_arg_parser().parse_args(["geneval2", "--output_dir", "d"]))
    url = ("https://raw.githubusercontent.com/facebookresearch/GenEval2/a6e82d2289e8d418f27f0adee77908b07060eea3/"
           "geneval2_data.jsonl")
    assert plan == [(url, Path("d/geneval2/geneval2_data.jsonl"))]
    assert module.main(["geneval2", "--output_dir", str(tmp_path), "--geneval2_file", str(SAMPLE)]) == 0
    saved = tmp_path / "geneval2" / "geneval2_data.jsonl"
    assert saved.read_bytes() == SAMPLE.read_bytes()
    out = capsys.readouterr().out
    assert "3 prompts" in out and "the published geneval2_data.jsonl has 800" in out

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a cat", "vqa_list": [["Is there a cat?"]]}) + "\n")
    assert module.main(["geneval2", "--output_dir", str(tmp_path / "b"), "--geneval2_file", str(bad)]) == 1
    assert "is not a GenEval2 line" in capsys.readouterr().err


def test_geneval2_benchmark_scores_writes_the_official_files_and_summary(tiny_sd3_path, tmp_path, capsys):
    from flowgrpo.rewards.geneval2 import GenEval2Reward, soft_tifa_mean
    from flowgrpo.testing.tiny_geneval2 import cached_tiny_geneval2_path

    judge = str(cached_tiny_geneval2_path())
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    out = tmp_path / "geneval2"
    kwargs = json.dumps({"geneval2": {"model_name_or_path": judge, "dtype": "float32", "aggregation": "geometric"}})
    assert evaluate_main(["--benchmark", "geneval2", "--model", str(tiny_sd3_path), "--metadata", str(SAMPLE),
                          "--output", str(out), "--reward_kwargs", kwargs, *FAST]) == 0
    assert "| Soft-TIFA AM | Soft-TIFA GM |" in capsys.readouterr().out
    for i, row in enumerate(rows):  # one image per prompt, the prompt's whole line as its metadata
        assert json.loads((out / f"{i:05d}" / "metadata.jsonl").read_text()) == row
        assert sorted(p.name for p in (out / f"{i:05d}" / "samples").iterdir()) == ["0000.png"]

    records = layout.read_jsonl(out / "results.jsonl")
    images = [Image.open(r["filename"]).convert("RGB") for r in records]
    direct = GenEval2Reward(model_name_or_path=judge, dtype="float32", device="cpu").question_scores(
        images, [row["vqa_list"] for row in rows])
    for record, row, scores in zip(records, rows, direct):
        assert (record["prompt"], record["atom_count"], record["skills"]) == (row["prompt"], row["atom_count"],
                                                                               row["skills"])
        assert record["score_list"] == pytest.approx(scores, rel=1e-5)
        assert record["soft_tifa_am"] == pytest.approx(soft_tifa_mean(scores), rel=1e-5)
        assert record["soft_tifa_gm"] == pytest.approx(soft_tifa_mean(scores, "geometric"), rel=1e-5)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmark"] == "geneval2" and summary["images"] == 3 and summary["prompts"] == 3
    assert summary["soft_tifa_am"] == pytest.approx(100 * np.mean([r["soft_tifa_am"] for r in records]))
    assert summary["soft_tifa_gm"] == pytest.approx(100 * np.mean([r["soft_tifa_gm"] for r in records]))
    counts = [s for r in records for s in r["score_list"]]
    skills = [k for row in rows for k in row["skills"]]
    assert summary["skills"]["count"] == pytest.approx(
        100 * np.mean([s for s, k in zip(counts, skills) if k == "count"]))
    assert list(summary["skills"]) == ["object", "attribute", "count", "position", "verb"]
    assert set(summary["atomicity"]) == {"2", "3", "5"}

    # GenEval2's own formats: evaluation.py's --image_filepath_data and --output_file
    paths = json.loads((out / "geneval2_image_paths.json").read_text())
    assert list(paths) == [row["prompt"] for row in rows] and all(Path(p).is_file() for p in paths.values())
    assert json.loads((out / "geneval2_score_lists.json").read_text()) == [r["score_list"] for r in records]


def test_geneval2_benchmark_refuses_a_file_of_another_format(tmp_path, capsys):
    wrong = tmp_path / "prompts.jsonl"
    wrong.write_text(json.dumps({"prompt": "a cat", "tag": "single_object"}) + "\n")
    assert evaluate_main(["--benchmark", "geneval2", "--model", str(tmp_path), "--metadata", str(wrong), *FAST, "--guidance_scale", "1.0",
                          "--output", str(tmp_path / "o")]) == 2
    assert "is not a GenEval2 line" in capsys.readouterr().err
    missing = tmp_path / "nowhere.jsonl"
    assert evaluate_main(["--benchmark", "geneval2", "--metadata", str(missing), "--output", str(tmp_path)]) == 2
    assert "python scripts/prepare_data.py geneval2" in capsys.readouterr().err
