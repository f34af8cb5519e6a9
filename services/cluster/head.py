"""A persistent local Ray cluster for ``inflight pool deploy`` without ``RAY_ADDRESS``.

A pool must outlive the command that deployed it, so it cannot live in a
driver-scoped local cluster. When no cluster is given, ``ensure_cluster``
starts a head node (``ray start --head``) with its own temp dir, token
authentication on (its token in INFLIGHT_HOME, see ``cluster_auth``) and its dashboard
on a free port of 127.0.0.1 (Ray's job server: ``inflight learner submit``), and records
it in ``INFLIGHT_HOME/cluster.json`` (default ``~/.inflight``); later commands
find it there, and ``stop_cluster`` ends exactly that node's processes. A ``ray start --head`` that fails
leaves nothing: the processes it had started are stopped and the error is one line (``ClusterStartError``).
Where Ray's dashboard cannot run (a minimal Ray without its packages) the head starts without it, and only the
commands that need Ray's job server refuse, saying why.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from services.cluster import auth as cluster_auth
from services.cluster import procs as cluster_procs
from services.cluster.auth import ClusterConnectError
from services.cluster.ray_runtime import NO_IDLE_WORKERS, system_config_env
from services.console import progress as startup_progress

log = logging.getLogger("inflight.cluster")


def state_dir() -> Path:
    """Inflight's state directory: ``INFLIGHT_HOME``, default ``~/.inflight``."""
    return Path(os.environ.get("INFLIGHT_HOME") or Path.home() / ".inflight").expanduser()


def state_file() -> Path:
    return state_dir() / "cluster.json"


def _state() -> dict | None:
    path = state_file()
    return json.loads(path.read_text()) if path.exists() else None


def known_address() -> str | None:
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    state = _state()
    return state["address"] if state else None


def _recorded(address: str, key: str) -> str | None:
    """``key`` of the head ``ensure_cluster`` recorded, when ``address`` is that head and the key is set."""
    state = _state()
    if state and state.get(key) and _same_endpoint(address, state["address"]):
        return state[key]
    return None


def dashboard_address(address: str) -> str | None:
    """The job server (dashboard) URL of the head ``ensure_cluster`` started, when ``address`` is that head."""
    return _recorded(address, "dashboard_address")


def dashboard_missing(address: str) -> str | None:
    """Why the head ``ensure_cluster`` started runs without Ray's dashboard (its packages are missing), when
    ``address`` is that head and it does; else None."""
    return _recorded(address, "dashboard_missing")


def ray_command() -> str:
    """Ray's ``ray`` command: beside this Python's interpreter (a virtual environment), else on ``PATH`` (Ray
    installed with ``pip --target``, as on the GPU hosts)."""
    beside = Path(sys.executable).with_name("ray")
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise ClusterStartError(f"could not start a Ray head node: Ray's `ray` command is neither beside "
                                f"{sys.executable} nor on PATH")
    return found


def dashboard_error() -> str | None:
    """Why Ray's dashboard cannot start in this Python (its packages are missing); None when it can."""
    from ray._private.utils import get_dashboard_dependency_error

    error = get_dashboard_dependency_error()
    return f"{type(error).__name__}: {error}" if error else None


def token_for(address: str) -> Path | None:
    """The token file of the head ``ensure_cluster`` started, when ``address`` is that head."""
    path = _recorded(address, "token_path")
    return Path(path) if path else None


def ensure_cluster(timeout_s: float = 120.0) -> str:
    """``RAY_ADDRESS`` if set, else the recorded head if it answers, else a new head node."""
    addr = known_address()
    if addr and (os.environ.get("RAY_ADDRESS") or _alive(addr)):
        return addr
    ray, no_dashboard = ray_command(), dashboard_error()  # before anything is made: a missing `ray` leaves nothing
    temp = tempfile.mkdtemp(prefix="inflight-ray-")
    port, dashboard_port, agent_port = free_port(), free_port(), free_port()
    token = cluster_auth.write_token(state_dir())
    # The dashboard hosts Ray's job server (`inflight learner submit`); its agent gets a free port too (the
    # default 52365 would collide with another head on this machine, and jobs go through that agent).
    dashboard = [f"--include-dashboard={'false' if no_dashboard else 'true'}", "--dashboard-host=127.0.0.1",
                 f"--dashboard-port={dashboard_port}", f"--dashboard-agent-listen-port={agent_port}"]
    if no_dashboard:
        log.warning("Ray's dashboard cannot run here (%s): the head starts without it, so `inflight learner "
                    "submit|status|logs|stop` (Ray's job server) are unavailable; `learner attach` works", no_dashboard)
    cmd = [ray, "start", "--head", f"--port={port}", f"--temp-dir={temp}", *dashboard,
           "--disable-usage-stats", f"--object-store-memory={512 * 1024 * 1024}"]
    try:
        with startup_progress.phase("starting a Ray head node (ray start --head)"):
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                 env=cluster_auth.head_env(token) | system_config_env(NO_IDLE_WORKERS))
        failed = f"exited {out.returncode}" if out.returncode != 0 else ""
        output = f"{out.stdout}\n{out.stderr}"
    except subprocess.TimeoutExpired as err:
        failed, output = f"did not finish in {timeout_s:g} s", f"{err.stdout or ''}\n{err.stderr or ''}"
    if failed:
        _remove_failed_head(temp, port, token, output)
        raise ClusterStartError(f"could not start a Ray head node (`ray start --head` {failed}): "
                                f"{_last_line(output)}")
    addr = f"127.0.0.1:{port}"
    state = {"address": addr, "dashboard_address": None if no_dashboard else f"http://127.0.0.1:{dashboard_port}",
             "dashboard_missing": no_dashboard, "temp_dir": temp, "auth_mode": "token", "token_path": str(token),
             "head_pids": cluster_procs.snapshot(cluster_procs.root_pids(temp, port))}
    state_file().write_text(json.dumps(state, indent=1))
    return addr


class ClusterStartError(ClusterConnectError):
    """``ray start --head`` failed; what it had started was stopped (one line; the CLI exits 2)."""


def _remove_failed_head(temp: str, port: int, token: Path, output: str) -> None:
    """After a failed ``ray start --head``: stop every process it left (gcs_server, dashboard, monitor...),
    remove its temp dir and token; its whole output goes to the log (driver.log under the CLI), not the console."""
    log.error("`ray start --head` failed; its output:\n%s", output, extra={"file_only": True})
    alive = cluster_procs.stop_tree(cluster_procs.root_pids(temp, port))
    token.unlink(missing_ok=True)
    shutil.rmtree(temp, ignore_errors=True)
    if alive:
        raise ClusterStartError(f"could not start a Ray head node, and could not stop the processes it left "
                                f"{cluster_procs.describe(alive)}: {_last_line(output)}")


def _last_line(output: str) -> str:
    """The last non-empty line of a command's output (a Python traceback's last line is its error)."""
    lines = [ln.strip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def stop_cluster() -> bool:
    """Stop the head node that ``ensure_cluster`` started: its recorded and matching root processes and
    every descendant (other Ray clusters on the machine are left alone). False when none is recorded."""
    state = _state()
    if state is None:
        return False
    port = int(state["address"].rpartition(":")[2])
    roots = set(cluster_procs.recorded(state.get("head_pids", {})))
    roots |= set(cluster_procs.root_pids(state["temp_dir"], port))
    alive = cluster_procs.stop_tree(roots)
    if alive:
        raise RuntimeError(f"cluster: could not stop the Ray head's processes {cluster_procs.describe(alive)}")
    state_file().unlink()
    if state.get("token_path"):
        Path(state["token_path"]).unlink(missing_ok=True)
    shutil.rmtree(state["temp_dir"], ignore_errors=True)
    return True


def _same_endpoint(a: str, b: str) -> bool:
    """Whether two ``host:port`` addresses name the same endpoint of this machine (127.0.0.1 vs the node IP)."""
    (ha, _, pa), (hb, _, pb) = a.rpartition(":"), b.rpartition(":")
    if pa != pb:
        return False
    return ha == hb or (_is_local(ha) and _is_local(hb))


def _is_local(host: str) -> bool:
    import socket

    import psutil

    if host in ("", "localhost", "0.0.0.0") or host.startswith("127."):
        return True
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    try:
        return host in local or socket.gethostbyname(host) in local
    except OSError:
        return False


def _alive(addr: str) -> bool:
    import socket

    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def free_port() -> int:
    """A TCP port that is free on this host now (for a rendezvous, a store or an HTTP proxy)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
