"""Async on one GPU on real Ray with one declared GPU (issue 21, item 3): with ``rollout_pool.share_gpu`` the pool's
engine and the learner's rank, made with the real option builders (:func:`services.pool.placement.engine_options`,
:func:`services.recipe.gpu_layout.learner_options`), both get placed on the GPU after the same checks the pool's start-up
and the learner job run; without it (the two-GPU async recipe) the pool's check and, once the engine holds the GPU,
the learner's check fail at once naming the GPUs asked for and free. vLLM cannot start on a declared GPU, so both
are stand-in actors (in a subprocess: the session's Ray has no GPUs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = r"""
import json, tempfile, time
import ray
from services.recipe.config import RECIPES_DIR, load_recipe
from services.recipe.gpu_layout import PlacementError, check_learner_fits, check_pool_fits, gpu_census, learner_options
from services.job.learner_group import wait_placed
from services.pool.placement import engine_options

ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, _temp_dir=tempfile.mkdtemp(),
         object_store_memory=80 * 1024 * 1024)

@ray.remote(num_cpus=0)
class Member:  # the pool's engine, or a learner rank
    def gpus(self):
        return [str(g) for g in ray.get_gpu_ids()]

def attempt(check):
    try:
        check()
        return None
    except PlacementError as exc:
        return str(exc)

out = {}
for name in ("gpu-1xh200-async.yaml", "gpu-2xh200-async.yaml"):
    recipe = load_recipe(RECIPES_DIR / name)
    deadline = time.monotonic() + 20  # the previous recipe's actors were killed: their GPU comes back
    while ray.available_resources().get("GPU", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    got = {"pool_check": attempt(lambda: check_pool_fits(recipe, gpu_census(recipe), 1))}
    engine = Member.options(**engine_options(recipe, 0, None)).remote()
    got["engine"] = ray.get(engine.gpus.remote(), timeout=60)
    t0 = time.monotonic()
    got["learner_check"] = attempt(lambda: check_learner_fits(recipe, gpu_census(recipe)))
    got["learner_check_s"] = time.monotonic() - t0
    actors = [engine]
    if got["learner_check"] is None:
        rank = Member.options(num_cpus=0, **learner_options(recipe, 0, None)).remote()
        actors.append(rank)
        wait_placed(recipe, [rank], 20)
        got["rank"] = ray.get(rank.gpus.remote(), timeout=60)
    out[name] = got
    for a in actors:
        ray.kill(a)
print("RESULT " + json.dumps(out))
"""


def run() -> dict:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(root),
                               "TMPDIR": tempfile.mkdtemp(prefix="psg", dir="/tmp")})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


def test_one_declared_gpu_holds_the_engine_and_the_learner_rank_only_with_share_gpu():
    out = run()
    shared = out["gpu-1xh200-async.yaml"]
    assert shared["pool_check"] is None and shared["learner_check"] is None, shared
    assert shared["engine"] == ["0"] and shared["rank"] == ["0"], shared  # both on the one GPU

    alone = out["gpu-2xh200-async.yaml"]
    assert alone["pool_check"] and "the rollout pool asks for 1 GPUs" in alone["pool_check"], alone
    assert "and its learner for 1 more (rollout_pool.learner_gpus), 2 in all; 1 of the Ray cluster's 1 GPUs are " \
           "free" in alone["pool_check"], alone
    assert alone["engine"] == ["0"], alone
    msg = alone["learner_check"]
    assert msg and "the learner asks for 1 GPUs (1 rank x 1 GPU, rollout_pool.learner_gpus)" in msg, alone
    assert "0 of the Ray cluster's 1 GPUs are free (the rollout pool's 1 engine holds 1 of 1 GPUs)" in msg, alone
    assert "rollout_pool.share_gpu=true, recipes/gpu-1xh200-async.yaml" in msg, alone
    assert alone["learner_check_s"] < 30, alone
