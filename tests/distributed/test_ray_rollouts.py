"""Rollouts on Ray workers (``rollout_backend: ray``), on one local Ray cluster of two nodes shared by this module.

The cluster is started the way the trainer starts its own (`flowgrpo.trainer.rollout.ray.cluster.start_local_cluster`:
token authentication with a fresh token in an owner-only file, no dashboard, everything in a private 0700 folder,
held to a start-up time limit) with one more raylet carrying the custom resource ``rollout_node``; the trainers join
it (`connect_ray` on an initialised connection). Everything runs on the CPU with the tiny SD3 pipeline and the
registered ``jpeg_compressibility`` reward (the workers must be able to import the rewards they score), one torch
thread per process.

A worker's start is mostly its process importing torch, transformers, diffusers and peft (10 to 20 s each on this
shared machine), so the module's trainer runs take their workers from one `RolloutWorkerPool`: the runs that ask for
the same resources share one worker process, which rebuilds itself for each run's algorithm. A run whose worker is
killed, stopped or placed on the second node starts its own.
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
from support.trainer_cases import PROMPTS, TRAINER_KINDS, kind_classes, lora_config, teacher_lora_folder

from flowgrpo.trainer.rollout.backend import RolloutWorkerError
from flowgrpo.trainer.rollout.ray.backend import BACKEND_STATE_NAME, BACKEND_WEIGHTS_NAME, RayRolloutBackend
from flowgrpo.trainer.rollout.ray.cluster import probe_tokenless_join, ray_listening_sockets, start_local_cluster
from flowgrpo.trainer.rollout.ray.pool import RolloutWorkerPool

REPO = Path(__file__).resolve().parents[2]
REWARD = "jpeg_compressibility"
#: the longest this module's cluster may take to start (nodes up and connected); past it the module fails, never hangs
CLUSTER_START_TIMEOUT_S = 180.0
#: the custom resource of the second node, and the worker resources that place a worker there
ROLLOUT_NODE = "rollout_node"
ON_SECOND_NODE = {"num_cpus": 1, "resources": {ROLLOUT_NODE: 1}}
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]  # one cluster, one test worker


@pytest.fixture(scope="module")
def ray_cluster():
    ensure_plugin_installed()  # before any worker starts: every worker finds the third-party algorithm's package
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    connection = start_local_cluster(num_cpus=2, num_gpus=0, object_store_memory=96 << 20,
                                     timeout_s=CLUSTER_START_TIMEOUT_S,
                                     # 2 CPUs: room for the worker placed there even when Ray put the
                                     # pool's shared worker there too
                                     extra_nodes=[{"num_cpus": 2, "resources": {ROLLOUT_NODE: 1},
                                                   "object_store_memory": 96 << 20}])
    with RolloutWorkerPool():  # the trainers of the module share their workers
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


def build(kind: str, path, out: Path, **overrides):
    from flowgrpo import DiffusionNFTConfig, DiffusionNFTTrainer

    config_class, trainer_class = (DiffusionNFTConfig, DiffusionNFTTrainer) if kind == "diffusion_nft" else \
        kind_classes(kind)
    fields = {f.name for f in dataclasses.fields(config_class)}
    settings = dict(
        output_dir=str(out), report_to=[], per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, resolution=64, num_inference_steps=4, eval_num_inference_steps=4, guidance_scale=1.0,
        max_steps=2, learning_rate=1e-2, beta=0.0, max_sequence_length=16, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, log_images_steps=0, dtype="float32", cpu_threads="1", rollout_timeout_s=120.0,
        rollout_startup_timeout_s=300.0,
    )
    settings.update(dict(TRAINER_KINDS.get(kind, (None, None, {}))[2]))  # what exercises the algorithm's own state
    if "sde_window_range" in fields and not settings.get("branch_steps"):
        settings.update(sde_window_size=2, sde_window_range=[0, 2])
    if kind == "diffusion_opd":
        settings["teacher_lora"] = str(teacher_lora_folder(path))
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


def _reachable_only_by_owner(path: Path, root: Path) -> bool:
    """Whether some folder between ``root`` (included) and ``path`` is owned by this user and closed to others."""
    for folder in [path.parent, *path.parent.parents]:
        info = folder.stat()
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077 == 0:
            return True
        if folder == root:
            return False
    return False


def test_the_local_cluster_is_private_and_refuses_clients_without_its_token(ray_cluster):
    import ray

    folder = Path(ray_cluster.temp_dir)
    token = Path(ray_cluster.token_path)
    assert token.parent == folder and stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    # the run's folder is ours and closed; Ray's own folders inside are world-writable (Ray resets their mode), and
    # every Unix socket of both nodes' sessions lies behind the closed folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
    assert stat.S_IMODE(Path(ray_cluster.ray_dir).stat().st_mode) == 0o777
    sockets = [p for p in folder.rglob("*") if stat.S_ISSOCK(p.lstat().st_mode)]
    assert {"raylet", "raylet.1", "plasma_store", "plasma_store.1"} <= {p.name for p in sockets}
    assert all(_reachable_only_by_owner(p, folder) for p in sockets)
    assert os.environ["RAY_AUTH_MODE"] == "token"
    # two nodes, the second with its custom resource, both started with the run's token
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2 and sum(ROLLOUT_NODE in n["Resources"] for n in nodes) == 1
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
    listening = ray_listening_sockets(ray_cluster.temp_dir)  # this cluster's processes only
    assert listening, "ss found no Ray socket"
    assert not [s for s in listening if s[0].endswith(":8265") or "dashboard" in s[1]]
    assert {"gcs_server", "raylet"} <= {name for _, name, _ in listening}


def test_a_cluster_that_does_not_start_in_time_fails_naming_what_it_waited_for(tmp_path):
    """A head node that does not come up within ``ray_start_timeout_s`` (here 0.5 s: ``ray start`` alone takes longer)
    stops the start with `RayStartError` saying which node and what was waited for, and nothing is left running (a
    fresh process: the start sets this process's token authentication)."""
    code = ("import sys\nfrom flowgrpo.trainer.rollout.ray.cluster import RayStartError, start_local_cluster\n"
            "try:\n    start_local_cluster(num_cpus=1, timeout_s=0.5, temp_root=sys.argv[1])\n"
            "except RayStartError as err:\n    print(err)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert "The Ray head node (GCS and raylet) did not start within ray_start_timeout_s=0.5 s" in out.stdout, out.stderr
    assert "Ray runtime started." in out.stdout  # what it waited for
    assert list(tmp_path.iterdir()) == []  # the run's folder is removed
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left.strip()


def test_joining_a_cluster_without_token_authentication_warns(caplog):
    """A cluster started by hand without token authentication (``ray start --head`` with RAY_AUTH_MODE=disabled,
    even with --node-ip-address=127.0.0.1) accepts a tokenless client: joining it through ray_address warns."""
    import logging
    import shutil
    import tempfile
    import time

    from flowgrpo.trainer.rollout.ray import cluster

    temp = tempfile.mkdtemp(prefix="fgo", dir="/tmp")  # short: Unix socket paths are limited to 107 bytes
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_AUTH_MODE": "disabled",
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
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


#: each algorithm with the transport its equality run uses (both transports carry the same weights: the collective
#: runs cover an old policy, a named copy, trees and distillation)
EQUALITY_CASES = [("flow_grpo", "object_store"), ("diffusion_nft", "collective"), ("scaled_grpo", "object_store"),
                  ("dgpo", "object_store"), ("crd", "collective"), ("branch_grpo", "collective"),
                  ("flow_dppo", "object_store"), ("diffusion_opd", "collective")]


# Long (each case: a local run and a Ray run on the pool's shared worker, which rebuilds itself for the algorithm;
# the first case pays the worker's start-up, Flow-GRPO also a reward worker's): the equality of the two backends for
# every trainer, the contract of max_staleness 0.
@pytest.mark.run_first
@pytest.mark.parametrize("kind, weight_sync", EQUALITY_CASES)
def test_ray_backend_samples_scores_and_trains_exactly_as_the_local_one(kind, weight_sync, ray_cluster, tiny_sd3_path,
                                                                        tmp_path):
    """max_staleness 0 on the CPU with one thread everywhere: the same rewards at every step and the same weights
    after two steps. Flow-GRPO's rewards are scored by a reward worker; DiffusionNFT samples with its old policy and
    DGPO (after step 1) with its EMA reference, which must reach the worker at every sync; CRD's sampling copy lags
    the policy; BranchGRPO samples trees; Flow-DPPO anchors on the recorded means; on-policy distillation replays the
    student's states with the teacher on the trainer; a third-party algorithm (support/plugin_package.py, advantages
    reversed) runs there as its spec allows."""
    extra = {"reward_backend": "ray"} if kind == "flow_grpo" else {}
    if kind == "dgpo":  # the EMA reference samples the second and third generations, apart from the policy by then
        extra.update(dgpo_switch_ema_ref=0, max_steps=3)
    remote = build(kind, tiny_sd3_path, tmp_path / "ray", rollout_backend="ray", weight_sync=weight_sync, **extra)
    local = build(kind, tiny_sd3_path, tmp_path / "local", **{k: v for k, v in extra.items() if k != "reward_backend"})
    local.train()
    remote.train()
    assert isinstance(remote.rollout_backend, RayRolloutBackend)
    keys = ("reward", "reward_std", f"rewards/{REWARD}/mean", "loss")
    assert [{k: h.get(k) for k in keys} for h in step_logs(remote)] == \
        [{k: h.get(k) for k in keys} for h in step_logs(local)]
    assert_same_weights(trained(remote), trained(local))
    sampled = [h for h in step_logs(remote) if "rollout/staleness_max" in h]  # the steps that start a generation
    assert sampled and all(h["rollout/staleness_max"] == 0 and h["rollout/worker_restarts"] == 0 for h in sampled)
    # one load per sync, one sync per generation
    assert [h["rollout/worker_weight_loads"] for h in sampled] == list(range(1, len(sampled) + 1))
    if kind == "dgpo":  # the second generation was sampled by the EMA reference, on the worker
        assert [h["dgpo/rollouts_by_ema_reference"] for h in step_logs(remote)] == [0.0, 1.0, 1.0]
    if kind in ("flow_grpo", "scaled_grpo", "branch_grpo"):
        assert all(h["rollout/first_pass_ratio"] == 1.0 for h in step_logs(remote))


# Long: a three-step run on the pool's worker; shared by the two tests below.
@pytest.fixture(scope="module")
def one_step_off(ray_cluster, tiny_sd3_path, tmp_path_factory):
    """The reference of the fault test: Flow-GRPO, three steps, one step off (max_staleness 1)."""
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


# Long: a worker on the second node (a start-up), its restart (another), a 3-s timeout, and the resumed run's worker.
def test_a_killed_worker_rejoins_on_its_node_and_one_that_stops_answering_stops_the_run_with_a_checkpoint(
        one_step_off, ray_cluster, tiny_sd3_path, tmp_path, capfd):
    """One run on the second node (``rollout_worker_resources`` with its custom resource), weights over the collective
    group, the worker built from its spec held by the coordinator (nothing of its creation lives in the object store,
    where it could be lost before a restart); two faults, then a resume. Generation 1: the worker is killed (SIGKILL) once
    its first micro-batch has arrived; Ray restarts it on the same node, it joins the group again, receives the
    current weights and the generation is sampled again with its own seeds. Generation 2: the (restarted) worker is
    stopped (SIGSTOP) the same way; past rollout_timeout_s the run stops with an error naming it and a checkpoint of
    step 2, from which ``resume_from_checkpoint="last"`` ends where the uninterrupted run ended (on the first node,
    over the object store): no group was lost or trained twice, the in-flight one was sampled again with the weights
    it was first sent with."""
    import ray

    second_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and ROLLOUT_NODE in n["Resources"])
    trainer = build("flow_grpo", tiny_sd3_path, tmp_path, rollout_backend="ray", max_staleness=1, max_steps=3,
                    weight_sync="collective", rollout_worker_resources=ON_SECOND_NODE)
    backend = trainer.rollout_backend
    faults, arrivals, nodes = {}, [], []

    def fault(gen_index, index, worker, pid):
        if index != 0:
            return
        arrivals.append(gen_index)
        nodes.append(backend.workers.nodes[worker])
        if arrivals == [0, 1]:  # generation 1's first micro-batch: kill the worker
            faults[1] = (worker, pid)
            os.kill(pid, signal.SIGKILL)
        elif arrivals == [0, 1, 1]:  # sampled again by the restarted worker: the next wait (generation 2's) has 3 s
            trainer.args.rollout_timeout_s = 3.0
        elif gen_index == 2 and 2 not in faults:  # generation 2's first micro-batch: stop the worker
            faults[2] = (worker, pid)
            os.kill(pid, signal.SIGSTOP)

    backend.on_micro_batch = fault
    with pytest.raises(RolloutWorkerError) as raised:
        trainer.train()
    worker = faults[1][0]
    assert set(nodes) == {second_node}  # placed there, and restarted there
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
    # nothing a restart needs lives in the object store (Ray's error line about it never appears)
    assert "has constructor arguments in the object store" not in capfd.readouterr().err

    resumed = build("flow_grpo", tiny_sd3_path, tmp_path, rollout_backend="ray", max_staleness=1, max_steps=3)
    resumed.train(resume_from_checkpoint="last")
    assert step_logs(resumed)[-1]["reward"] == step_logs(one_step_off)[-1]["reward"]
    assert_same_weights(trained(resumed), trained(one_step_off))


# Long: each case is a short run on the pool's worker (the staleness semantics of each algorithm).
@pytest.mark.parametrize("kind, extra", [("awm", {"off_policy": False, "train_timesteps": 2}),
                                         ("diffusion_dpo", {"dpo_mode": "online", "beta_dpo": 50.0}),
                                         # two passes per generation: two steps off for a stale one
                                         ("flow_dppo", {"max_staleness": 2, "max_steps": 4}),
                                         ("dgpo", {"dgpo_switch_ema_ref": 0}), ("crd", {})])
def test_every_algorithm_trains_on_stale_samples(kind, extra, ray_cluster, tiny_sd3_path, tmp_path):
    trainer = build(kind, tiny_sd3_path, tmp_path, rollout_backend="ray", **{"max_staleness": 1, **extra})
    if kind == "awm":  # stale samples: the sampling policy's surrogate log-probs are recorded by the worker
        assert not trainer.rollouts.strategy.old_log_probs_at_rollout
    trainer.train()
    logs = step_logs(trainer)
    sampled = [h for h in logs if "rollout/staleness_max" in h]  # the steps that start a generation
    assert [h["rollout/staleness_max"] for h in sampled] == [0, trainer.args.max_staleness]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    if kind == "awm":
        assert "old_log_probs" in trainer.buffer[0]
    if kind == "flow_dppo":  # the stale generation's anchor was replayed by the trainer's weights
        assert "dppo/anchor_log_ratio" in sampled[1] and "behaviour_log_probs" in trainer.buffer[0]


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


#: the recipe and flags the Slurm tests train with: two generations of the one prompt an epoch, one step off, weights
#: over the collective group
SLURM_TRAIN_ARGS = ["recipes/tiny_cpu.yaml", "--max_steps", "2", "--max_eval_samples", "2", "--disable_tqdm", "true",
                    "--eval_on_start", "false", "--save_strategy", "no", "--reward_funcs", REWARD, "--reward_weights",
                    "1.0", "--cpu_threads", "1", "--max_staleness", "1", "--weight_sync", "collective"]
#: the rollout worker's resources: one CPU of the rollout node (a CPU rollout node has one ``rollout_node``)
SLURM_WORKER_RESOURCES = json.dumps({"num_cpus": 1, "resources": {ROLLOUT_NODE: 1}})


def _slurm_train_args(tiny_sd3_path, tmp_path: Path) -> list[str]:
    prompts = tmp_path / "same_prompt.txt"
    prompts.write_text('a wooden sign that says "OPEN"\n' * 8)  # two generations per epoch
    return [*SLURM_TRAIN_ARGS, "--output_dir", str(tmp_path / "out"), "--model_name_or_path", str(tiny_sd3_path),
            "--dataset_name", str(prompts), "--eval_dataset_name", str(prompts)]


def _script_launch(train_args: list[str], main_port: int, ray_address: str) -> list[str]:
    """The ``accelerate`` command line scripts/slurm/flowgrpo_ray.sbatch runs on its one trainer node (the first of the
    allocation, 127.0.0.1 here) for ``train_args``, on the CPU config with one rollout worker: what
    test_the_slurm_script_starts_the_head_joins_a_rollout_node_and_launches_the_trainer checks the script runs, and
    test_the_slurm_scripts_trainer_command_trains_two_ranks_with_rollouts_on_the_rollout_node runs."""
    return ["launch", "--config_file", "accelerate_configs/cpu_ddp.yaml", "--num_machines", "1", "--machine_rank", "0",
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(main_port), "src/train.py", *train_args,
            "--resume_from_checkpoint", "last", "--rollout_backend", "ray", "--ray_address", ray_address,
            "--rollout_workers", "1", "--rollout_worker_resources", SLURM_WORKER_RESOURCES]


def test_the_slurm_script_starts_the_head_joins_a_rollout_node_and_launches_the_trainer(tiny_sd3_path, tmp_path):
    """scripts/slurm/flowgrpo_ray.sbatch on two "nodes" of this machine, ``srun`` and ``scontrol`` stubbed (srun runs
    its command here once per node it names, with that node's SLURM_NODEID), and ``accelerate`` stubbed by a client
    of the cluster that records its command line and what it sees: a token-authenticated head, a rollout node carrying
    ``rollout_node``, the trainer launched with the cluster's address (`_script_launch`), the token in the job's own
    folder, and the nodes gone when the script ends. What that command line trains: the next test."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    _stub(stubs, "scontrol", 'if [ "$1 $2" = "show hostnames" ]; then tr , "\\n" <<< "$3"; fi\n')
    _stub(stubs, "srun", r'''hosts=()
while [ $# -gt 0 ]; do
    case "$1" in
        -w) IFS=, read -ra hosts <<< "$2"; shift 2 ;;
        --nodes=*|--ntasks=*|--ntasks-per-node=*) shift ;;
        *) break ;;
    esac
done
pids=()
for i in "${!hosts[@]}"; do SLURM_NODEID=$i SLURMD_NODENAME=${hosts[$i]} "$@" & pids+=($!); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
''')
    record = tmp_path / "launch.json"
    _stub(stubs, "accelerate", r'''exec python - "$@" <<'PY'
import json, os, sys
import ray
ray.init(log_to_driver=False)  # RAY_ADDRESS and the job's token: the script's environment
nodes = [sorted(node["Resources"]) for node in ray.nodes() if node["Alive"]]
ray.shutdown()
with open(os.environ["LAUNCH_RECORD"], "w") as out:
    json.dump({"argv": sys.argv[1:], "nodes": nodes, "address": os.environ["RAY_ADDRESS"],
               "auth": os.environ.get("RAY_AUTH_MODE"), "token": os.environ.get("RAY_AUTH_TOKEN_PATH")}, out)
PY
''')
    job, ray_port, main_port = f"t{os.getpid()}", _free_port(), _free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PATH": f"{stubs}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2", "TRAINER_NODES": "1",
           "ACCELERATE_CONFIG": "accelerate_configs/cpu_ddp.yaml", "GPUS_PER_NODE": "0", "NODE_CPUS": "1",
           "RAY_PORT": str(ray_port), "MAIN_PORT": str(main_port), "RAY_START_TIMEOUT": "120",
           "RUN_DIR": str(tmp_path / "run"), "ROLLOUT_WORKERS": "1", "ROLLOUT_WORKER_RESOURCES": SLURM_WORKER_RESOURCES,
           "LAUNCH_RECORD": str(record)}
    # a CPU rollout node: one rollout_node per CPU instead of per GPU
    script = (REPO / "scripts/slurm/flowgrpo_ray.sbatch").read_text().replace(
        '--resources="{\\"rollout_node\\": $GPUS_PER_NODE}"', '--resources="{\\"rollout_node\\": 1}"')
    assert script != (REPO / "scripts/slurm/flowgrpo_ray.sbatch").read_text(), "the rollout node's resource line moved"
    (tmp_path / "job.sbatch").write_text(script)
    train_args = _slurm_train_args(tiny_sd3_path, tmp_path)
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch"), *train_args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    launched = json.loads(record.read_text())
    assert launched["argv"] == _script_launch(train_args, main_port, f"127.0.0.1:{ray_port}")
    # the head (no rollout_node) and the rollout node, both joined with the job's token, kept in its 0700 folder
    assert len(launched["nodes"]) == 2 and sum(ROLLOUT_NODE in n for n in launched["nodes"]) == 1
    assert launched["address"] == f"127.0.0.1:{ray_port}" and launched["auth"] == "token"
    token = Path(launched["token"])
    assert token.parent == tmp_path / "run" and stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o700
    # the nodes were stopped with the job
    leftover = subprocess.run(["pgrep", "-f", f"fgs-{os.getuid()}-{job}"], capture_output=True, text=True).stdout
    assert not leftover.strip()


def test_the_slurm_scripts_trainer_command_trains_two_ranks_with_rollouts_on_the_rollout_node(
        ray_cluster, tiny_sd3_path, tmp_path):
    """The command line the Slurm script runs on its trainer node (`_script_launch`, checked against the script
    above), here joining this module's two-node cluster: ``accelerate launch`` with two CPU processes (gloo) whose one
    rollout worker may only run on the rollout node, one step off, weights over the collective group. Each rank gets
    its own share (its own noise); the worker loads every sync's weights once (process 0 sends them)."""
    rank_logs = tmp_path / "ranks"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "FLOWGRPO_RANK_LOG_DIR": str(rank_logs)}  # the module's token settings
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli",
           *_script_launch(_slurm_train_args(tiny_sd3_path, tmp_path), _free_port(), ray_cluster.address)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    assert "Rollouts on 1 Ray worker(s)" in proc.stdout + proc.stderr
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


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
