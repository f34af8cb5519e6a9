"""Fixtures for the services integration tests: one private local Ray cluster per session, and the data pool.

Another Ray cluster may be running on the machine, so the cluster is always a
fresh local one (``address="local"``) with its own temp dir, no dashboard and a
small object store; it is shut down when the session ends.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

OBJECT_STORE_BYTES = 384 * 1024 * 1024


@pytest.fixture(scope="session")
def ray_cluster():
    """Start a private local Ray (namespace ``inflight``) once; yields its GCS address."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        raise RuntimeError("ray_cluster: Ray is already initialized in this process; refusing to share it")
    temp_dir = tempfile.mkdtemp(prefix="inflight-test-ray-")
    ray.init(address="local", _temp_dir=temp_dir, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
             namespace="inflight", log_to_driver=True)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def data_pool(ray_cluster, tmp_path_factory):
    """A deployed pool scoring with ``env.math`` (tests/integration/services/data_pool.py); yields its recipe.
    It answers at route prefix "/" and stays up from its first test to the end of the session; every other pool
    deployed on the session's cluster takes its own ``rollout_pool.route_prefix``, so tests run in file order."""
    from services import pool as pool_api
    from services.app import deploy_pool

    from data_pool import data_recipe

    recipe = data_recipe()
    deployed = deploy_pool(recipe, tmp_path_factory.mktemp("data-pool"))
    assert deployed.status.ready, deployed
    yield recipe
    pool_api.shutdown(recipe.rollout_pool.name)
