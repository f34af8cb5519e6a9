"""Hangs through the real pool: a reward function that never returns.

Its samples fail after ``env.reward_timeout_s`` (never scored 0), every group
then has fewer than two valid samples and is dropped and replaced, and the
learner's wait for the step ends with a ``StepTimeout`` naming the pool —
bounded, never forever. Slow (a second engine start), so not in the default suite.
"""
from __future__ import annotations

import time

import pytest

from test_pool_and_loops import tiny_recipe

pytestmark = [pytest.mark.fault, pytest.mark.slow]

POOL_NAME = "inflight-hang-pool"


@pytest.mark.timeout(600)
def test_hanging_reward_fails_samples_and_the_step_wait_is_bounded(ray_cluster, tmp_path):
    from services import pool as pool_api
    from services.app import deploy_pool
    from services.job import LearnerJob, StepTimeout
    from services.learner_actor import LearnerGroup
    from services.model_source import resolve_model

    hang = tmp_path / "hang.py"
    hang.write_text("import time\n\ndef reward(batch):\n    time.sleep(3600)\n")
    recipe = tiny_recipe(f"rollout_pool.name={POOL_NAME}", f"env.reward_fn={hang}:reward", "env.reward_timeout_s=2",
                         "policy.generation.request_timeout_s=10", "policy.generation.max_retries=1",
                         "grpo.max_num_steps=1", "grpo.async_grpo.enabled=false")
    deploy_pool(recipe, tmp_path)
    model = resolve_model(recipe.policy.model_name)
    learner = LearnerGroup(recipe, model)
    job = LearnerJob(recipe, model, pool_api.connect(POOL_NAME), learner, tmp_path / "run", resume=False)
    try:
        job.start(prefetch=False)
        job.schedule(1)
        t0 = time.monotonic()
        with pytest.raises(StepTimeout, match=f"pool '{POOL_NAME}': only 0/4 groups for step 1"):
            job.collect(1)
        waited = time.monotonic() - t0
        assert waited <= job.collect_timeout_s + 30
        summary = job.ledger.summary()
        assert summary["trained"] == 0
        assert summary["dropped_by_reason"].get("too_few_valid_samples", 0) >= 4  # replaced, never scored 0
        assert job.buffer.drops["too_few_valid_samples"] == summary["dropped_by_reason"]["too_few_valid_samples"]
    finally:
        job.close()
        learner.shutdown()
        pool_api.shutdown(POOL_NAME)
