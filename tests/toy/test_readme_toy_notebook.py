"""The README's notebook example on the toy world runs as written: no size, steps, guidance or text length given, the
world's own are read from its folder (toy_world.json) and DiffusionNFT's CFG-free rollouts apply. The snippet is read
out of README.md (the code block after ``<!-- toy-notebook -->``) and run as it is; only its run length is cut to two
optimizer steps here (``trainer.args.max_steps`` before ``trainer.train()``)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_toy_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- toy-notebook -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its toy-world notebook example (the code block after <!-- toy-notebook -->)"
    return match.group(1)


def test_readme_toy_notebook_example_runs_as_written(tmp_path, monkeypatch):
    snippet = readme_toy_snippet()
    assert "resolution" not in snippet and "height" not in snippet and snippet.rstrip().endswith("trainer.train()")
    setup, train = snippet.rstrip().rsplit("\n", 1)
    monkeypatch.chdir(tmp_path)  # the example's output_dir is relative
    scope: dict = {}
    exec(compile(setup, str(README), "exec"), scope)  # noqa: S102 - the README's own code
    trainer = scope["trainer"]
    args = trainer.args
    assert (args.height, args.width, args.num_inference_steps, args.max_sequence_length) == (32, 32, 20, 8)
    assert (args.guidance_scale, args.eval_guidance_scale) == (1.0, 1.0)  # DiffusionNFT: CFG-free rollouts
    assert trainer.generation_settings.sources["height"] == "toy_world.json"
    args.max_steps = 2  # a couple of steps of the README's run
    exec(compile(train, str(README), "exec"), scope)  # noqa: S102
    assert trainer.state.global_step == 2
    assert all(h["reward"] > 0 for h in trainer.state.log_history if "reward" in h)
