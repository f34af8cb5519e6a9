"""``stop_cluster`` ends the recorded head's whole process tree and nothing else.

The fake "head" is a process that names its temp dir (as gcs_server and the raylet do) and
forks a child whose command line does not (as ``ray::DashboardAgent`` renames itself).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from services.cluster import head as cluster

CHILD = "import time; time.sleep(600)"
HEAD = ("import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {CHILD!r}]); time.sleep(600)")


def _spawn(temp_dir: str) -> psutil.Process:
    proc = subprocess.Popen([sys.executable, "-c", HEAD, f"--temp-dir={temp_dir}"])
    head = psutil.Process(proc.pid)
    deadline = time.monotonic() + 30
    while not head.children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert head.children(), "fake head did not start its child"
    return head


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "inflight"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


def test_stop_cluster_ends_renamed_children_and_spares_other_clusters(home):
    ours, other = str(home / "ray-ours"), str(home / "ray-other")
    head, bystander = _spawn(ours), _spawn(other)
    (child,) = head.children()
    token = home / "inflight" / "ray_auth_token"
    token.parent.mkdir(parents=True)
    token.write_text("t")
    cluster.state_file().write_text(json.dumps({"address": f"127.0.0.1:{cluster.free_port()}", "temp_dir": ours,
                                                "token_path": str(token)}))
    try:
        assert cluster.stop_cluster() is True
        time.sleep(0.2)
        assert not head.is_running() and not child.is_running(), "a process of the stopped head survived"
        assert bystander.is_running() and all(c.is_running() for c in bystander.children())
        assert not cluster.state_file().exists() and not token.exists()
    finally:
        for p in [bystander, *bystander.children(), head, child]:
            try:
                p.kill()
            except psutil.Error:
                pass


def test_stop_cluster_without_state_is_false(home):
    assert cluster.stop_cluster() is False
