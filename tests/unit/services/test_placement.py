"""GPU requests per actor for the shipped layouts."""
from __future__ import annotations

import pytest

from services.config import RECIPES_DIR, load_recipe
from services.placement import PlacementError, check_learner_fits, engine_gpus, learner_gpus_per_rank


def test_cpu_recipe_asks_for_no_gpu():
    r = load_recipe(None)
    assert engine_gpus(r) == 0 and learner_gpus_per_rank(r) == 0
    check_learner_fits(r, 0)


def test_separate_pools_take_whole_gpus():
    r = load_recipe(RECIPES_DIR / "grpo-32gpu-async-1off.yaml")
    assert engine_gpus(r) == 2 and learner_gpus_per_rank(r) == 1
    check_learner_fits(r, 32)
    with pytest.raises(PlacementError, match="needs 16 GPUs"):
        check_learner_fits(r, 8)


def test_one_gpu_colocated_shares_it():
    r = load_recipe(RECIPES_DIR / "gpu-1xh200-sync.yaml")
    assert engine_gpus(r) == 0.5 and learner_gpus_per_rank(r) == 0.5
    check_learner_fits(r, 1)


def test_colocated_multi_gpu_engines_are_refused():
    with pytest.raises(PlacementError, match="2 GPUs per engine is not supported"):
        engine_gpus(load_recipe(RECIPES_DIR / "grpo-32gpu-sync-colocated.yaml"))


COLOCATED_2GPU = ["cluster.gpus_per_node=2", "rollout_pool.num_engines=2"]

PLACE_SCRIPT = r"""
import json, sys, tempfile
import ray
from services.config import RECIPES_DIR, load_recipe
from services.placement import colocation_group, engine_options, learner_options

recipe = load_recipe(RECIPES_DIR / "gpu-1xh200-sync.yaml", sys.argv[1:])
ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(),
         object_store_memory=80 * 1024 * 1024)

@ray.remote(num_cpus=0)
class Member:
    def gpus(self):
        return [str(g) for g in ray.get_gpu_ids()]

group = colocation_group(recipe, "placement-test", timeout_s=30)
again = colocation_group(recipe, "placement-test", timeout_s=30)  # a restarted pool replica finds its own
engines = [Member.options(**engine_options(recipe, i, group)).remote() for i in range(2)]
ranks = [Member.options(**learner_options(recipe, r, group)).remote() for r in range(2)]
out = {"same_group": again.id == group.id, "engines": ray.get([e.gpus.remote() for e in engines], timeout=60),
       "ranks": ray.get([r.gpus.remote() for r in ranks], timeout=60)}
ray.util.remove_placement_group(group)
print("RESULT " + json.dumps(out))
"""


def test_colocated_engine_i_and_learner_rank_i_share_gpu_i_through_the_pools_group():
    """Real Ray with two declared GPUs: half-GPU requests alone would pack both engines on one GPU and both
    learner ranks on the other (NCCL refuses two ranks on one GPU); the colocation group pairs them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", PLACE_SCRIPT, *COLOCATED_2GPU], cwd=root, capture_output=True,
                          text=True, timeout=180, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["same_group"]
    assert out["engines"] == out["ranks"], out
    assert sorted(g for gs in out["engines"] for g in gs) == ["0", "1"], out


def test_colocation_needs_a_group_only_on_gpus():
    from services.placement import colocation_bundles, engine_options

    assert colocation_bundles(load_recipe(None)) == 0
    assert colocation_bundles(load_recipe(RECIPES_DIR / "gpu-2xh200-async.yaml")) == 0
    assert colocation_bundles(load_recipe(RECIPES_DIR / "gpu-1xh200-sync.yaml", COLOCATED_2GPU)) == 2
    assert engine_options(load_recipe(None), 0, None) == {"num_gpus": 0}
