"""What the CLI commands do, as plain functions (the CLI only parses arguments).

- ``run_embedded``: the whole loop on one machine (local Ray, pool, learner).
- ``deploy_pool`` / ``pool_status`` / ``shutdown_pool``: the long-lived pool.
- ``attach_learner``: a learner job against a running pool (resumes from its
  run directory's last checkpoint if there is one).
"""
from __future__ import annotations

import os
import secrets
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from protocol.pool_client import PoolClient
from services import pool as pool_api
from services.cluster import ray_runtime
from services.console import output as console
from services.console import progress as startup_progress
from services.job.learner_group import LearnerGroup
from services.models.variant import resolve_policy_model
from services.recipe.config import Recipe


def admin_token(recipe: Recipe, run_dir: Path | None = None) -> str:
    """The bearer token for admin endpoints: from the environment, else a new one saved (0600) in run_dir."""
    token = os.environ.get(recipe.rollout_pool.admin_token_env)
    if token:
        return token
    token = secrets.token_urlsafe(24)
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "admin_token"
        path.write_text(token)
        path.chmod(0o600)
    return token


def deploy_pool(recipe: Recipe, run_dir: Path | None = None) -> pool_api.DeployedPool:
    n = recipe.rollout_pool.num_engines
    with startup_progress.phase(f"starting the rollout pool ({n} engine{'s' if n > 1 else ''}; vLLM loads the model)"):
        model_path = resolve_policy_model(recipe.policy)
        return pool_api.deploy(recipe, model_path, admin_token(recipe, run_dir))  # PoolStartError if not ready


def run_learner(recipe: Recipe, pool_name: str, run_dir: Path, resume: bool = True,
                early: Future[LearnerGroup] | None = None) -> Path:
    """Attach a learner job to ``pool_name`` and run the recipe's loop; returns the metrics file. ``early``: the
    learner's ranks, started beside the pool (:func:`run_embedded`), else they start here."""
    from services.job.learner_job import LearnerJob
    from services.job.loop_async import run_async
    from services.job.loop_sync import run_sync
    from services.offline.export import save_run_recipe

    model_path = resolve_policy_model(recipe.policy)
    save_run_recipe(recipe, model_path, run_dir)  # what `inflight export` rebuilds the learner from
    with startup_progress.phase("starting the learner (Megatron ranks, data, checkpoint)"):
        client = PoolClient(pool_api.connect(pool_name))
        learner = (early.result() if early is not None
                   else LearnerGroup(recipe, model_path, colocation=client.colocation_group()))
        job = LearnerJob(recipe, model_path, client, learner, run_dir, resume=resume)
    startup_progress.note("training: the first prompts go to the pool; the progress bar follows")
    try:
        if recipe.grpo.async_grpo.enabled:
            run_async(job)
        else:
            run_sync(job, colocated=recipe.policy.generation.colocated.enabled and recipe.cluster.gpus_per_node > 0)
        mode = "async 1-off" if recipe.grpo.async_grpo.enabled else "sync"
        print("\nStep-time breakdown (means over warm steps):\n" + job.log.timing_table(mode))
        print("\nFunctional validation:\n" + job.log.validation_table(mode))
        print(f"\nledger: {job.book.ledger.summary().line()}")
        print(f"metrics: {job.log.path}")
        try:
            print(f"reward curve: {job.log.plot_rewards()}")
        except ImportError as exc:  # matplotlib is optional on GPU hosts
            print(f"reward curve: skipped ({exc})")
        if (screen := console.active()) is not None:
            print(f"logs: {screen.log_dir}")
        return job.log.path
    finally:
        job.close()
        learner.shutdown()


def run_embedded(recipe: Recipe, run_dir: Path, resume: bool = False) -> Path:
    """``inflight run``: local Ray + pool + learner on this machine, torn down at the end; with ``resume``, the
    learner continues from the run directory's latest checkpoint (:mod:`services.run_resume` decides)."""
    with startup_progress.phase("starting Ray" if not os.environ.get("RAY_ADDRESS") else "connecting to Ray"):
        ray_runtime.connect(address="local" if not os.environ.get("RAY_ADDRESS") else None)
    try:
        # On GPUs the pool first, the learner once it is ready: with rollout_pool.share_gpu the two share one GPU,
        # and vLLM sizes its KV cache from the device's free memory as it profiles at start-up (and refuses to
        # start when less than gpu_memory_utilization of the GPU is free), so the learner's rank must not touch
        # the GPU before then; afterwards the engine's memory is fixed and the learner stays within its
        # policy.megatron_cfg.gpu_memory_fraction. On CPU the learner's ranks start beside the pool.
        early = start_learner_early(recipe) if recipe.cluster.gpus_per_node == 0 else None
        try:
            deployed = deploy_pool(recipe, run_dir)  # a pool that does not start is removed before this raises
        except Exception:
            if early is not None:
                discard_learner(early)
            raise
        try:
            http = deployed.http
            print(f"rollout pool {deployed.status.name!r} ready at version {deployed.status.version}; "
                  f"metrics: {http}/metrics  health: {http}/healthz  ready: {http}/readyz", file=sys.stderr)
            return run_learner(recipe, recipe.rollout_pool.name, run_dir, resume=resume, early=early)
        finally:
            pool_api.shutdown(recipe.rollout_pool.name)
    finally:
        ray_runtime.shutdown()


def start_learner_early(recipe: Recipe) -> Future[LearnerGroup]:
    """The learner's ranks (Megatron's model, built from the model's files) started in a thread while the pool's
    engines start: a CPU run has no GPU to share or colocation group to wait for (:func:`run_embedded`)."""
    model_path = resolve_policy_model(recipe.policy)  # made once, here, before the pool and the ranks read it
    starter = ThreadPoolExecutor(1, thread_name_prefix="learner-start")
    try:
        return starter.submit(LearnerGroup, recipe, model_path)
    finally:
        starter.shutdown(wait=False)  # the ranks go on starting; the thread ends with them


def discard_learner(early: Future[LearnerGroup]) -> None:
    """Stop ranks started early for a pool that did not start; their own error, if any, gives way to the pool's."""
    try:
        early.result().shutdown()
    except Exception:  # noqa: BLE001 - the pool's failure is the one reported
        pass
