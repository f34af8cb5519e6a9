"""A persistent local Ray cluster for ``inflight pool deploy`` without ``RAY_ADDRESS``.

A pool must outlive the command that deployed it, so it cannot live in a
driver-scoped local cluster. When no cluster is given, ``ensure_cluster``
starts a head node (``ray start --head``) with its own temp dir and records
its address in ``~/.inflight/cluster.json``; later commands find it there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

STATE = Path(os.environ.get("INFLIGHT_HOME", Path.home() / ".inflight")) / "cluster.json"


def known_address() -> str | None:
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    if STATE.exists():
        return json.loads(STATE.read_text())["address"]
    return None


def ensure_cluster(timeout_s: float = 120.0) -> str:
    addr = known_address()
    if addr and _alive(addr):
        return addr
    temp = tempfile.mkdtemp(prefix="inflight-ray-")
    port = free_port()
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", f"--port={port}", f"--temp-dir={temp}",
           "--include-dashboard=false", "--disable-usage-stats", f"--object-store-memory={512 * 1024 * 1024}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"could not start a Ray head node: {out.stderr.strip()[-500:]}")
    addr = f"127.0.0.1:{port}"
    STATE.parent.mkdir(parents=True, exist_ok=True)
    STATE.write_text(json.dumps({"address": addr, "temp_dir": temp}))
    return addr


def stop_cluster() -> bool:
    """Stop the head node that ``ensure_cluster`` started (only its processes: other Ray clusters on the
    machine are left alone)."""
    import psutil

    if not STATE.exists():
        return False
    temp = json.loads(STATE.read_text())["temp_dir"]
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp in arg for arg in (p.info["cmdline"] or [])):
                procs.append(p)
        except psutil.Error:
            continue
    for p in procs:
        p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        p.kill()
    STATE.unlink()
    return True


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
