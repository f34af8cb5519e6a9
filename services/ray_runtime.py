"""Joining or starting the Ray cluster that hosts the pool and the learner.

``connect()`` attaches to ``RAY_ADDRESS`` (or an explicit address) when one is
given (with the token of the head ``inflight pool deploy`` started when it is that
head, and after one check that the GCS accepts this client: ``cluster_auth``),
otherwise it starts a private local cluster: its own temp dir (another
Ray cluster may be running on the machine), no dashboard and a small object
store (measured: ~500 MiB instead of ~750 MiB). Everything Inflight creates
lives in the ``inflight`` namespace so that named actors can be found again.
"""
from __future__ import annotations

import os
import tempfile

NAMESPACE = "inflight"
OBJECT_STORE_BYTES = int(os.environ.get("INFLIGHT_OBJECT_STORE_MB", "512")) * 1024 * 1024
"""Object store of a private local cluster (``INFLIGHT_OBJECT_STORE_MB``; weight pushes of GB-size
models through the store need more than the CPU default)."""


def connect(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None) -> str:
    """Connect to (or start) Ray; returns the cluster address. Idempotent."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address
    if address != "local":
        address = address or os.environ.get("RAY_ADDRESS") or None
    if address and address != "local":
        from services import cluster, cluster_auth

        token_path = cluster.token_for(address)
        if token_path is not None:
            cluster_auth.use_token(token_path)
        if ":" in address and "://" not in address:       # a GCS host:port (not "auto" or a ray:// client)
            cluster_auth.check_gcs(address, cluster_auth.client_token())
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
    else:
        temp_dir = temp_dir or tempfile.mkdtemp(prefix="inflight-ray-")
        ray.init(address="local", namespace=NAMESPACE, num_cpus=num_cpus, include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, _temp_dir=temp_dir, log_to_driver=True)
    return ray.get_runtime_context().gcs_address


def shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
