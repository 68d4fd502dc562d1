"""flowgrpo.process_gc: a training process pauses the cyclic garbage collector from its start and turns it back on,
with everything alive frozen, when training starts; any other process is left as it is."""

import gc
import subprocess
import sys

from support.trainer_cases import make_trainer

from flowgrpo import process_gc


def test_resume_without_a_pause_changes_nothing():
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    assert process_gc.resume() is False
    # nothing frozen (the count only falls, as frozen objects are freed) and the collector as it was
    assert gc.isenabled() == enabled and gc.get_freeze_count() <= frozen


def test_a_paused_process_resumes_once_with_what_is_alive_frozen():
    code = """
import gc
from flowgrpo import process_gc
process_gc.pause_until_training()
assert not gc.isenabled() and gc.get_freeze_count() == 0
kept = [[i] for i in range(1000)]
assert process_gc.resume() is True
assert gc.isenabled() and gc.get_freeze_count() >= 1000
frozen = gc.get_freeze_count()
assert process_gc.resume() is False and gc.get_freeze_count() == frozen  # once
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_train_turns_a_paused_collector_back_on(tiny_sd3_path, tmp_path, monkeypatch):
    """`OnlineRLTrainer.train` resumes the collector its process's entry point paused (src/train.py does)."""
    trainer = make_trainer(tiny_sd3_path, tmp_path, max_steps=1)
    was_enabled = gc.isenabled()
    monkeypatch.setattr(process_gc, "_paused", False)
    process_gc.pause_until_training()
    try:
        assert not gc.isenabled()
        trainer.train()
        assert gc.isenabled() and process_gc._paused is False
    finally:
        if was_enabled:
            gc.enable()


def test_the_training_entry_points_pause_the_collector(monkeypatch):
    """src/train.py pauses it before its imports, ``flowgrpo train`` run as a command before running the training;
    ``flowgrpo.cli.command.main([...])`` called by a program does not (the program owns its collector), nor does
    another command."""
    from pathlib import Path

    from flowgrpo.cli import command

    script = (Path(__file__).resolve().parents[2] / "src" / "train.py").read_text()
    assert script.index("pause_until_training()") < script.index("from flowgrpo.cli import main")
    calls = []
    monkeypatch.setattr(process_gc, "pause_until_training", lambda: calls.append("paused"))
    monkeypatch.setattr(command, "_load", lambda sub: lambda rest, **kwargs: calls.append(sub.name) or 0)
    monkeypatch.setattr(sys, "argv", ["flowgrpo", "train", "recipes/tiny_cpu.yaml"])
    assert command.main() == 0 and calls == ["paused", "train"]
    calls.clear()
    assert command.main(["train", "recipes/tiny_cpu.yaml"]) == 0 and calls == ["train"]
    monkeypatch.setattr(sys, "argv", ["flowgrpo", "plan", "recipes/tiny_cpu.yaml"])
    calls.clear()
    assert command.main() == 0 and calls == ["plan"]
