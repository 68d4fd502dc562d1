"""Rollouts on Ray workers (``rollout_backend: ray``), on one local Ray cluster shared by this module.

The cluster is started the way the trainer starts its own (`flowgrpo.trainer.rollout.ray.cluster.start_local_cluster`:
token authentication with a fresh token in an owner-only file, no dashboard, a small object store, a short temporary
folder) and the trainers join it (`connect_ray` on an initialised connection). Everything runs on the CPU with the
tiny SD3 pipeline and the registered ``jpeg_compressibility`` reward (the workers must be able to import the rewards
they score), one torch thread per process.

Each trainer run starts its own `RolloutWorker` (a fresh Python process that imports torch, transformers, diffusers
and peft: several seconds each); that is what makes this module take tens of seconds, so it keeps to the runs the
contracts need: the equality with the local backend (Flow-GRPO with rewards on a `RewardWorker`; DiffusionNFT, whose
old policy must reach the worker), one uninterrupted one-step-off run as the reference of the two fault runs (a worker
killed mid-generation; a worker that stops answering, then resumed from the checkpoint), AWM and online DPO with stale
samples, the token, and one two-process launch (which starts its own cluster, as a user's launch does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from support.plugin_package import ensure_plugin_installed
from support.trainer_cases import PROMPTS, kind_classes, lora_config

from flowgrpo import (
    AWMConfig,
    AWMTrainer,
    DiffusionDPOConfig,
    DiffusionDPOTrainer,
    DiffusionNFTConfig,
    DiffusionNFTTrainer,
    FlowGRPOConfig,
    FlowGRPOTrainer,
)
from flowgrpo.trainer.rollout.backend import RolloutWorkerError
from flowgrpo.trainer.rollout.ray.backend import BACKEND_STATE_NAME, BACKEND_WEIGHTS_NAME, RayRolloutBackend
from flowgrpo.trainer.rollout.ray.cluster import probe_tokenless_join, ray_listening_sockets, start_local_cluster

REPO = Path(__file__).resolve().parents[2]
REWARD = "jpeg_compressibility"
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]  # one cluster, one test worker


@pytest.fixture(scope="module")
def ray_cluster():
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    connection = start_local_cluster(num_cpus=2, num_gpus=0, object_store_memory=96 << 20)
    yield connection
    connection.close()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CLASSES = {"flow_grpo": (FlowGRPOConfig, FlowGRPOTrainer), "diffusion_nft": (DiffusionNFTConfig, DiffusionNFTTrainer),
           "awm": (AWMConfig, AWMTrainer), "diffusion_dpo": (DiffusionDPOConfig, DiffusionDPOTrainer)}


def build(kind: str, path, out: Path, **overrides):
    config_class, trainer_class = CLASSES[kind] if kind in CLASSES else kind_classes(kind)  # a plugin: installed
    settings = dict(
        output_dir=str(out), report_to=[], per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, resolution=64, num_inference_steps=4, eval_num_inference_steps=4, guidance_scale=1.0,
        max_steps=2, learning_rate=1e-2, beta=0.0, max_sequence_length=16, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, log_images_steps=0, dtype="float32", cpu_threads="1", rollout_timeout_s=120.0,
    )
    if "sde_window_size" in {f.name for f in dataclasses.fields(config_class)}:
        settings.update(sde_window_size=2, sde_window_range=[0, 2])
    settings.update(overrides)
    return trainer_class(model=str(path), reward_funcs=REWARD, args=config_class(**settings),
                         train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora_config())


def trained(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.unwrapped.named_parameters() if v.requires_grad}


def step_logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_local_cluster_refuses_clients_without_its_token(ray_cluster):
    token = Path(ray_cluster.token_path)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    assert os.environ["RAY_AUTH_MODE"] == "token"
    # A fresh process with no token (token authentication off on its side) is refused at the GCS...
    assert probe_tokenless_join(ray_cluster.address) is False
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    code = "import ray, sys\nray.init(address=sys.argv[1], log_to_driver=False)\nprint('joined')"
    for intruder in ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, {"RAY_AUTH_MODE": "disabled"}):
        out = subprocess.run([sys.executable, "-c", code, ray_cluster.address], capture_output=True, text=True,
                             timeout=120, env={**env, **intruder, "RAY_gcs_server_port_wait_time_s": "1"})
        assert out.returncode != 0 and "joined" not in out.stdout
        assert "InvalidAuthToken" in out.stderr, out.stderr[-2000:]
    # ... while the same process with the run's token file joins (the refusal is the token's doing).
    out = subprocess.run([sys.executable, "-c", code, ray_cluster.address], capture_output=True, text=True, timeout=120,
                         env={**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    assert out.returncode == 0 and "joined" in out.stdout, out.stderr[-2000:]
    # No dashboard, hence no Jobs API: nothing listens on the dashboard's port, no dashboard process runs.
    sockets = ray_listening_sockets(ray_cluster.temp_dir)  # this cluster's processes only
    assert sockets, "ss found no Ray socket"
    assert not [s for s in sockets if s[0].endswith(":8265") or "dashboard" in s[1]]
    assert {"gcs_server", "raylet"} <= {name for _, name, _ in sockets}


def test_joining_a_cluster_without_token_authentication_warns(caplog):
    """A cluster started by hand without token authentication (``ray start --head`` with RAY_AUTH_MODE=disabled,
    even with --node-ip-address=127.0.0.1) accepts a tokenless client: joining it through ray_address warns."""
    import logging
    import shutil
    import tempfile
    import time

    from flowgrpo.trainer.rollout.ray import cluster

    temp = tempfile.mkdtemp(prefix="fgo", dir="/tmp")  # short: Unix socket paths are limited to 107 bytes
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_AUTH_MODE": "disabled"}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    try:
        out = subprocess.run([ray_cli, "start", "--head", "--port=0", "--num-cpus=0", "--include-dashboard=false",
                              "--node-ip-address=127.0.0.1", f"--temp-dir={temp}", "--disable-usage-stats"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        address = next(line.split("--address=")[1].strip().strip("'\"") for line in out.stdout.splitlines()
                       if "ray start --address=" in line)
        # the servers listen on every interface anyway
        assert any(local.startswith("*:") and name == "gcs_server" for local, name, _ in
                   cluster.ray_listening_sockets(temp))
        with caplog.at_level(logging.WARNING, logger=cluster.__name__):
            cluster._warn_if_open(address)
        assert "accepts clients without a token" in caplog.text and address in caplog.text
    finally:
        pids = cluster._cluster_pids(temp) - {os.getpid()}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        shutil.rmtree(temp, ignore_errors=True)


# Long (each case: a local run, a Ray run and its worker's start-up; Flow-GRPO also a reward worker's): the equality
# of the two backends is the contract item 5 names, for the log-prob and the old-policy paths.
@pytest.mark.run_first
@pytest.mark.parametrize("kind", ["flow_grpo", "diffusion_nft", "scaled_grpo"])
def test_ray_backend_samples_scores_and_trains_exactly_as_the_local_one(kind, ray_cluster, tiny_sd3_path, tmp_path):
    """max_staleness 0 on the CPU with one thread everywhere: the same rewards at every step and the same weights
    after two steps. Flow-GRPO's rewards are scored by a reward worker; DiffusionNFT samples with its old policy,
    which must reach the worker at every sync; a third-party algorithm (support/plugin_package.py, advantages
    reversed) runs there as its spec allows."""
    if kind == "scaled_grpo":
        ensure_plugin_installed()  # before the workers start: they find the package on PYTHONPATH
    overrides = {"advantage_scale": -1.0} if kind == "scaled_grpo" else {}
    extra = {"reward_backend": "ray"} if kind == "flow_grpo" else {}
    remote = build(kind, tiny_sd3_path, tmp_path / "ray", rollout_backend="ray", **extra,
                   **overrides)  # its workers start loading
    local = build(kind, tiny_sd3_path, tmp_path / "local", **overrides)
    local.train()
    remote.train()
    assert isinstance(remote.rollout_backend, RayRolloutBackend)
    # one torch thread like the trainer, at the trainer's priority (Ray's default niceness 15 is undone)
    assert [(i["torch_threads"], i["niceness"]) for i in remote.rollout_backend.worker_info] == [(1, 0)]
    keys = ("reward", "reward_std", f"rewards/{REWARD}/mean")
    assert [{k: h[k] for k in keys} for h in step_logs(remote)] == [{k: h[k] for k in keys} for h in step_logs(local)]
    assert_same_weights(trained(remote), trained(local))
    for logs in step_logs(remote):
        assert logs["rollout/staleness_max"] == 0 and logs["rollout/worker_restarts"] == 0
        assert logs["rollout/worker_weight_loads"] == logs["step"]  # one load per sync, one sync per step
    if kind != "diffusion_nft":
        assert all(h["rollout/first_pass_ratio"] == 1.0 for h in step_logs(remote))


# Long: a three-step run and its worker's start-up; shared by the two tests below.
@pytest.fixture(scope="module")
def one_step_off(ray_cluster, tiny_sd3_path, tmp_path_factory):
    """The reference of the fault tests: Flow-GRPO, three steps, one step off (max_staleness 1)."""
    trainer = build("flow_grpo", tiny_sd3_path, tmp_path_factory.mktemp("one_step_off"), rollout_backend="ray",
                    max_staleness=1, max_steps=3)
    trainer.train()
    return trainer


def test_one_step_off_samples_the_next_generation_with_the_previous_weights(one_step_off):
    logs = step_logs(one_step_off)
    assert [h["rollout/staleness_max"] for h in logs] == [0, 1, 1]
    # the second and third generations were sampled while the one before trained: the first pass is off-policy
    assert logs[0]["rollout/first_pass_ratio"] == 1.0
    assert all(h["rollout/first_pass_ratio"] != 1.0 for h in logs[1:])
    assert all("on_policy_ratio_max_dev" not in h for h in logs[1:])


# Long: a run whose worker is restarted (a second start-up), a 3-s timeout, and the resumed run with its own worker.
def test_a_killed_worker_is_restarted_and_one_that_stops_answering_stops_the_run_with_a_checkpoint(
        one_step_off, tiny_sd3_path, tmp_path):
    """One run, two faults, then a resume. Generation 1: the worker is killed (SIGKILL) once its first micro-batch
    has arrived; Ray restarts it, it reloads the current weights and the generation is sampled again with its own
    seeds. Generation 2: the (restarted) worker is stopped (SIGSTOP) the same way; past rollout_timeout_s the run
    stops with an error naming it and a checkpoint of step 2, from which ``resume_from_checkpoint="last"`` ends where
    the uninterrupted run ended: no group was lost or trained twice, the in-flight one was sampled again with the
    weights it was first sent with."""
    trainer = build("flow_grpo", tiny_sd3_path, tmp_path, rollout_backend="ray", max_staleness=1, max_steps=3)
    faults, arrivals = {}, []

    def fault(gen_index, index, worker, pid):
        if index != 0:
            return
        arrivals.append(gen_index)
        if arrivals == [0, 1]:  # generation 1's first micro-batch: kill the worker
            faults[1] = (worker, pid)
            os.kill(pid, signal.SIGKILL)
        elif arrivals == [0, 1, 1]:  # sampled again by the restarted worker: the next wait (generation 2's) has 3 s
            trainer.args.rollout_timeout_s = 3.0
        elif gen_index == 2 and 2 not in faults:  # generation 2's first micro-batch: stop the worker
            faults[2] = (worker, pid)
            os.kill(pid, signal.SIGSTOP)

    trainer.rollout_backend.on_micro_batch = fault
    with pytest.raises(RolloutWorkerError) as raised:
        trainer.train()
    worker = faults[1][0]
    if 2 in faults:  # (unless generation 2 took more than 3 s to come at all: then it timed out by itself)
        assert faults[2][1] != faults[1][1]  # the restarted worker is a new process
    message = str(raised.value)
    assert worker in message and "rollout_timeout_s=3" in message
    assert "checkpoint-2" in message and "--resume_from_checkpoint last" in message
    logs = step_logs(trainer)
    assert [h["rollout/worker_restarts"] for h in logs] == [0, 1]
    assert [h["reward"] for h in logs] == [h["reward"] for h in step_logs(one_step_off)[:2]]
    checkpoint = tmp_path / "checkpoint-2"
    saved = json.loads((checkpoint / BACKEND_STATE_NAME).read_text())
    # generation 2 was sent with the weights after step 1 and never trained: it is in flight, with those weights
    assert saved["in_flight"] == {"2": 1} and saved["version"] == 1 and saved["saved_versions"] == [1]
    assert (checkpoint / BACKEND_WEIGHTS_NAME).is_file()

    resumed = build("flow_grpo", tiny_sd3_path, tmp_path, rollout_backend="ray", max_staleness=1, max_steps=3)
    resumed.train(resume_from_checkpoint="last")
    assert step_logs(resumed)[-1]["reward"] == step_logs(one_step_off)[-1]["reward"]
    assert_same_weights(trained(resumed), trained(one_step_off))


# Long: each case is a two-step run with its worker's start-up (the staleness semantics of each algorithm).
@pytest.mark.parametrize("kind, extra", [("awm", {"off_policy": False, "train_timesteps": 2}),
                                         ("diffusion_dpo", {"dpo_mode": "online", "beta_dpo": 50.0})])
def test_awm_and_online_dpo_train_on_stale_samples(kind, extra, ray_cluster, tiny_sd3_path, tmp_path):
    trainer = build(kind, tiny_sd3_path, tmp_path, rollout_backend="ray", max_staleness=1, **extra)
    if kind == "awm":  # stale samples: the sampling policy's surrogate log-probs are recorded by the worker
        assert not trainer.rollouts.strategy.old_log_probs_at_rollout
    trainer.train()
    logs = step_logs(trainer)
    assert [h["rollout/staleness_max"] for h in logs] == [0, 1]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    if kind == "awm":
        assert "old_log_probs" in trainer.buffer[0]


def test_two_processes_share_a_worker_and_send_the_weights_once(tiny_sd3_path, tmp_path):
    """``accelerate launch`` with two CPU processes (gloo) and one rollout worker serving both, one step off, from a
    user's environment (no Ray variable): process 0 starts its own token-authenticated cluster and process 1 joins it
    with the run's token file. Each rank gets its own share (its own noise), and the worker loads every sync's weights
    once (process 0 sends them). About 25 s on a quiet machine: a second cluster starts, two trainer processes and a
    worker each import the stack."""
    prompts = tmp_path / "same_prompt.txt"
    prompts.write_text('a wooden sign that says "OPEN"\n' * 8)  # two generations per epoch
    out, rank_logs = tmp_path / "out", tmp_path / "ranks"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_ddp.yaml",
           "src/train.py", "recipes/tiny_cpu.yaml", "--max_steps", "2", "--output_dir", str(out),
           "--model_name_or_path", str(tiny_sd3_path), "--dataset_name", str(prompts), "--eval_dataset_name",
           str(prompts), "--max_eval_samples", "2", "--disable_tqdm", "true", "--eval_on_start", "false",
           "--save_strategy", "no", "--reward_funcs", REWARD, "--reward_weights", "1.0", "--cpu_threads", "1",
           "--rollout_backend", "ray", "--rollout_workers", "1", "--max_staleness", "1"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled",
           "FLOWGRPO_RANK_LOG_DIR": str(rank_logs)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r0, r1 = ([json.loads(line) for line in (rank_logs / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1))
    assert [r["step"] for r in r0] == [r["step"] for r in r1] == [1, 2]
    for a, b in zip(r0, r1):
        assert a["logs"]["reward"] == b["logs"]["reward"]  # the gathered rewards
        assert not {s["image_sha1"] for s in a["samples"]} & {s["image_sha1"] for s in b["samples"]}
        assert a["logs"]["rollout/staleness_max"] == b["logs"]["rollout/staleness_max"]
    assert [r["logs"]["rollout/staleness_max"] for r in r0] == [0, 1]
    # process 0 sent each sync once: the worker loaded exactly one version per step, not one per process
    assert [r["logs"]["rollout/worker_weight_loads"] for r in r0] == [1, 2]
    assert all("rollout/worker_weight_loads" not in r["logs"] for r in r1)
