"""A private cluster ``inflight run`` starts (``ray_runtime.connect``) runs no Python worker that nothing uses: Ray
would prestart some for the driver's tasks, and they would idle beside the job while its actors start workers of
their own (docs/testing.md, "Workers nobody uses"). The head node ``inflight pool deploy`` starts is checked in
test_operator_path.py's cluster cycles."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WAIT_S = 5.0


def idle_workers_seen(address: str, env: dict[str, str] | None = None) -> int:
    """The most idle workers ``idle_workers.py`` saw on the cluster at ``address`` while its driver ran."""
    out = subprocess.run([sys.executable, str(HERE / "idle_workers.py"), address, str(WAIT_S)], cwd=ROOT,
                         env=env if env is not None else {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.strip().splitlines()[-1])


def test_a_private_cluster_starts_no_idle_workers():
    assert idle_workers_seen("local") == 0
