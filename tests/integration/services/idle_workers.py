"""Run as a script: join (or start) a cluster with ``ray_runtime.connect``, create a detached actor (a worker that
outlives this driver), and print the most Python workers of that cluster seen idle (``ray::IDLE``, children of its
raylet) within WAIT_S seconds while this driver lives (it stops looking at the first one); then, as JSON, the
variables a head node started from this process after it would get for Ray's system config (``ray.init`` fills
the config it is handed). A private cluster it started is stopped and its temporary directory removed.

    python idle_workers.py ADDRESS|local WAIT_S
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time

import psutil
import ray

from services.cluster import ray_runtime


@ray.remote
class Ping:
    def ping(self) -> int:
        return 1


def idle_workers(gcs_address: str) -> list[int]:
    """PIDs of the idle Python workers whose raylet serves the cluster at ``gcs_address``."""
    idle = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "raylet" and gcs_address in " ".join(p.info["cmdline"] or []):
            idle += [c.pid for c in p.children() if c.name() == "ray::IDLE"]
    return idle


if __name__ == "__main__":
    target, wait_s = sys.argv[1], float(sys.argv[2])
    temp_dir = tempfile.mkdtemp(prefix="inflight-ray-") if target == "local" else None
    gcs = ray_runtime.connect(target, temp_dir=temp_dir)
    assert ray.get(Ping.options(name="ping", lifetime="detached").remote().ping.remote()) == 1
    seen, deadline = 0, time.monotonic() + wait_s  # Ray prestarts its workers within seconds of the driver's start
    while not seen and time.monotonic() < deadline:
        time.sleep(0.25)
        seen = len(idle_workers(gcs))
    print(seen)
    print(json.dumps(ray_runtime.system_config_env(ray_runtime.NO_IDLE_WORKERS)))
    ray_runtime.shutdown()
    if temp_dir is not None:  # without a console, ray_runtime keeps a private cluster's directory (its logs)
        shutil.rmtree(temp_dir, ignore_errors=True)
