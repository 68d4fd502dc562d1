"""Reaching a Ray cluster safely: a local one started with token authentication, or an existing one joined through
``ray_address`` / ``RAY_ADDRESS`` (with a warning when it accepts clients without a token).

Whoever reaches a Ray port can run code as the cluster's user, and Ray 2.60's servers listen on every interface even
when asked for 127.0.0.1 (measured here: ``gcs_server`` and ``raylet`` on ``*``, the runtime-env agent on the
machine's address, each worker's and driver's gRPC server on ``*``). So the local cluster the trainer starts uses
Ray's token authentication (``RAY_AUTH_MODE=token``) with a fresh random token per run, written to a file only its
owner can read (``RAY_AUTH_TOKEN_PATH``), and has no dashboard and therefore no Jobs API. A client without the token is
refused at the GCS (``AuthenticationError: InvalidAuthToken``).

`ray_listening_sockets` lists what the cluster's processes listen on (docs/distributed.md has the measured table).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RayConnection", "connect_ray", "probe_tokenless_join", "ray_listening_sockets", "start_local_cluster",
           "write_token_file"]

logger = logging.getLogger(__name__)

#: environment variables of Ray's token authentication
AUTH_MODE, TOKEN_PATH, TOKEN = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"


def _require_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("rollout_backend='ray' (or reward_backend='ray') needs Ray: pip install 'flowgrpo[ray]'.") \
            from None
    return ray


@dataclass
class RayConnection:
    """Where this process is connected: the GCS address, the token file of a cluster this process started (None when
    it joined one), the temporary folder it owns (removed by `close`), and whether it started the cluster."""

    address: str
    token_path: str | None
    started_here: bool
    temp_dir: str | None = None
    namespace: str | None = None

    def close(self) -> None:
        """Stop the cluster this process started (and remove its token and temporary folder); a joined cluster only
        loses this process's connection."""
        ray = _require_ray()
        if ray.is_initialized():
            ray.shutdown()
        if self.started_here and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def ray_is_connected() -> bool:
    """Whether this process is connected to a Ray cluster (Ray imported only if it already was)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def write_token_file(folder: str | os.PathLike) -> str:
    """A fresh random token (256 bits, hex) in ``folder/auth_token``, created with mode 0600 (readable by its owner
    only) before any byte is written."""
    path = Path(folder) / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return str(path)


def enable_token_auth(token_path: str) -> None:
    """Token authentication with ``token_path`` for this process and what it starts (the GCS, the raylet and the
    workers inherit the environment)."""
    os.environ[AUTH_MODE] = "token"
    os.environ[TOKEN_PATH] = token_path
    os.environ.pop(TOKEN, None)  # a token in the environment would take precedence over the run's file
    ray = _require_ray()
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray caches its configuration (the auth mode) per process: read it again
    AuthenticationTokenLoader.instance().reset_cache()
    del ray


def start_local_cluster(*, num_cpus: int | None = None, num_gpus: int | None = None,
                        object_store_memory: int | None = None, namespace: str | None = None,
                        temp_root: str = "/tmp") -> RayConnection:
    """Start a single-node Ray cluster for this run and connect to it: token authentication with a fresh token in an
    owner-only file, no dashboard (so no Jobs API), the session under a short temporary folder (Unix socket paths are
    limited to 107 bytes). ``num_cpus`` / ``num_gpus`` default to what Ray detects."""
    ray = _require_ray()
    temp_dir = tempfile.mkdtemp(prefix="fgr", dir=temp_root)
    os.chmod(temp_dir, 0o700)
    token_path = write_token_file(temp_dir)
    enable_token_auth(token_path)
    # Ray starts its workers at niceness 15 by default: on a busy node a rollout worker then gets a fraction of the
    # CPU the trainer gets (measured here: sampling 3x slower than the same sampling in the trainer's process).
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             object_store_memory=object_store_memory, _temp_dir=temp_dir, namespace=namespace,
             log_to_driver=False, configure_logging=False, _system_config={"worker_niceness": 0})
    address = ray.get_runtime_context().gcs_address
    return RayConnection(address=address, token_path=token_path, started_here=True, temp_dir=temp_dir,
                         namespace=namespace)


#: addresses already probed by `probe_tokenless_join` in this process, and the answer
_PROBED: dict[str, bool] = {}


def probe_tokenless_join(address: str, timeout_s: float = 60.0) -> bool:
    """Whether a client *without* a token can join the cluster at ``address``: a fresh Python process tries
    ``ray.init(address)`` with token authentication disabled and no token anywhere it could read one (about 1.5 s;
    the answer is kept per address for this process)."""
    if address in _PROBED:
        return _PROBED[address]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({AUTH_MODE: "disabled", "RAY_gcs_server_port_wait_time_s": "1", "HOME": tempfile.mkdtemp()})
    code = "import ray, sys\nray.init(address=sys.argv[1], log_to_driver=False)\nprint('joined')"
    try:
        out = subprocess.run([sys.executable, "-c", code, address], env=env, capture_output=True, text=True,
                             timeout=timeout_s)
        joined = out.returncode == 0 and "joined" in out.stdout
    except subprocess.TimeoutExpired:
        joined = False
    finally:
        shutil.rmtree(env["HOME"], ignore_errors=True)
    _PROBED[address] = joined
    return joined


def _warn_if_open(address: str) -> None:
    if probe_tokenless_join(address):
        logger.warning(
            f"The Ray cluster at {address} accepts clients without a token (token authentication is off): whoever "
            "reaches its ports (the GCS, each raylet, each worker's gRPC server, which listen on every interface) can "
            "run code there as the cluster's user, read the weights and the prompts. Start it with token "
            "authentication: `export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<a file only you can read>` on every "
            "node before `ray start` (docs/distributed.md).")


def connect_ray(address: str | None, *, namespace: str | None = None, probe_auth: bool = True) -> RayConnection:
    """This process's connection: the one it already has, or ``address`` (default ``RAY_ADDRESS``) joined, or a new
    local cluster (`start_local_cluster`). Joining an existing cluster warns when it accepts clients without a
    token (``probe_auth``)."""
    ray = _require_ray()
    if ray.is_initialized():
        context = ray.get_runtime_context()
        joined = RayConnection(address=context.gcs_address, token_path=os.environ.get(TOKEN_PATH),
                               started_here=False, namespace=context.namespace)
        if probe_auth:
            _warn_if_open(joined.address)
        return joined
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        return start_local_cluster(namespace=namespace)
    ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    joined = RayConnection(address=ray.get_runtime_context().gcs_address, token_path=os.environ.get(TOKEN_PATH),
                           started_here=False, namespace=namespace)
    if probe_auth:
        _warn_if_open(joined.address)
    return joined


def _cluster_pids(temp_dir: str) -> set[int]:
    """This driver and the processes of the cluster whose session lives under ``temp_dir``: the GCS, the raylet and
    the agents (named by the session folder on their command line), and every process they started (the workers)."""
    import psutil

    roots = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or []):
                roots.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    pids = {os.getpid()}
    for root in roots:
        pids.add(root.pid)
        try:
            pids.update(child.pid for child in root.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    return pids


def ray_listening_sockets(temp_dir: str | None = None) -> list[tuple[str, str, str]]:
    """``(local address:port, process name, pid)`` of the TCP sockets this machine's Ray processes listen on (``ss
    -ltnp``: the processes named ``gcs_server``, ``raylet``, ``ray::...`` and this driver); with ``temp_dir``, only
    those of the cluster whose session lives there (another cluster on the machine is left out). An empty list when
    ``ss`` is missing."""
    if shutil.which("ss") is None:
        return []
    mine = _cluster_pids(temp_dir) if temp_dir else None
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=False).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 6 or "users:" not in line:
            continue
        local = parts[3]
        users = line[line.index("users:"):]
        name = users.split('"')[1] if '"' in users else users
        pid = users.split("pid=")[1].split(",")[0] if "pid=" in users else ""
        if mine is not None:
            if pid.isdigit() and int(pid) in mine:
                rows.append((local, name, pid))
        elif name in ("gcs_server", "raylet") or name.startswith("ray::") or pid == str(os.getpid()):
            rows.append((local, name, pid))
    return rows
