"""Reaching a Ray cluster safely: a local one started with token authentication in a private folder, or an existing
one joined through ``ray_address`` / ``RAY_ADDRESS`` (with a warning when it accepts clients without a token).

Whoever reaches a Ray port can run code as the cluster's user, and Ray 2.60's servers listen on every interface even
when asked for 127.0.0.1 (measured here: ``gcs_server`` and ``raylet`` on ``*``, the runtime-env agent on the
machine's address, each worker's and driver's gRPC server on ``*``). So the local cluster the trainer starts uses
Ray's token authentication (``RAY_AUTH_MODE=token``) with a fresh random token per run, written to a file only its
owner can read (``RAY_AUTH_TOKEN_PATH``), and has no dashboard and therefore no Jobs API. A client without the token is
refused at the GCS (``AuthenticationError: InvalidAuthToken``).

**The run's folder.** Ray makes every folder it creates world-writable (``try_to_create_directory`` in
``ray/_common/utils.py`` sets 0777 on its temporary folder, the session, its sockets and logs), whatever mode the
folder had. So the run gets a folder of its own, created 0700 (``tempfile.mkdtemp``), holding the token file and
Ray's temporary folder (``r/``): Ray's folders inside are 0777, but no other user can reach them through ours, the
session's Unix sockets included.

**Time limits.** The nodes are started by ``ray start --block`` processes of this one (a head, and optionally more
raylets on the same machine, e.g. one carrying a custom resource), each waited for with a deadline: a raylet that
aborts while starting (under heavy load, in ``WaitForDashboardAgentPorts``) or a start that never reports makes
`start_local_cluster` fail with `RayStartError`, naming what it waited for and the end of that node's log, instead of
hanging. The node processes die with this process (``PR_SET_PDEATHSIG``) and with `RayConnection.close`.

`ray_listening_sockets` lists what the cluster's processes listen on (docs/distributed.md has the measured table).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RAY_SUBFOLDER", "RayConnection", "RayStartError", "connect_ray", "probe_tokenless_join",
           "ray_listening_sockets", "start_local_cluster", "write_token_file"]

logger = logging.getLogger(__name__)

#: environment variables of Ray's token authentication
AUTH_MODE, TOKEN_PATH, TOKEN = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"
#: Ray's temporary folder inside the run's private folder (short: Unix socket paths are limited to 107 bytes)
RAY_SUBFOLDER = "r"
#: what ``ray start`` prints once a node's processes are up
STARTED = "Ray runtime started."
#: the longest wait for a local cluster's nodes by default (the configuration's ``ray_start_timeout_s``)
DEFAULT_START_TIMEOUT_S = 120.0


def _require_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("rollout_backend='ray' (or reward_backend='ray') needs Ray: pip install 'flowgrpo[ray]'.") \
            from None
    return ray


class RayStartError(RuntimeError):
    """A Ray node did not start within its time limit, or exited while starting; the message names the node, what was
    waited for and the end of its log."""


@dataclass
class RayConnection:
    """Where this process is connected: the GCS address, the token file of a cluster this process started (None when
    it joined one), the run's private folder it owns (removed by `close`), whether it started the cluster, and the
    ``ray start`` processes of the nodes it started (the head first)."""

    address: str
    token_path: str | None
    started_here: bool
    temp_dir: str | None = None
    namespace: str | None = None
    nodes: list = field(default_factory=list)

    @property
    def ray_dir(self) -> str | None:
        """Ray's temporary folder (sessions, sockets, logs), inside the private folder."""
        return os.path.join(self.temp_dir, RAY_SUBFOLDER) if self.temp_dir else None

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the cluster this process started (its nodes, the others first, then the head) and remove its private
        folder; a joined cluster only loses this process's connection."""
        ray = _require_ray()
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(self.nodes):
            node.stop(timeout_s)
        self.nodes = []
        if self.started_here and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


class _LocalNode:
    """One ``ray start --block`` process (a head or a raylet joining it), its log in the private folder."""

    def __init__(self, what: str, command: list[str], env: dict[str, str], log_path: str):
        self.what, self.log_path = what, log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:]).rstrip() or "(nothing yet)"
        except OSError:
            return "(no log)"

    def wait_started(self, deadline: float, timeout_s: float) -> None:
        """Wait until ``ray start`` reports the node up (``Ray runtime started.``); `RayStartError` when it exits first
        or the deadline passes (the node is then stopped)."""
        while True:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                if STARTED in f.read():
                    return
            code = self.process.poll()
            if code is not None:
                raise RayStartError(f"{self.what} exited with code {code} while starting (waited for `ray start` to "
                                    f"report {STARTED!r}). Its log ({self.log_path}) ends with:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop(5.0)
                raise RayStartError(f"{self.what} did not start within ray_start_timeout_s={timeout_s:g} s (waited for "
                                    f"`ray start` to report {STARTED!r}; a machine under heavy load can need longer: "
                                    f"raise ray_start_timeout_s). Its log ends with:\n{tail}")
            time.sleep(0.1)

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to the node's process group (``ray start --block`` stops the processes it started), SIGKILL after
        ``timeout_s``."""
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        self._log.close()


def _die_with_parent() -> None:
    """In the child, before ``exec``: receive SIGTERM when the process that started it dies (Linux), so that a node
    never outlives its trainer."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
                        temp_root: str = "/tmp", timeout_s: float = DEFAULT_START_TIMEOUT_S,
                        extra_nodes: list[dict] | tuple = ()) -> RayConnection:
    """Start a Ray cluster on this machine for this run and connect to it (see the module docstring): token
    authentication with a fresh token in an owner-only file, no dashboard (so no Jobs API), everything in a private
    0700 folder under ``temp_root``, workers at normal priority. ``num_cpus`` / ``num_gpus`` default to what Ray
    detects. ``extra_nodes``: more raylets on this machine joining the head, each a mapping of ``num_cpus``,
    ``num_gpus``, ``resources`` (custom resources, e.g. ``{"rollout_node": 1}``) and ``object_store_memory``. Every
    node must be up within ``timeout_s`` (`RayStartError` otherwise; nothing is left running)."""
    ray = _require_ray()
    folder = tempfile.mkdtemp(prefix="fgr", dir=temp_root)  # created 0700
    os.chmod(folder, 0o700)
    token_path = write_token_file(folder)
    enable_token_auth(token_path)
    ray_dir = os.path.join(folder, RAY_SUBFOLDER)
    env = {k: v for k, v in os.environ.items() if k != TOKEN}
    # Ray starts its workers at niceness 15 by default: on a busy node a rollout worker then gets a fraction of the
    # CPU the trainer gets (measured here: sampling 3x slower than the same sampling in the trainer's process). A
    # raylet waits for its agents for as long as this start may take (under heavy load they report late). The run's
    # own cluster has nothing to drain when it stops (Ray's default waits up to 30 s per node).
    env.update({AUTH_MODE: "token", TOKEN_PATH: token_path, "RAY_worker_niceness": "0",
                "RAY_agent_register_timeout_ms": str(int(timeout_s * 1000)),
                "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"})
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    if not os.path.isfile(ray_cli):
        ray_cli = shutil.which("ray") or ray_cli
    common = [f"--temp-dir={ray_dir}", "--disable-usage-stats", "--block"]
    connection = RayConnection(address="", token_path=token_path, started_here=True, temp_dir=folder,
                               namespace=namespace)
    deadline = time.monotonic() + timeout_s
    try:
        port = _free_port()
        head = [ray_cli, "start", "--head", f"--port={port}", "--include-dashboard=false", *common, *_node_options(
            {"num_cpus": num_cpus, "num_gpus": num_gpus, "object_store_memory": object_store_memory})]
        connection.nodes.append(_LocalNode("The Ray head node (GCS and raylet)", head, env,
                                           os.path.join(folder, "head.log")))
        connection.nodes[0].wait_started(deadline, timeout_s)
        for i, options in enumerate(extra_nodes):
            command = [ray_cli, "start", f"--address=127.0.0.1:{port}", *common, *_node_options(options)]
            node = _LocalNode(f"Ray node {i + 1} (a raylet joining the head, {dict(options)})", command, env,
                              os.path.join(folder, f"node{i + 1}.log"))
            connection.nodes.append(node)
            node.wait_started(deadline, timeout_s)
        _bounded_connect(ray, f"127.0.0.1:{port}", namespace, deadline, timeout_s, connection)
        connection.address = ray.get_runtime_context().gcs_address
        if extra_nodes:
            _wait_for_nodes(ray, 1 + len(extra_nodes), deadline, timeout_s)
    except BaseException:
        connection.close()
        raise
    return connection


def _node_options(options: dict) -> list[str]:
    """``ray start`` flags of a node's resources (unset ones left to Ray)."""
    unknown = sorted(set(options) - {"num_cpus", "num_gpus", "resources", "object_store_memory"})
    if unknown:
        raise ValueError(f"A local Ray node takes num_cpus, num_gpus, resources and object_store_memory, not {unknown}.")
    flags = []
    for key in ("num_cpus", "num_gpus", "object_store_memory"):
        if options.get(key) is not None:
            flags.append(f"--{key.replace('_', '-')}={int(options[key])}")
    if options.get("resources"):
        flags.append(f"--resources={json.dumps(dict(options['resources']))}")
    return flags


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _bounded_connect(ray, address: str, namespace: str | None, deadline: float, timeout_s: float,
                     connection: RayConnection) -> None:
    """``ray.init`` to the cluster just started, watched: past the deadline its nodes are stopped (so the call fails
    instead of waiting) and `RayStartError` says so."""
    import threading

    expired = threading.Event()

    def watch() -> None:
        if not done.wait(max(0.0, deadline - time.monotonic())):
            expired.set()
            for node in reversed(connection.nodes):
                node.stop(5.0)

    done = threading.Event()
    watchdog = threading.Thread(target=watch, name="flowgrpo-ray-start-watchdog", daemon=True)
    watchdog.start()
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)
    except Exception as err:
        if expired.is_set():
            raise RayStartError(f"Connecting to the local Ray cluster at {address} did not finish within "
                                f"ray_start_timeout_s={timeout_s:g} s; its nodes were stopped.") from err
        raise
    finally:
        done.set()
    if expired.is_set():
        raise RayStartError(f"Connecting to the local Ray cluster at {address} did not finish within "
                            f"ray_start_timeout_s={timeout_s:g} s; its nodes were stopped.")


def _wait_for_nodes(ray, count: int, deadline: float, timeout_s: float) -> None:
    """Until the GCS lists ``count`` live nodes (a joined raylet registers a moment after ``ray start`` returns)."""
    while True:
        alive = sum(1 for node in ray.nodes() if node.get("Alive"))
        if alive >= count:
            return
        if time.monotonic() > deadline:
            raise RayStartError(f"The local Ray cluster lists {alive} live node(s), not {count}, after "
                                f"ray_start_timeout_s={timeout_s:g} s.")
        time.sleep(0.1)


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


def connect_ray(address: str | None, *, namespace: str | None = None, probe_auth: bool = True,
                start_timeout_s: float = DEFAULT_START_TIMEOUT_S) -> RayConnection:
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
        return start_local_cluster(namespace=namespace, timeout_s=start_timeout_s)
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
