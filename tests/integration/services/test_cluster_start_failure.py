"""Issue 32.9: a ``ray start --head`` that fails (here: the dashboard port ``pool deploy`` picked is taken) leaves
no process behind (before: gcs_server and the dashboard's processes kept running, unrecorded, so `pool shutdown
--stop-cluster` could not stop them) and is one line on the console (before: a traceback holding Ray's own), after
the start-up phase's line; Ray's output goes to RUN_DIR/logs/driver.log. The CLI runs as a subprocess, with its
port picker patched so that the dashboard's port is one this test listens on."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[3]
CLI = """
import sys
from services.cluster import head as cluster
real, picks = cluster.free_port, iter([None, int(sys.argv[1])])   # ensure_cluster: GCS, dashboard, agent
cluster.free_port = lambda: next(picks, None) or real()
from services.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _processes_of(token: Path, temp_root: str) -> list[str]:
    """Processes of the head: their environment names its token file, or their command line its temp dir."""
    found = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if temp_root in " ".join(p.info["cmdline"] or []) or \
                    p.environ().get("RAY_AUTH_TOKEN_PATH") == str(token):
                found.append(f"{p.pid} {p.info['name']}")
        except psutil.Error:
            continue
    return found


def test_a_head_that_fails_to_start_leaves_nothing_and_says_why_in_one_line(tmp_path):
    temp_root = tempfile.mkdtemp(prefix="ifh-")  # short: Ray's socket paths live under the head's temp dir
    home, run_dir = tmp_path / "home", tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}, "INFLIGHT_HOME": str(home),
           "TMPDIR": temp_root, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        try:
            out = subprocess.run([sys.executable, "-c", CLI, str(taken.getsockname()[1]), "pool", "deploy",
                                  "--run-dir", str(run_dir)], capture_output=True, text=True, env=env, cwd=ROOT,
                                 timeout=300)
            time.sleep(1.0)
            left = _processes_of(home / "ray_auth_token", temp_root)
        finally:
            for p in psutil.process_iter():  # a failed test must not leave the head running either
                try:
                    if p.environ().get("RAY_AUTH_TOKEN_PATH") == str(home / "ray_auth_token"):
                        p.kill()
                except psutil.Error:
                    continue
            shutil.rmtree(temp_root, ignore_errors=True)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()  # the start-up phase's line, then the error's
    assert len(lines) == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert re.match(r"^\[\s*[\d.]+ s\] starting a Ray head node \(ray start --head\)$", lines[0]), lines[0]
    assert lines[1].startswith("inflight: could not start a Ray head node (`ray start --head` exited 1): ")
    assert "already occupied" in lines[1], lines[1]
    assert left == [], f"processes of the failed head remain: {left}"
    assert not (home / "cluster.json").exists() and not (home / "ray_auth_token").exists()
    assert "Failed to bind" in (run_dir / "logs" / "driver.log").read_text()  # Ray's whole output, filed


WITHOUT_DASHBOARD = """
import json, sys
import ray._private.utils
ray._private.utils.get_dashboard_dependency_error = lambda: ImportError("No module named 'aiohttp_cors'")
from services.cluster import head as cluster
from services.learner_jobs import LearnerJobError, LearnerJobs
address = cluster.ensure_cluster()
try:
    LearnerJobs.connect()
    refused = ""
except LearnerJobError as err:
    refused = str(err)
alive = cluster._alive(address)
print(json.dumps({"address": address, "alive": alive, "refused": refused,
                  "state": json.loads(cluster.state_file().read_text()), "stopped": cluster.stop_cluster()}))
"""


def test_a_head_starts_without_the_dashboard_where_rays_dashboard_packages_are_missing(tmp_path):
    """A minimal Ray (the GPU hosts' bundle: no aiohttp_cors, opencensus...) refused ``ray start --head
    --include-dashboard=true`` ("Cannot include dashboard with missing packages"), so ``pool deploy`` could not
    start a cluster there. The head now starts without it, and the job server's commands say why they cannot run."""
    temp_root = tempfile.mkdtemp(prefix="ifd-")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")},
           "INFLIGHT_HOME": str(tmp_path / "home"), "TMPDIR": temp_root, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(ROOT)}
    try:
        out = subprocess.run([sys.executable, "-c", WITHOUT_DASHBOARD], capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=180)
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["alive"] and got["stopped"], got
    assert got["state"]["dashboard_address"] is None and "aiohttp_cors" in got["state"]["dashboard_missing"], got
    assert got["refused"].startswith(f"the Ray head at {got['address']} runs without its dashboard"), got
    assert "inflight learner attach" in got["refused"], got
    assert "Ray's dashboard cannot run here" in out.stderr, out.stderr[-2000:]
