"""A private cluster ``inflight run`` starts (``ray_runtime.connect``) runs no Python worker that nothing uses: Ray
would prestart some for the driver's tasks, and they would idle beside the job while its actors start workers of
their own (docs/testing.md, "Workers nobody uses"). The head node ``inflight pool deploy`` starts is checked in
test_operator_path.py's cluster cycles."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WAIT_S = 5.0


def idle_workers_run(address: str, env: dict[str, str] | None = None,
                     wait_s: float = WAIT_S) -> tuple[int, dict[str, str]]:
    """What ``idle_workers.py`` printed for the cluster at ``address``: the most idle workers it saw while its
    driver ran (for up to ``wait_s``), and the system-config variables a head started after it would get."""
    out = subprocess.run([sys.executable, str(HERE / "idle_workers.py"), address, str(wait_s)], cwd=ROOT,
                         env=env if env is not None else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen, head_env = out.stdout.strip().splitlines()[-2:]
    return int(seen), json.loads(head_env)


def idle_workers_seen(address: str, env: dict[str, str] | None = None, wait_s: float = WAIT_S) -> int:
    return idle_workers_run(address, env, wait_s)[0]


def test_a_private_cluster_starts_no_idle_workers():
    seen, head_env = idle_workers_run("local")
    assert seen == 0
    # ray.init fills the config it is handed (object spilling, ...): a head started later in the same process
    # must still get only this (it got RAY_object_spilling_config=1 and failed to start when Ray filled ours)
    assert head_env == {"RAY_prestart_worker_first_driver": "0"}
