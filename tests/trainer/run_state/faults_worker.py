"""Helpers of tests/trainer/run_state/test_faults.py that also run in their own processes.

    python tests/trainer/run_state/faults_worker.py save-loop OUTPUT_DIR LAST_STEP      # many atomic saves; killed at random moments
    python tests/trainer/run_state/faults_worker.py signals                             # preemption handler alone: first, second signal

``save-loop`` and ``signals`` load ``flowgrpo/trainer/run_state/checkpointing.py`` and ``preemption.py`` from their files
(standard library only) so that a process starts in a few tens of milliseconds: the package ``flowgrpo.trainer``
imports torch and diffusers. ``brightness`` is the reward of the training runs (``faults_worker:brightness``); with
``FLOWGRPO_FAULT_GATE=DIR`` it writes ``DIR/waiting`` at its ``FLOWGRPO_FAULT_GATE_CALL``-th call (that is, while
that optimizer step is under way) and waits for ``DIR/release`` before scoring.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[3] / "src" / "flowgrpo" / "trainer" / "run_state"
PAYLOAD_BYTES = 1 << 20  # per file, three files per checkpoint: a save takes a few milliseconds


def load_module(name: str):
    spec = importlib.util.spec_from_file_location(f"_faults_{name}", SOURCE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---- a training state that is a chain of hashes: resuming must reproduce it exactly ----------------------------


def chain(state: bytes, step: int) -> bytes:
    return hashlib.sha256(state + step.to_bytes(8, "little")).digest()


def expected_state(step: int) -> bytes:
    state = b"seed"
    for k in range(1, step + 1):
        state = chain(state, k)
    return state


def payload(state: bytes, index: int) -> bytes:
    block = hashlib.sha256(state + bytes([index])).digest()
    return block * (PAYLOAD_BYTES // len(block))


def write_checkpoint(folder: Path, step: int, state: bytes) -> None:
    """Files as a trainer writes them: weights, optimizer, RNG, then the trainer state (plain writes)."""
    for index, name in enumerate(("model.safetensors", "optimizer.pt", "rng_state.pth")):
        with open(folder / name, "wb") as f:
            f.write(payload(state, index))
    (folder / "state.bin").write_bytes(state)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}), encoding="utf-8")


def check_checkpoint(folder: Path) -> bool:
    """Every file holds what the step's state says (the content, not only the sizes of the manifest)."""
    step = int(folder.name.rsplit("-", 1)[1])
    state = expected_state(step)
    if (folder / "state.bin").read_bytes() != state:
        return False
    return all((folder / name).read_bytes() == payload(state, i)
               for i, name in enumerate(("model.safetensors", "optimizer.pt", "rng_state.pth")))


def save_loop(output_dir: str, last_step: int) -> None:
    ckpt = load_module("checkpointing")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt.remove_stale_staging(out)  # what the trainer does when it starts
    newest = ckpt.newest_complete_checkpoint(out)
    step, state = (0, b"seed") if newest is None else (int(Path(newest).name.rsplit("-", 1)[1]),
                                                       (Path(newest) / "state.bin").read_bytes())
    print(f"start {step}", flush=True)
    while step < last_step:
        step += 1
        state = chain(state, step)
        ckpt.save_checkpoint_atomically(out, step, lambda folder, s=step, st=state: write_checkpoint(folder, s, st))
        ckpt.rotate_checkpoints(out, 2)
        print(f"saved {step}", flush=True)
    print("done", flush=True)


def signals() -> None:
    """First SIGTERM: a request (the process goes on); a duplicate within the window: ignored; a second one
    after the window: the process ends at once by SIGTERM."""
    preemption = load_module("preemption")
    handler = preemption.PreemptionHandler(duplicate_window_s=0.2, announce=lambda m: print(m, flush=True))
    handler.install()
    import signal

    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same preemption delivered twice
    print(f"requested {handler.requested} {handler.signal_name}", flush=True)
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(5)
    print("still alive", flush=True)


# ---- the reward of the training runs ---------------------------------------------------------------------------

_calls = 0


def brightness(prompts, images, **columns):
    """Mean brightness in [0, 1]; optionally holds its N-th call until released (see the module docstring)."""
    import numpy as np

    global _calls
    _calls += 1
    gate = os.environ.get("FLOWGRPO_FAULT_GATE")
    if gate and _calls == int(os.environ.get("FLOWGRPO_FAULT_GATE_CALL", "2")):
        Path(gate, "waiting").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not Path(gate, "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return [float(np.asarray(im, dtype=np.float32).mean() / 255.0) for im in images]


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "save-loop":
        save_loop(sys.argv[2], int(sys.argv[3]))
    elif command == "signals":
        signals()
    else:
        raise SystemExit(f"unknown command {command!r}")
