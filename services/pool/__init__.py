"""The rollout pool: a named Ray Serve application that outlives learners.

A learner job attaches by name (:func:`connect`), gives the pool its trajectory
channel, submits prompts and pushes weights; when it goes away the pool keeps
serving its last version. This module is the pool's public face: :func:`deploy`,
:func:`connect`, :func:`scale`, :func:`shutdown` and :func:`http_port`; it imports
Ray Serve only when one of them runs, so that a process that needs one part (an
engine actor imports ``engine_actor``) does not pay for Serve and the HTTP app.
Its parts: ``deployment`` (the Serve class ``RolloutPool`` and HTTP), ``fleet`` and
``engine_table`` (the engines, their states and scaling), ``dispatch`` (prompts,
re-queue and the drain of removed engines), ``watcher`` (health, and the
admission of new engines), ``startup`` and ``placement`` (boot),
``engine_actor``, ``metrics``. The pool wing imports nothing from the job wing
(``services.job``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocol.pool_replies import PoolStatus
from services.cluster.head import free_port

if TYPE_CHECKING:
    from services.pool.fleet import ScaleResult
    from services.recipe.config import Recipe

__all__ = ["DeployedPool", "connect", "deploy", "http_port", "pool_url", "scale", "shutdown"]


@dataclass(frozen=True)
class DeployedPool:
    """A pool :func:`deploy` started: its status once ready, and where its HTTP routes answer."""

    status: PoolStatus
    http: str
    """``http://<host>:<port>`` and the pool's ``rollout_pool.route_prefix`` when it is not ``/`` (``/metrics``,
    ``/healthz``, ``/readyz``, ``/v1/status`` follow it)."""

    def to_json(self) -> dict:
        """``inflight pool deploy``'s answer: the status's JSON with ``http``."""
        return {**self.status.to_json(), "http": self.http}


def deploy(recipe: Recipe, model_path: Any, admin_token: str, ready_timeout_s: float = 900.0) -> DeployedPool:
    """Start (or update) the pool application on the connected Ray cluster and wait until it is ready. A pool
    that does not start is removed (Serve application, engines, colocation group) and
    :class:`~services.pool.startup.PoolStartError` gives the reason. ``model_path``: a model directory on this
    node (registered with :func:`services.models.files.share` so that engines on other nodes get its files) or
    a :class:`~services.models.files.ModelFiles`."""
    from ray import serve

    from services.models.files import ModelFiles, release, share
    from services.pool.deployment import RolloutPool
    from services.pool.startup import PoolStartError, reason, remove_pool

    name = recipe.rollout_pool.name
    if not isinstance(model_path, ModelFiles):
        model_path = share(model_path, owner=name)
    http = {"host": recipe.rollout_pool.http_host, "port": recipe.rollout_pool.http_port or free_port()}
    serve.start(http_options=http)
    try:
        recipe = _with_served_environment(recipe)
        here = pool_url(_reachable(http["host"]), http_port(), recipe.rollout_pool.route_prefix)
        handle = serve.run(RolloutPool.bind(recipe.model_dump_json(), model_path, admin_token, here),
                           name=name, route_prefix=recipe.rollout_pool.route_prefix, blocking=False)
        status: PoolStatus = handle.wait_ready.remote(ready_timeout_s).result(timeout_s=ready_timeout_s + 30)
        why = None if status.ready else ("; ".join(status.errors)
                                         or f"engines not ready: {status.to_json()['engines']}")
    except Exception as exc:  # noqa: BLE001 - the pool is removed and the reason raised below
        why = reason(exc)
    if why is not None:
        remove_pool(name, recipe.rollout_pool.num_engines)
        _shutdown_served_environment(name)
        release(name)
        raise PoolStartError(f"rollout pool {name!r} did not start: {why} (its Serve application, engines and "
                             f"placement group were removed)")
    return DeployedPool(status, pool_url(http["host"], http_port(), recipe.rollout_pool.route_prefix))


def pool_url(host: str, port: int, route_prefix: str) -> str:
    """Base URL of a pool's HTTP endpoints: ``http://<host>:<port>`` then its route prefix, if not ``/``."""
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def _reachable(host: str) -> str:
    """The address engines call the Serve proxy at: loopback for a wildcard bind (a proxy runs on every node)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def served_environment_name(pool_name: str) -> str:
    """The Serve application suffix of a pool's served environment (``inflight-env-<pool>``)."""
    return pool_name


def _with_served_environment(recipe: Recipe) -> Recipe:
    """For ``env.<data.env_name>.serve: true``: deploy the environment class as its own Serve application (
    ``serve_replicas`` replicas) and return the recipe the engines get, whose section calls it by ``url``."""
    from services.pool.env_server import deploy_environment

    name = recipe.data.env_name
    if name is None or not (e := recipe.env.named[name]).serve:
        return recipe
    assert e.environment is not None
    url = deploy_environment(served_environment_name(recipe.rollout_pool.name), e.environment,
                             e.environment_kwargs, num_replicas=e.serve_replicas)
    data = recipe.model_dump(mode="json")
    data["env"][name].update(url=url, serve=False, environment=None)
    return type(recipe).model_validate(data)


def _shutdown_served_environment(pool_name: str) -> None:
    from services.pool.env_server import shutdown_environment

    shutdown_environment(served_environment_name(pool_name))


def connect(name: str) -> Any:
    """DeploymentHandle of a running pool; a clear error if there is none."""
    from ray import serve

    try:
        return serve.get_app_handle(name)
    except Exception as exc:  # noqa: BLE001 - Serve raises several types here
        raise RuntimeError(f"no rollout pool named {name!r} on this Ray cluster ({type(exc).__name__}: {exc}); "
                           f"deploy one with `inflight pool deploy`") from None


def scale(handle: Any, engines: int, drain_timeout_s: float | None = None) -> ScaleResult:
    """``RolloutPool.scale`` through the pool's ``handle``, typed, bounded by the engines' boot and the drain
    (``drain_timeout_s`` None: the longest drain); a refused or failed scale raises the pool's
    ``ScaleRequestError`` / ``ScaleError`` (inside Ray's error: ``services.refit.result.remote_cause``)."""
    from services.pool.fleet import MAX_DRAIN_TIMEOUT_S
    from services.pool.startup import BOOT_TIMEOUT_S

    drain_s = MAX_DRAIN_TIMEOUT_S if drain_timeout_s is None else drain_timeout_s
    return handle.scale.remote(engines, drain_timeout_s).result(timeout_s=BOOT_TIMEOUT_S + drain_s + 120)


def http_port() -> int:
    """Port of the Serve HTTP proxy on this cluster."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        raise RuntimeError("Ray Serve is not running on this cluster")
    return client.http_config.port


def shutdown(name: str) -> None:
    from ray import serve

    from services.models.files import release

    handle = connect(name)
    handle.shutdown_engines.remote().result(timeout_s=300)
    serve.delete(name)
    _shutdown_served_environment(name)  # nothing if the pool serves none
    release(name)
