"""Fault injection: kills during saves, preemption, NaN losses, a dying reward server, a full disk.

Every fault is followed by a rerun with ``--resume_from_checkpoint last`` (or ``train(resume_from_checkpoint=...)``,
the same resolution); where the fault lost nothing but time, the final weights must equal those of the
uninterrupted run (`baseline`, 3 optimizer steps on the tiny SD3 pipeline, saved at every step).

Cost on 2 CPU cores: one training subprocess (the SIGTERM run: a process must really receive the signal and exit
0), small standard-library subprocesses for the kills during saves and the second signal, the rest in-process.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults_worker
import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from flowgrpo.trainer.run_state.checkpointing import (
    CheckpointSaveError,
    checkpoint_problem,
    checkpoint_step,
    complete_checkpoints,
    newest_complete_checkpoint,
    remove_stale_staging,
    rotate_checkpoints,
    save_checkpoint_atomically,
)

# All-NaN metrics (a NaN loss, a step whose samples all failed) are what these faults produce.
pytestmark = pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning")

REPO = Path(__file__).resolve().parents[3]
PROMPTS = ["a red circle", "two blue squares", 'a sign that says "hi"', "a green triangle"]
LORA_FILE = "pytorch_lora_weights.safetensors"
RECIPE = """
dtype: float32
use_peft: true
lora_r: 4
lora_alpha: 8
lora_init: gaussian
lora_target_modules: [to_q, to_k, to_v, to_out.0]
reward_funcs: [faults_worker:brightness]
resolution: 64
num_inference_steps: 2
guidance_scale: 1.0
max_sequence_length: 16
num_generations: 2
per_device_train_batch_size: 4
learning_rate: 1.0e-2
beta: 0.0
epsilon: 1.0e-3
max_steps: 3
seed: 0
logging_steps: 1
log_images_steps: 0
eval_strategy: "no"
save_strategy: steps
save_steps: 1
save_total_limit: 2
report_to: none
use_cpu: true
disable_tqdm: true
dataloader_num_workers: 0
"""


# ---- set-up ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recipe(tiny_sd3_path, tmp_path_factory) -> Path:
    """The runs' recipe: 3 steps of 4 images (2 prompts x 2) at 64 px, 2 sampling steps, a checkpoint per step."""
    folder = tmp_path_factory.mktemp("faults-recipe")
    (folder / "prompts.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    path = folder / "recipe.yaml"
    path.write_text(f"model_name_or_path: {tiny_sd3_path}\ndataset_name: {folder / 'prompts.txt'}\n{RECIPE}",
                    encoding="utf-8")
    return path


def build_trainer(recipe: Path, output_dir: Path, callbacks=(), **overrides):
    """The trainer ``src/train.py`` builds from ``recipe`` (same parsing, data and LoRA), without its final export."""
    from flowgrpo import FlowGRPOTrainer
    from flowgrpo.cli import parse_recipe
    from flowgrpo.cli.data import load_prompt_dataset
    from flowgrpo.cli.lora import build_peft_config

    script_args, model_args, args = parse_recipe([str(recipe), "--output_dir", str(output_dir)], overrides=overrides)
    train_dataset, _ = load_prompt_dataset(script_args)
    trainer = FlowGRPOTrainer(model=model_args.model_name_or_path, reward_funcs=list(script_args.reward_funcs),
                              args=args, train_dataset=train_dataset, peft_config=build_peft_config(model_args))
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer


def lora(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / LORA_FILE))


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def step_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


class OnStepEnd(TrainerCallback):
    """Calls ``actions[step]()`` at the end of optimizer step ``step``."""

    def __init__(self, **actions):
        self.actions = {int(k.split("_")[1]): v for k, v in actions.items()}

    def on_step_end(self, args, state, control, **kwargs):
        action = self.actions.get(state.global_step)
        if action is not None:
            action()


@pytest.fixture(scope="module")
def baseline(recipe, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final LoRA (checkpoint-3)."""
    out = tmp_path_factory.mktemp("faults-baseline") / "out"
    trainer = build_trainer(recipe, out)
    trainer.train()
    assert [round(h["skipped_steps"]) for h in step_logs(trainer)] == [0, 0, 0]
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]  # save_total_limit 2
    return lora(out / "checkpoint-3")


# ---- kills during saves ------------------------------------------------------------------------------------------


def test_sigkill_at_random_moments_during_saves_leaves_only_complete_checkpoints(tmp_path):
    """A process that only saves (the real atomic path, 3 MiB per checkpoint, rotation to 2) is SIGKILLed at
    random moments, then restarted; every ``checkpoint-N`` ever seen must be complete and hold step N's state, and
    the final state must equal the uninterrupted chain's."""
    out = tmp_path / "out"
    last_step, trials = 400, 8
    rng = random.Random(0)
    command = [sys.executable, str(REPO / "tests" / "trainer" / "run_state" / "faults_worker.py"), "save-loop", str(out), str(last_step)]
    mid_save_kills = 0
    progress = []
    for _ in range(trials):
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        start_line = proc.stdout.readline()
        assert start_line.startswith("start"), start_line
        progress.append(int(start_line.split()[1]))
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        leftovers = [p.name for p in out.iterdir() if p.name.startswith(".")]
        mid_save_kills += any(name.startswith(".staging-") for name in leftovers)
        for folder in out.iterdir():
            if folder.name.startswith("checkpoint-"):
                assert checkpoint_problem(folder) is None, (folder, checkpoint_problem(folder))
                assert faults_worker.check_checkpoint(folder), folder
    assert progress == sorted(progress) and progress[-1] > 0  # every restart resumed where the last one got to
    assert mid_save_kills >= 1, "no kill landed inside a save; the trials did not test what they should"
    # The rerun finishes the run (a few more steps) with the state of the uninterrupted chain.
    last_step = checkpoint_step(newest_complete_checkpoint(out)) + 3
    finish = subprocess.run([*command[:-1], str(last_step)], capture_output=True, text=True, timeout=120)
    assert finish.returncode == 0 and finish.stdout.strip().endswith("done"), finish.stderr
    newest = Path(newest_complete_checkpoint(out))
    assert newest.name == f"checkpoint-{last_step}"
    assert (newest / "state.bin").read_bytes() == faults_worker.expected_state(last_step)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    assert len(complete_checkpoints(out)) == 2


def test_completeness_rotation_and_stale_staging(tmp_path, caplog):
    from flowgrpo.trainer.run_state.crash_safety import resolve_resume_checkpoint

    out = tmp_path / "out"

    def save(step, state=b"x"):
        return save_checkpoint_atomically(out, step, lambda f: faults_worker.write_checkpoint(f, step, state))

    for step in (1, 2, 3, 4):
        save(step)
    # An incomplete newer folder: a file shorter than the manifest says (a partial copy, a torn write).
    save(5)
    with open(out / "checkpoint-5" / "optimizer.pt", "r+b") as f:
        f.truncate(10)
    assert "optimizer.pt has 10 bytes" in checkpoint_problem(out / "checkpoint-5")
    # A folder of plain transformers.Trainer (no manifest) killed while writing trainer_state.json.
    (out / "checkpoint-6").mkdir()
    (out / "checkpoint-6" / "trainer_state.json").write_text('{"global_st')
    assert "cannot be read" in checkpoint_problem(out / "checkpoint-6")
    assert newest_complete_checkpoint(out) == str(out / "checkpoint-4")
    assert resolve_resume_checkpoint("last", out) == resolve_resume_checkpoint(True, out) == str(out / "checkpoint-4")
    with pytest.raises(ValueError, match=r"checkpoint-5.*optimizer.pt.*newest complete one there is .*checkpoint-4"):
        resolve_resume_checkpoint(str(out / "checkpoint-5"), out)
    lines = []
    assert resolve_resume_checkpoint("true", tmp_path / "empty", log=lines.append) is None
    assert len(lines) == 1 and "starting from scratch" in lines[0]
    # Rotation counts complete checkpoints only and never removes the newest complete one (nor those to keep).
    assert rotate_checkpoints(out, 1, keep=[str(out / "checkpoint-2")]) == [str(out / "checkpoint-1"),
                                                                            str(out / "checkpoint-3")]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-5", "checkpoint-6"]
    # Resaving a step replaces it; a kill between its two renames is repaired at the next start.
    save(4, state=b"y")
    assert (out / "checkpoint-4" / "state.bin").read_bytes() == b"y"
    os.replace(out / "checkpoint-4", out / ".replaced-checkpoint-4")
    (out / ".staging-checkpoint-7").mkdir()
    (out / ".deleting-checkpoint-2").mkdir()
    removed = remove_stale_staging(out)
    assert sorted(Path(p).name for p in removed) == [".deleting-checkpoint-2", ".staging-checkpoint-7"]
    assert (out / "checkpoint-4" / "state.bin").read_bytes() == b"y"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


# ---- preemption --------------------------------------------------------------------------------------------------


def test_sigterm_mid_step_saves_exits_zero_and_resume_matches(recipe, baseline, tmp_path):
    """``src/train.py`` gets SIGTERM while step 2 is being scored: it finishes step 2, saves checkpoint-2 and exits
    0; the same command with ``--resume_from_checkpoint last`` finishes the run with the uninterrupted weights."""
    from flowgrpo.cli import main

    out, gate = tmp_path / "out", tmp_path / "gate"
    gate.mkdir()
    argv = [str(recipe), "--output_dir", str(out), "--save_steps", "100"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO / "tests" / "trainer" / "run_state")]),
           "FLOWGRPO_FAULT_GATE": str(gate), "FLOWGRPO_FAULT_GATE_CALL": "2", "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, str(REPO / "src" / "train.py"), *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (gate / "waiting").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "step 2 never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # mid-step: its rollout is being scored
        time.sleep(0.2)
        (gate / "release").touch()
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "SIGTERM received" in output
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-2"]
    assert not (out / LORA_FILE).exists()  # exited after the checkpoint, before the final export
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [round(h["step"]) for h in state["log_history"] if "loss" in h] == [1, 2]

    trainer = main([*argv, "--resume_from_checkpoint", "last"])
    assert trainer.state.global_step == 3
    assert_same_weights(lora(out / "checkpoint-3"), baseline)
    assert_same_weights(lora(out), baseline)  # the final export


def test_second_signal_exits_at_once():
    """The first signal is a request (a duplicate delivered at once is the same request); a later one ends the
    process at once, by that signal."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "trainer" / "run_state" / "faults_worker.py"), "signals"],
                          capture_output=True, text=True, timeout=30)
    assert "requested True SIGTERM" in proc.stdout
    assert proc.stdout.count("SIGTERM received") == 1
    assert "second SIGUSR1" in proc.stdout and "still alive" not in proc.stdout
    assert proc.returncode == -signal.SIGUSR1


# ---- NaN ---------------------------------------------------------------------------------------------------------


def inject_nan(trainer, steps):
    """Make the training forward of the given optimizer steps return NaN velocities (NaN loss and gradients)."""
    velocity = trainer.policy.velocity

    def poisoned(model, *args, **kwargs):
        v = velocity(model, *args, **kwargs)
        if model.training and trainer.state.global_step + 1 in steps:
            return v * float("nan")
        return v

    trainer.policy.velocity = poisoned


def test_nan_loss_skips_the_update_and_resume_is_exact(recipe, tmp_path):
    out = tmp_path / "out"
    trainer = build_trainer(recipe, out, save_total_limit=None)
    inject_nan(trainer, {2})
    trainer.train()
    logs = step_logs(trainer)
    assert [round(h["skipped_steps"]) for h in logs] == [0, 1, 1]
    assert math.isnan(logs[1]["grad_norm"]) and math.isfinite(logs[2]["grad_norm"])
    # The skipped step changed neither the weights nor the optimizer state.
    assert_same_weights(lora(out / "checkpoint-2"), lora(out / "checkpoint-1"))
    opt1, opt2 = (torch.load(out / f"checkpoint-{k}" / "optimizer.pt", weights_only=True)["state"] for k in (1, 2))
    assert opt1.keys() == opt2.keys() and opt1
    for key in opt1:
        for name, value in opt1[key].items():
            torch.testing.assert_close(opt2[key][name], value, rtol=0, atol=0)
    assert json.loads((out / "checkpoint-2" / "step_guard.json").read_text())["skipped_steps"] == 1
    final = lora(out / "checkpoint-3")
    assert any(not torch.equal(final[k], v) for k, v in lora(out / "checkpoint-2").items())
    # Resuming after the skipped step gives the same run.
    shutil.rmtree(out / "checkpoint-3")
    resumed = build_trainer(recipe, out, save_total_limit=None)
    resumed.train(resume_from_checkpoint=True)
    assert [round(h["skipped_steps"]) for h in step_logs(resumed)] == [0, 1, 1]
    assert_same_weights(lora(out / "checkpoint-3"), final)


def test_consecutive_non_finite_steps_stop_the_run_and_save_nothing_new(recipe, tmp_path):
    from flowgrpo.trainer.run_state.step_guard import TooManySkippedStepsError

    out = tmp_path / "out"
    trainer = build_trainer(recipe, out, max_consecutive_skipped_steps=2)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    inject_nan(trainer, {1, 2, 3})
    with pytest.raises(TooManySkippedStepsError) as info:
        trainer.train()
    message = str(info.value)
    for expected in ("2 optimizer steps in a row (steps 1-2)", "max_consecutive_skipped_steps=2", "reward=",
                     "rewards/brightness/mean=", "loss=nan", "grad_norm=nan", "checkpoint-1"):
        assert expected in message, (expected, message)
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-1"]
    assert not (out / "checkpoint-2").exists()
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param, initial[name], rtol=0, atol=0)


# ---- rewards -----------------------------------------------------------------------------------------------------


def test_reward_server_killed_and_restarted_mid_run(recipe, baseline, tmp_path):
    """The remote reward's server dies after step 1 and comes back after step 2. With ``reward_on_failure='skip'``
    the run goes on (step 2's samples are scored None and counted as failed); with ``'raise'`` it stops with a
    checkpoint of step 1 and the rerun with resume ends with the uninterrupted weights."""
    from flowgrpo.rewards.failures import RewardFailedError
    from flowgrpo.rewards.server import serve

    served = {"brightness": faults_worker.brightness}
    server = serve(served, port=0)
    port = server.server_address[1]
    servers = [server]

    def kill():
        servers[-1].shutdown()

    def restart():
        servers.append(serve(served, port=port))

    remote = {"reward_funcs": ["remote"], "reward_kwargs": {"remote": {"url": server.url, "max_retries": 0,
                                                                         "backoff": 0.01, "timeout": 10}}}
    try:
        lenient = build_trainer(recipe, tmp_path / "skip", [OnStepEnd(step_1=kill, step_2=restart)],
                                reward_on_failure="skip", **remote)
        lenient.train()
        logs = step_logs(lenient)
        assert [h["rewards/remote/failed"] for h in logs] == [0.0, 4.0, 0.0]
        assert math.isnan(logs[1]["rewards/remote/mean"]) and math.isfinite(logs[2]["rewards/remote/mean"])
        assert [round(h["skipped_steps"]) for h in logs] == [0, 0, 0] and lenient.state.global_step == 3

        out = tmp_path / "raise"
        strict = build_trainer(recipe, out, [OnStepEnd(step_1=kill)], save_steps=100, **remote)
        with pytest.raises(RewardFailedError) as info:
            strict.train()
        message = str(info.value)
        assert "step 2" in message and "remote" in message and "RemoteRewardConnectionError" in message
        assert f"is saved in {out / 'checkpoint-1'}" in message and "--resume_from_checkpoint last" in message
        assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-1"]
        restart()
        resumed = build_trainer(recipe, out, save_steps=100, **remote)
        resumed.train(resume_from_checkpoint="last")
        assert_same_weights(lora(out / "checkpoint-3"), baseline)
    finally:
        for s in servers:
            s.shutdown()


def test_reward_on_failure_policies():
    from flowgrpo import FlowGRPOConfig
    from flowgrpo.rewards import resolve_reward_funcs

    def broken(prompts, images, **columns):
        raise RuntimeError("scorer crashed")

    def length(prompts, images, **columns):
        return [float(len(p)) for p in prompts]

    images = [None, None]
    lenient = resolve_reward_funcs([broken, length], on_failure={"broken": "none"})  # 'none' = 'skip'
    result = lenient(["a", "bb"], images)
    assert result.per_reward["broken"] == [None, None] and result.total == [None, None]
    assert result.failed == {"broken": 2, "length": 0}
    assert result.statistics()["rewards/broken/failed"] == 2.0
    with pytest.raises(RuntimeError, match="scorer crashed"):
        resolve_reward_funcs([broken, length])(["a"], [None])
    with pytest.raises(ValueError, match="on_failure='ignore' is not valid"):
        resolve_reward_funcs([length], on_failure="ignore")
    with pytest.raises(ValueError, match=r"reward_on_failure\['x'\]='later' is not valid"):
        FlowGRPOConfig(output_dir="unused", reward_on_failure='{"x": "later"}')
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps=0"):
        FlowGRPOConfig(output_dir="unused", max_consecutive_skipped_steps=0)
    with pytest.raises(ValueError, match="SIGKILL"):
        FlowGRPOConfig(output_dir="unused", preemption_signals=["SIGKILL"])


# ---- a full disk -------------------------------------------------------------------------------------------------


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(recipe, baseline, tmp_path, monkeypatch, caplog):
    """ENOSPC is injected into the writer of step 2's optimizer state (a real full disk cannot be made here): the
    run stops with an error naming the checkpoint, checkpoint-1 is untouched, nothing half-written remains, and
    the rerun from checkpoint-1 ends with the uninterrupted weights."""
    out = tmp_path / "out"
    digests = {}

    def fingerprint(folder: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}

    real_save = torch.save

    def save_on_a_full_disk(obj, f, *args, **kwargs):
        if ".staging-checkpoint-2" in str(f) and str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_on_a_full_disk)
    trainer = build_trainer(recipe, out, [OnStepEnd(step_2=lambda: digests.update(fingerprint(out / "checkpoint-1")))])
    with caplog.at_level("WARNING"), pytest.raises(CheckpointSaveError) as info:
        trainer.train(resume_from_checkpoint="last")
    assert "no complete checkpoint in" in caplog.text and "starting from scratch" in caplog.text
    message = str(info.value)
    assert info.value.path == str(out / "checkpoint-2")
    assert f"Saving checkpoint {out / 'checkpoint-2'} failed" in message and "No space left on device" in message
    assert f"{out / 'checkpoint-1'}, is intact" in message and "Free disk space" in message
    assert fingerprint(out / "checkpoint-1") == digests
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]

    monkeypatch.setattr(torch, "save", real_save)
    resumed = build_trainer(recipe, out)
    resumed.train(resume_from_checkpoint="last")
    assert_same_weights(lora(out / "checkpoint-3"), baseline)
