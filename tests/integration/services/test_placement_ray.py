"""Placement through real Ray clusters with declared GPUs (each in its own process, like a pool's start-up):
colocated engines and learner ranks pair up on one node of two GPUs and on two nodes of four. The layouts
themselves, without Ray, are tests/unit/services/pool/test_placement.py."""
from __future__ import annotations

COLOCATED_2GPU = ["cluster.gpus_per_node=2", "rollout_pool.num_engines=2"]

PLACE_SCRIPT = r"""
import json, sys, tempfile
import ray
from services.recipe.config import RECIPES_DIR, load_recipe
from services.recipe.gpu_layout import learner_options
from services.pool.placement import colocation_group, engine_options

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


MULTINODE_SCRIPT = r"""
import json, os
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from services.recipe.config import RECIPES_DIR, load_recipe
from services.recipe.gpu_layout import learner_options
from services.pool.placement import colocation_group, engine_options

recipe = load_recipe(RECIPES_DIR / "grpo-8gpu-sync-colocated.yaml", ["cluster.num_nodes=2", "cluster.gpus_per_node=4"])
node = dict(num_cpus=1, num_gpus=4, object_store_memory=80 * 1024 * 1024)
cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node))
try:
    cluster.add_node(**node)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()

    def where():
        return [ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]]

    @ray.remote(num_cpus=0)
    class Member:  # a learner rank, or one of an engine's vLLM workers
        def where(self):
            return where()

    @ray.remote(num_cpus=0)
    class Engine:
        def start_workers(self):
            # What vLLM's RayDistributedExecutor._init_workers_ray does (vllm/v1/executor/ray_executor.py): the
            # actor's current placement group, worker r on bundle VLLM_RAY_BUNDLE_INDICES[r], asking for
            # VLLM_RAY_PER_WORKER_GPUS GPUs.
            group = ray.util.get_current_placement_group()
            bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
            share = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1"))
            self.workers = [Member.options(num_cpus=0, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_capture_child_tasks=True, placement_group_bundle_index=b)).remote()
                for b in bundles]
            return {"actor": where(), "bundles": bundles,
                    "workers": ray.get([w.where.remote() for w in self.workers], timeout=120)}

    group = colocation_group(recipe, "placement-test", timeout_s=60)
    ranks = [Member.options(**learner_options(recipe, r, group)).remote() for r in range(recipe.learner_gpus)]
    out = {"ranks": ray.get([r.where.remote() for r in ranks], timeout=120)}
    engines = [Engine.options(**engine_options(recipe, i, group)).remote() for i in range(recipe.rollout_pool.num_engines)]
    out["engines"] = ray.get([e.start_workers.remote() for e in engines], timeout=180)
    ray.util.remove_placement_group(group)
    print("RESULT " + json.dumps(out))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


def test_colocated_tp2_engines_and_learner_ranks_pair_up_on_two_nodes_of_four_gpus():
    """Two Ray nodes of 4 declared GPUs each, the seed's sync layout (engines TP2 -> 4 engines, learner TP1 x DP8):
    learner rank j holds half of slot j; engine i's vLLM workers hold the other halves of slots 2i and 2i+1, on the
    node its actor runs on (which holds no GPU itself: every bundle is full with one worker and one rank)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    private_tmp = tempfile.mkdtemp(prefix="plc", dir="/tmp")  # Cluster writes TMPDIR/ray/ray_current_cluster
    done = subprocess.run([sys.executable, "-c", MULTINODE_SCRIPT], cwd=root, capture_output=True, text=True,
                          timeout=420, env={**os.environ, "PYTHONPATH": str(root), "TMPDIR": private_tmp})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    ranks = [(n, tuple(g)) for n, g in out["ranks"]]
    assert all(len(g) == 1 for _, g in ranks) and len(set(ranks)) == 8, ranks  # one distinct GPU each
    assert len({n for n, _ in ranks[:4]}) == 1 and len({n for n, _ in ranks[4:]}) == 1, ranks  # node by node
    assert ranks[0][0] != ranks[4][0], ranks
    for i, eng in enumerate(out["engines"]):
        assert len(eng["bundles"]) == 2, (i, eng)
        assert [(n, tuple(g)) for n, g in eng["workers"]] == ranks[2 * i:2 * i + 2], (i, eng, ranks)
        assert eng["actor"] == [ranks[2 * i][0], []], (i, eng)  # on the engine's node, no GPU of its own
