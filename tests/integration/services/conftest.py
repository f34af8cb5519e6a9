"""Fixtures for the services integration tests: one private local Ray cluster per session, the data pool and the
OpenAI-serving pool (each shut down after the last test that uses it, :func:`pytest_runtest_teardown`).

Another Ray cluster may be running on the machine, so the cluster is always a
fresh local one (``address="local"``) with its own temp dir, no dashboard and a
small object store; it is shut down when the session ends.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

import pytest

OBJECT_STORE_BYTES = 384 * 1024 * 1024
_RUNNING_POOLS: dict[str, Callable[[], None]] = {}
"""The shutdown of each session pool while it runs, by the name of its fixture."""
_SHUT_POOLS: set[str] = set()
"""Session pools shut down after their last test: a test that asks for one fails at set-up, saying so."""


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After a session pool's last test: shut the pool down. Every module that uses the pool's fixture is in
    the pool's xdist group, which runs in one piece on one worker (tests/integration/conftest.py), so the pool
    is done once the next test is of another group, or there is none. (An idle pool, Serve's replica and vLLM's
    engine with its front, costs about 3 CPU seconds a minute.) A pool whose users are not all in its group is
    left to the session's end."""
    for name in list(_RUNNING_POOLS):
        stack = f"stack-{name}"
        if {_group(i) for i in item.session.items if name in i.fixturenames} != {stack}:
            continue
        if nextitem is None or _group(nextitem) != stack:
            _SHUT_POOLS.add(name)
            _RUNNING_POOLS.pop(name)()


def _group(item) -> str | None:
    """The ``xdist_group`` tests/integration/conftest.py gave ``item``'s module."""
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark is not None and mark.args else None


def pytest_runtest_setup(item):
    if used := _SHUT_POOLS.intersection(item.fixturenames):
        raise RuntimeError(f"the session's {sorted(used)} pool was shut down after the last test that used it "
                           f"(tests/integration/services/conftest.py); run the tests that use it one after another")


def _running_pool(fixture: str, value, shutdown: Callable[[], None]):
    """Yield ``value`` (what the fixture gives its tests) with ``shutdown`` registered for
    :func:`pytest_runtest_teardown`; call it at the session's end if that hook did not."""
    _RUNNING_POOLS[fixture] = shutdown
    try:
        yield value
    finally:
        if _RUNNING_POOLS.pop(fixture, None) is not None:
            shutdown()


@pytest.fixture(scope="session")
def ray_cluster():
    """Start a private local Ray (namespace ``inflight``) once; yields its GCS address."""
    import ray

    from services.cluster.ray_runtime import NO_IDLE_WORKERS

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        raise RuntimeError("ray_cluster: Ray is already initialized in this process; refusing to share it")
    temp_dir = tempfile.mkdtemp(prefix="inflight-test-ray-")
    ray.init(address="local", _temp_dir=temp_dir, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
             namespace="inflight", log_to_driver=True, _system_config=dict(NO_IDLE_WORKERS))
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def data_pool(ray_cluster, tmp_path_factory):
    """A deployed pool scoring with ``env.math`` (tests/integration/services/data_pool.py); yields its recipe.
    It answers at route prefix "/" and stays up from its first test to its last; every other pool deployed on the
    session's cluster takes its own ``rollout_pool.route_prefix``, so tests run in file order."""
    from services import pool as pool_api
    from services.app import deploy_pool

    from data_pool import data_recipe

    recipe = data_recipe()
    deployed = deploy_pool(recipe, tmp_path_factory.mktemp("data-pool"))
    assert deployed.status.ready, deployed
    yield from _running_pool("data_pool", recipe, lambda: pool_api.shutdown(recipe.rollout_pool.name))


@pytest.fixture(scope="session")
def served(ray_cluster, tmp_path_factory):
    """The OpenAI-serving pool (tests/integration/services/openai_pool.py), its episodes played by an agent server;
    yields (recipe, base URL, an ``openai`` client with the serving key). Up from its first test to its last (its
    modules run one after the other)."""
    import openai
    from http_server import Server
    from openai_pool import AGENT_TIMEOUT_S, OVERRIDES, POOL_NAME, TOKEN, agent_app
    from test_pool_and_loops import tiny_recipe

    from services import pool as pool_api
    from services.app import deploy_pool
    from services.pool.openai_api import serving_key

    os.environ["INFLIGHT_ADMIN_TOKEN"] = TOKEN
    agents = Server(agent_app())
    recipe = tiny_recipe(*OVERRIDES, f"env.agents.agent={agents.url}", f"env.agents.agent_timeout_s={AGENT_TIMEOUT_S}",
                         "env.agents.max_retries=0")
    deployed = deploy_pool(recipe, tmp_path_factory.mktemp("openai-pool"))
    assert deployed.status.ready, deployed
    client = openai.OpenAI(base_url=f"{deployed.http}/v1", api_key=serving_key(TOKEN), timeout=120, max_retries=0)

    def shutdown() -> None:
        pool_api.shutdown(POOL_NAME)
        agents.stop()

    yield from _running_pool("served", (recipe, deployed.http, client), shutdown)


class LentLearner:
    """A session's learner group lent to one test: every call goes to the group except ``shutdown`` (the
    session ends it), so code that shuts its learner down at the end (``run_learner``) leaves it for the next."""

    def __init__(self, group):
        self.group = group

    def shutdown(self) -> None:
        pass

    def __getattr__(self, name: str):
        return getattr(self.group, name)


@pytest.fixture(scope="session")
def fresh_learner(ray_cluster):
    """``fresh_learner(recipe, model_path)``: a one-rank learner group as a new job finds one (the model's
    weights, a fresh optimizer, version 0), kept for the session and built again in place for each test
    (``LearnerGroup.reset``): the rank's Ray worker, torch and Megatron-Core imports and rendezvous are paid
    once per session. A reset that fails (a test left the rank busy or dead) starts a new group instead."""
    from services.job.learner_group import LearnerGroup

    kept: list = []

    def lend(recipe, model_path: str) -> LentLearner:
        assert max(1, recipe.learner_gpus) == 1, "fresh_learner lends one-rank groups"
        if kept:
            try:
                kept[0].reset(recipe, model_path)
                return LentLearner(kept[0])
            except Exception:  # noqa: BLE001 - replaced below
                kept.pop()._release()
        kept.append(LearnerGroup(recipe, model_path, call_timeout_s=600.0))
        return LentLearner(kept[0])

    yield lend
    for group in kept:
        group.shutdown()
