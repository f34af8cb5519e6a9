"""Joining or starting the Ray cluster that hosts the pool and the learner.

``connect()`` attaches to ``RAY_ADDRESS`` (or an explicit address) when one is
given (with the token of the head ``inflight pool deploy`` started when it is that
head, and after one check that the GCS accepts this client: ``cluster_auth``),
otherwise it starts a private local cluster: its own temp dir (another
Ray cluster may be running on the machine), no dashboard, a small object
store (measured: ~500 MiB instead of ~750 MiB) and no prestarted idle workers
(:data:`NO_IDLE_WORKERS`, also set on the head ``inflight pool deploy`` starts). Everything Inflight creates
lives in the ``inflight`` namespace so that named actors can be found again.

Every actor of the job runs :func:`services.console.output.setup_worker`, and with a console set up
(:func:`services.console.output.setup`) the driver prints the actors' lines it keeps and RUN_DIR/logs/ray
shows the session's logs: linked while the cluster runs, copied when a private cluster stops (its
temporary directory is then removed). Those of a cluster on another machine stay on its nodes.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from services.console import output as console

NAMESPACE = "inflight"
OBJECT_STORE_BYTES = int(os.environ.get("INFLIGHT_OBJECT_STORE_MB", "512")) * 1024 * 1024
"""Object store of a private local cluster (``INFLIGHT_OBJECT_STORE_MB``; weight pushes of GB-size
models through the store need more than the CPU default)."""
NO_IDLE_WORKERS: Mapping[str, bool] = MappingProxyType({"prestart_worker_first_driver": False})
"""Ray's system config for a cluster Inflight starts: no idle Python workers started when the first driver
connects. Ray starts them for the driver's own tasks (two on this 2-core machine: 160 MiB and ~1 CPU second to
start, then 0.6 CPU seconds a minute each); nothing of Inflight's used them in an ``inflight run`` or in the
tests' drivers, and actors start workers of their own (docs/testing.md, "Workers nobody uses"). Read-only: hand
``ray.init`` a copy, which it fills with the session's own settings (object spilling and more)."""
_private_temp_dir: Path | None = None
"""The temporary directory of the private cluster :func:`connect` started and :func:`shutdown` removes."""


def system_config_env(config: Mapping[str, bool]) -> dict[str, str]:
    """Ray's system config as the ``RAY_<key>`` variables the processes of a ``ray start`` node read."""
    return {f"RAY_{key}": "1" if value else "0" for key, value in config.items()}


def connect(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None) -> str:
    """Connect to (or start) Ray; returns the cluster address. Idempotent."""
    import ray

    global _private_temp_dir
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    if address != "local":
        address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":
        from services.cluster import auth as cluster_auth
        from services.cluster import head as cluster
        token_path = cluster.token_for(address)
        if token_path is not None:
            cluster_auth.use_token(token_path)
        if ":" in address and "://" not in address:       # a GCS host:port (not "auto" or a ray:// client)
            cluster_auth.check_gcs(address, cluster_auth.client_token())
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True, runtime_env=console.runtime_env())
        logs = _recorded_head_logs(address)
    else:
        owned = temp_dir is None
        temp_dir = temp_dir or tempfile.mkdtemp(prefix="inflight-ray-")
        ray.init(address="local", namespace=NAMESPACE, num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, _temp_dir=temp_dir, log_to_driver=True,
                 runtime_env=console.runtime_env(), _system_config=dict(NO_IDLE_WORKERS))
        _private_temp_dir = Path(temp_dir) if owned else None
        logs = Path(temp_dir) / "session_latest" / "logs"
    console.forward_actor_lines()
    if logs is not None and logs.is_dir():
        console.link_ray_logs(logs)
    return ray.get_runtime_context().gcs_address


def _recorded_head_logs(address: str) -> Path | None:
    """The session logs of the head ``inflight pool deploy`` started on this machine, when ``address`` is it."""
    from services.cluster import head as cluster

    if cluster.token_for(address) is None:
        return None
    temp_dir = json.loads(cluster.state_file().read_text()).get("temp_dir")
    return Path(temp_dir) / "session_latest" / "logs" if temp_dir else None


def shutdown() -> None:
    """Disconnect (a private cluster stops). With a console, a private cluster's logs are copied into
    RUN_DIR/logs/ray and its temporary directory is removed."""
    import ray

    global _private_temp_dir
    if ray.is_initialized():
        ray.shutdown()
    if _private_temp_dir is not None and console.active() is not None:
        console.keep_ray_logs()
        shutil.rmtree(_private_temp_dir, ignore_errors=True)
    _private_temp_dir = None
