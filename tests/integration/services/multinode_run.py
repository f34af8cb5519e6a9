"""A three-node Ray cluster on this machine, run by ``test_multinode.py`` in a process of its own.

Nodes: the head (the driver, the Serve controller; the host's IP), a pool node
(``127.0.0.2``, resource ``pool_node``) and a learner node (``127.0.0.3``,
resource ``learner_node``), each with its own ``INFLIGHT_CACHE`` (its "local
disk"). The recipe steers engines and learner ranks with
``cluster.engine_resources`` / ``cluster.learner_resources``. The model
directory is registered on the head and then deleted, so no node finds it: the
engines, the learner ranks and the driver must get its files shipped. Then an
async run (1 rank) and a sync run (2 ranks) of 3 steps each, and a learner
whose files cannot be shipped. Writes what it saw as JSON to ``argv[1]``.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(tempfile.mkdtemp(prefix="inflight-multinode-"))
os.environ.update(RAY_TMPDIR=str(ROOT), RAY_USAGE_STATS_ENABLED="0", INFLIGHT_CACHE=str(ROOT / "head-cache"))
(ROOT / "ray").mkdir()  # Cluster writes ray_current_cluster here, not into the machine's /tmp/ray
POOL_IP, LEARNER_IP = "127.0.0.2", "127.0.0.3"
STORE = 160 * 1024 * 1024


def node_ip_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.util.get_node_ip_address()), timeout=60)


def env_of(actor, key: str) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: os.environ.get(key, "")), timeout=60)


def run(recipe, handle, files, run_dir: Path, out: dict, key: str) -> None:
    from services.job.learner_job import LearnerJob
    from services.job.learner_group import LearnerGroup
    from services.job.loop_async import run_async
    from services.job.loop_sync import run_sync
    from services.models.files import ensure_local

    learner = LearnerGroup(recipe, files)
    try:
        out[key] = {"master": list(learner.master), "rank_ips": [node_ip_of(a) for a in learner.actors],
                    "rank_master_addrs": [env_of(a, "MASTER_ADDR") for a in learner.actors]}
        job = LearnerJob(recipe, ensure_local(files), handle, learner, run_dir, resume=False)
        try:
            run_async(job) if recipe.grpo.async_grpo.enabled else run_sync(job, colocated=False)
        finally:
            job.close()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        out[key]["rows"] = [{k: r.get(k) for k in ("step", "policy_version", "trajectory_age_mean",
                                                   "gen_kl_error", "train_gen_kl_error")} for r in rows]
    finally:
        learner.shutdown()


def main(out_path: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from services import pool as pool_api
    from services.recipe.config import load_recipe
    from services.job.learner_group import LearnerGroup
    from services.models.files import share
    from services.models.source import resolve_model

    out: dict = {}
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": STORE, "temp_dir": str(ROOT)})
    for ip, res in ((POOL_IP, "pool_node"), (LEARNER_IP, "learner_node")):
        cluster.add_node(num_cpus=1, resources={res: 1}, object_store_memory=STORE, node_ip_address=ip,
                         env_vars={"INFLIGHT_CACHE": str(ROOT / f"{res}-cache")})
    ray.init(address=cluster.address, namespace="inflight", log_to_driver=True)
    try:
        out["driver_ip"] = ray.util.get_node_ip_address()
        base = ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=3",
                "checkpointing.enabled=false", "logger.tensorboard_enabled=false", "rollout_pool.http_port=0",
                "cluster.engine_resources={pool_node: 0.01}", "cluster.learner_resources={learner_node: 0.01}"]
        recipe = load_recipe(None, base)
        origin = ROOT / "origin-model"
        shutil.copytree(resolve_model(recipe.policy.model_name), origin)
        files = share(str(origin), owner=recipe.rollout_pool.name)
        shutil.rmtree(origin)  # from now on only the holder has the files: every node must get them shipped
        out["model_path"] = files.path
        deployed = pool_api.deploy(recipe, files, "multinode-token")
        out["pool_ready"] = deployed.status.ready
        engine = ray.get_actor(f"{recipe.rollout_pool.name}-engine-0", namespace="inflight")
        out["engine_ip"] = node_ip_of(engine)
        handle = pool_api.connect(recipe.rollout_pool.name)
        out["t_pool_s"] = time.monotonic() - t0
        run(recipe, handle, files, ROOT / "async", out, "async")
        sync = load_recipe(None, [*base, "grpo.async_grpo.enabled=false", "rollout_pool.learner_gpus=2"])
        run(sync, handle, files, ROOT / "sync", out, "sync")
        out["t_runs_s"] = time.monotonic() - t0
        out["caches"] = {n: sorted(str(p.relative_to(ROOT)) for p in (ROOT / f"{n}-cache" / "models").glob("*/config.json"))
                         for n in ("pool_node", "learner_node", "head")}
        # nothing can ship these files: the holder is gone and so is the directory
        gone = ROOT / "gone-model"
        shutil.copytree(resolve_model(recipe.policy.model_name), gone)
        lost = share(str(gone))
        ray.kill(lost.holder)
        shutil.rmtree(gone)
        time.sleep(1)
        try:
            LearnerGroup(recipe, lost, call_timeout_s=120).shutdown()
            out["unshippable_error"] = ""
        except Exception as exc:  # noqa: BLE001 - its text is what the test checks
            out["unshippable_error"] = f"{type(exc).__name__}: {exc}"[-2000:]
        out["unshippable_path"] = lost.path
        pool_api.shutdown(recipe.rollout_pool.name)
    except Exception:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()[-4000:]
    finally:
        Path(out_path).write_text(json.dumps(out, indent=1))
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
