"""The README's notebook example on the toy world runs as written, and quietly: no size, steps, guidance or text length
given, the world's own are read from its folder (toy_world.json) and DiffusionNFT's CFG-free rollouts apply; its
output holds none of the notices of parts it does not use (bitsandbytes' optional CPU kernel, DeepSpeed's accelerator
guess, pinned memory on a CPU, transformers' torchvision fallbacks). The snippet is read out of README.md (the code
block after ``<!-- toy-notebook -->``) and run as it is, in a fresh interpreter as a new user runs it; only its run
length is cut to two optimizer steps here (``trainer.args.max_steps`` before ``trainer.train()``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"

#: what a run that uses neither 4-bit models, DeepSpeed, pinned memory nor torchvision must not print
UNUSED_PARTS_NOTICES = ("No module named 'kernels'", "gemm_4bit_forward", "Skipping publisher trust check",
                        "Setting accelerator to CPU", "pin_memory", "requires torchvision", "falling back to")

RUNNER = """
import json, sys
setup, train = sys.argv[1], sys.argv[2]
scope = {}
exec(compile(setup, "README.md", "exec"), scope)
trainer = scope["trainer"]
args = trainer.args
seen = {"settings": [args.height, args.width, args.num_inference_steps, args.max_sequence_length],
        "guidance": [args.guidance_scale, args.eval_guidance_scale],
        "height_from": trainer.generation_settings.sources["height"]}
args.max_steps = 2  # a couple of steps of the README's run
exec(compile(train, "README.md", "exec"), scope)
seen["steps"] = trainer.state.global_step
seen["rewards"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
print("RESULT " + json.dumps(seen))
"""


def readme_toy_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(r"<!-- toy-notebook -->\s*```python\n(.*?)```", text, re.S)
    assert match, "README.md lost its toy-world notebook example (the code block after <!-- toy-notebook -->)"
    return match.group(1)


def test_readme_toy_notebook_example_runs_as_written_and_quietly(tmp_path):
    snippet = readme_toy_snippet()
    assert "resolution" not in snippet and "height" not in snippet and snippet.rstrip().endswith("trainer.train()")
    setup, train = snippet.rstrip().rsplit("\n", 1)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # the example's output_dir is relative: the run writes under tmp_path
    out = subprocess.run([sys.executable, "-c", RUNNER, setup, train], cwd=tmp_path, capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result["settings"] == [32, 32, 20, 8]
    assert result["guidance"] == [1.0, 1.0]  # DiffusionNFT: CFG-free rollouts
    assert result["height_from"] == "toy_world.json"
    assert result["steps"] == 2 and result["rewards"] and all(r > 0 for r in result["rewards"])
    printed = out.stdout + out.stderr
    heard = [notice for notice in UNUSED_PARTS_NOTICES if notice in printed]
    assert not heard, f"the run printed notices of parts it does not use: {heard}\n{printed[-4000:]}"
