"""Finding and stopping every process of one Ray head node, and only those.

``ray stop`` ends every Ray process on the machine (other clusters too), and matching command
lines by the node's temp dir misses the processes that rename themselves (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``, ``ray::IDLE`` workers and the vLLM processes under them). A head node
is its root processes (recorded PIDs, plus any process whose command line names its temp dir or
its GCS port) and all their descendants, collected before anything is signalled: once the
raylet is gone its children are re-parented and can no longer be told apart.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import psutil

GRACE_S = 2.0
"""SIGTERM first; what is still alive after this is killed. On 2 busy cores the processes that honour SIGTERM (the
dashboard's, workers, the dashboard agent) were gone within 1.6 s; gcs_server, the raylet, the runtime-env agent
and the monitor never are (gcs_server ignored it for > 15 s), so a longer grace only waits for the kill (it was 5 s,
two thirds of a head's stop). The node's temp dir, logs included, is removed right after."""


def root_pids(temp_dir: str, gcs_port: int | None = None) -> list[int]:
    """Processes whose command line names ``temp_dir`` (gcs_server, raylet, monitors) or the GCS port
    (the Ray client server names only ``--address=IP:PORT``)."""
    port_arg = re.compile(rf"address=\S*:{gcs_port}$") if gcs_port else None
    temp_dir = temp_dir.rstrip("/")
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        args = p.info["cmdline"] or []
        names_temp = any(a == temp_dir or a.endswith("=" + temp_dir) or temp_dir + "/" in a for a in args)
        if names_temp or (port_arg and any(port_arg.search(a) for a in args)):
            out.append(p.info["pid"])
    return out


def recorded(pids: dict[str, float]) -> list[int]:
    """The PIDs of ``{pid: create_time}`` that still name the same process (not a reused PID)."""
    out = []
    for pid, created in pids.items():
        try:
            if abs(psutil.Process(int(pid)).create_time() - created) < 1e-3:
                out.append(int(pid))
        except psutil.Error:
            continue
    return out


def snapshot(pids: Iterable[int]) -> dict[str, float]:
    """``{pid: create_time}`` of the live ``pids``, to record."""
    out = {}
    for pid in pids:
        try:
            out[str(pid)] = psutil.Process(pid).create_time()
        except psutil.Error:
            continue
    return out


def process_tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The live processes among ``pids`` and all their descendants, never this process or its ancestors."""
    me = psutil.Process()
    spared = {me.pid} | {p.pid for p in me.parents()}
    found: dict[int, psutil.Process] = {}
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                found.setdefault(p.pid, p)
        except psutil.Error:
            continue
    return [p for pid, p in found.items() if pid not in spared]


def stop_tree(roots: Iterable[int], grace_s: float = GRACE_S) -> list[psutil.Process]:
    """Stop ``roots`` and all their descendants; returns the processes that survived even SIGKILL.

    The tree is frozen (SIGSTOP) and collected again before anything is terminated, so that a worker the
    raylet starts meanwhile is not missed; SIGTERM is delivered on SIGCONT.
    """
    roots = list(roots)
    procs = process_tree(roots)
    _signal(procs, "suspend")
    procs = process_tree(roots + [p.pid for p in procs])
    _signal(procs, "suspend")
    _signal(procs, "terminate")
    _signal(procs, "resume")
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    _signal(alive, "kill")
    _, alive = psutil.wait_procs(alive, timeout=5)
    return alive


def _signal(procs: list[psutil.Process], action: str) -> None:
    for p in procs:
        try:
            getattr(p, action)()
        except psutil.Error:
            pass


def describe(procs: list[psutil.Process]) -> str:
    """``pid name`` for each process, for an error message."""
    names = []
    for p in procs:
        try:
            names.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            names.append(str(p.pid))
    return ", ".join(names)

