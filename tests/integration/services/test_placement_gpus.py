"""A learner that cannot have its GPUs fails within 30 s, naming them (issue 21, item 3), on a private Ray with
declared GPUs (in a subprocess: the session's cluster has none). vLLM cannot start on a declared GPU, so the
pool's engine is a stand-in actor holding the GPU; only the placement check and the bounded wait run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = r"""
import json, sys, tempfile, time
from pathlib import Path
import ray
from services.recipe.config import RECIPES_DIR, load_recipe
from services.recipe.gpu_layout import PlacementError
from services.job.learner_group import LearnerGroup

model = Path(tempfile.mkdtemp(prefix="plg-model-"))
(model / "config.json").write_text("{}")
ray.init(address="local", num_cpus=2, num_gpus=int(sys.argv[1]), include_dashboard=False,
         _temp_dir=tempfile.mkdtemp(), object_store_memory=80 * 1024 * 1024)
recipe = load_recipe(RECIPES_DIR / "gpu-2xh200-async.yaml", sys.argv[2:])

@ray.remote(num_cpus=0, num_gpus=1)
class Engine:  # stands in for the pool's engine: holds its GPU
    pass

engine = Engine.remote()
ray.get(engine.__ray_ready__.remote(), timeout=60)
t0 = time.monotonic()
try:
    LearnerGroup(recipe, str(model), placement_timeout_s=3).shutdown()
    error = None
except PlacementError as exc:
    error = str(exc)
out = {"error": error, "seconds": time.monotonic() - t0, "free_after": ray.available_resources().get("GPU", 0)}
print("RESULT " + json.dumps(out))
"""


def run(gpus: int, *overrides: str) -> dict:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(gpus), *overrides], cwd=root, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(root),
                                                       "TMPDIR": tempfile.mkdtemp(prefix="plg", dir="/tmp")})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


def test_the_async_recipe_on_a_one_gpu_cluster_fails_at_once_naming_the_gpus():
    """One GPU, the pool's engine on it: before, the learner's rank waited 1800 s with no word."""
    out = run(1)
    assert out["seconds"] < 30, out
    assert out["error"] and "the learner asks for 1 GPUs" in out["error"], out
    assert "0 of the Ray cluster's 1 GPUs are free (the rollout pool's 1 engine holds 1 of 1 GPUs)" in out["error"]
    assert "policy.generation.colocated.enabled=true" in out["error"], out


def test_ranks_that_are_not_placed_fail_after_the_placement_timeout_naming_what_they_ask_for():
    """Two GPUs, one free, but the ranks also ask for a resource no node has: the bounded wait (3 s here) fails,
    names it and the GPUs, and kills the pending rank actors."""
    out = run(2, "cluster.learner_resources={learner_node: 1}")
    assert out["seconds"] < 30, out
    assert out["error"] and "learner: 1 of 1 ranks were not placed within 3 s" in out["error"], out
    assert "each asks for 1 GPU, 1 learner_node" in out["error"], out
    assert "1 of the Ray cluster's 2 GPUs are free" in out["error"], out
    assert out["free_after"] == 1, out
