"""A pool whose start-up fails: ``deploy`` fails within seconds with the reason and leaves nothing behind.

Through the real Ray Serve pool. The session's private Ray cluster has no GPUs, so a
colocated recipe's placement cannot be granted there; a second private cluster (in a
subprocess, two declared GPUs) grants the colocation group, and the engines made in
it fail to construct (a reward function that does not exist), so the group, the
engine actors and the Serve application all exist when the start-up fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from services.recipe.config import load_recipe

DEADLINE_S = 30.0
"""Before the fix: 120 s (the group's grant timeout) or 900 s (``ready_timeout_s``), and leftovers."""
COLOCATED = ["grpo.async_grpo.enabled=false", "policy.generation.colocated.enabled=true"]


def leftovers(name: str, num_engines: int, wait_s: float = 10.0) -> dict:
    """Engine actors, live colocation groups and Serve applications of pool ``name`` (waits up to ``wait_s``
    for ones being removed)."""
    import ray
    from ray import serve

    from services.pool.placement import colocation_group_name
    from services.pool.startup import ENGINE_NAMESPACE, engine_name

    deadline = time.monotonic() + wait_s
    while True:
        found = {"actors": [], "groups": [], "apps": [a for a in serve.status().applications if a == name]}
        for i in range(num_engines):
            try:
                ray.get_actor(engine_name(name, i), namespace=ENGINE_NAMESPACE)
                found["actors"].append(engine_name(name, i))
            except ValueError:
                pass
        found["groups"] = [g["name"] for g in ray.util.placement_group_table().values()
                           if g["name"] == colocation_group_name(name) and g["state"] != "REMOVED"]
        if not any(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def model_dir() -> str:
    """A directory that passes for a model (the pools here fail before any engine reads it)."""
    path = Path(tempfile.mkdtemp(prefix="startup-model-"))
    (path / "config.json").write_text("{}")
    return str(path)


def test_a_placement_the_cluster_cannot_grant_fails_deploy_at_once_and_removes_the_app(ray_cluster):
    from services import pool as pool_api
    from services.pool.startup import PoolStartError

    recipe = load_recipe(None, [*COLOCATED, "cluster.gpus_per_node=1", "rollout_pool.name=startup-no-gpu",
                                "rollout_pool.route_prefix=/startup-no-gpu"])
    t0 = time.monotonic()
    with pytest.raises(PoolStartError, match=r"'startup-no-gpu' did not start: .*needs 1 whole GPUs .* the Ray "
                                             r"cluster has 0 in all"):
        pool_api.deploy(recipe, model_dir(), "token", ready_timeout_s=120)
    assert time.monotonic() - t0 < DEADLINE_S
    assert leftovers("startup-no-gpu", 1) == {"actors": [], "groups": [], "apps": []}


FAILING_ENGINES_SCRIPT = r"""
import json, sys, tempfile, time
import ray
from ray import serve
from services import pool as pool_api
from services.recipe.config import load_recipe
from services.pool.startup import PoolStartError
sys.path.insert(0, sys.argv[1])
from test_pool_startup import COLOCATED, leftovers, model_dir

recipe = load_recipe(None, [*COLOCATED, "cluster.gpus_per_node=2", "rollout_pool.num_engines=2",
                            "rollout_pool.name=startup-bad-engines", "env.reward_fn=no_such_reward_module:score"])
ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(),
         object_store_memory=100 * 1024 * 1024, namespace="inflight")
out = {}
try:
    t0 = time.monotonic()
    try:
        pool_api.deploy(recipe, model_dir(), "token", ready_timeout_s=300)
        out["error"] = None
    except PoolStartError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - t0
    out["left"] = leftovers("startup-bad-engines", 2)
finally:
    serve.shutdown()
    ray.shutdown()
print("RESULT " + json.dumps(out))
"""


def test_engines_that_fail_to_start_in_a_granted_colocation_group_fail_deploy_and_leave_nothing():
    """Two declared GPUs: the pool makes its colocation group and two engine actors in it, which die in their
    constructor; deploy must fail with the engine's reason, and the group, the actors and the app be gone."""
    here = Path(__file__).resolve().parent
    root = here.parents[2]
    done = subprocess.run([sys.executable, "-c", FAILING_ENGINES_SCRIPT, str(here)], cwd=root, capture_output=True,
                          text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(root),
                                                       "TMPDIR": tempfile.mkdtemp(prefix="pst", dir="/tmp")})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["error"] is not None, out
    assert "'startup-bad-engines' did not start: " in out["error"], out
    assert "engine startup-bad-engines-engine-" in out["error"] and "no_such_reward_module" in out["error"], out
    assert out["seconds"] < DEADLINE_S, out
    assert out["left"] == {"actors": [], "groups": [], "apps": []}, out
