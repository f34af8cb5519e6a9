"""Hangs through the real pool: a reward function that never returns, and a generation that never finishes.

- A reward that hangs: its samples fail after ``env.reward_timeout_s`` (never
  scored 0), every group then has fewer than two valid samples and is dropped
  and replaced.
- A generation that cannot finish in time (``policy.generation.request_timeout_s``
  far below what ``max_new_tokens`` needs): every attempt is aborted in the
  engine at its deadline and retried ``max_retries`` times, then the sample
  fails with the reason (``reward=None``, never 0); the groups are dropped and
  counted, and their prompts replaced.

In both the learner's wait for the step ends with a ``StepTimeout`` naming the
pool and what was dropped meanwhile — bounded, never forever. Slow (each test
deploys its own pool: a recipe's generation settings are fixed per pool), so
not in the default suite.
"""
from __future__ import annotations

import re
import time
from contextlib import contextmanager

import pytest

from test_pool_and_loops import tiny_recipe

pytestmark = [pytest.mark.fault, pytest.mark.slow]

POOL_NAME = "inflight-hang-pool"
POOL = (f"rollout_pool.name={POOL_NAME}", "rollout_pool.route_prefix=/hang-pool")
"""Its name, and its own path on the proxy (the session's data pool has "/")."""


@contextmanager
def attached_job(recipe, run_dir):
    """Deploy a pool for ``recipe``, attach a real learner job to it; shut both down afterwards."""
    from services import pool as pool_api
    from services.app import deploy_pool
    from services.job.learner_job import LearnerJob
    from services.job.learner_group import LearnerGroup
    from services.models.source import resolve_model

    deploy_pool(recipe, run_dir)
    learner = job = None
    try:
        model = resolve_model(recipe.policy.model_name)
        learner = LearnerGroup(recipe, model)
        job = LearnerJob(recipe, model, pool_api.connect(POOL_NAME), learner, run_dir / "run", resume=False)
        yield job
    finally:
        if job is not None:
            job.close()
        if learner is not None:
            learner.shutdown()
        pool_api.shutdown(POOL_NAME)


def first_step_times_out(job):
    """Start ``job``, schedule step 1 and collect it until the StepTimeout; returns (seconds waited, the error)."""
    from services.job.learner_job import StepTimeout

    job.start(prefetch=False)
    job.schedule(1)
    t0 = time.monotonic()
    with pytest.raises(StepTimeout, match=f"pool '{POOL_NAME}': only 0/4 groups for step 1") as err:
        job.collect(1)
    return time.monotonic() - t0, err


@pytest.mark.timeout(600)
def test_hanging_reward_fails_samples_and_the_step_wait_is_bounded(ray_cluster, tmp_path):
    hang = tmp_path / "hang.py"
    hang.write_text("import time\n\ndef reward(batch):\n    time.sleep(3600)\n")
    recipe = tiny_recipe(*POOL, f"env.reward_fn={hang}:reward", "env.reward_timeout_s=2",
                         "policy.generation.request_timeout_s=10", "policy.generation.max_retries=1",
                         "rollout_pool.channel_send_timeout_s=5", "grpo.max_num_steps=1",
                         "grpo.async_grpo.enabled=false")
    with attached_job(recipe, tmp_path) as job:
        waited, err = first_step_times_out(job)
        print(f"hanging reward: StepTimeout after {waited:.1f} s: {err.value}")
        assert waited <= job.collect_timeout_s + 30
        assert "last failed sample: reward:" in str(err.value)
        summary = job.book.ledger.summary()
        assert summary.trained == 0
        assert summary.dropped_by_reason.get("too_few_valid_samples", 0) >= 4  # replaced, never scored 0
        assert job.book.buffer.drops["too_few_valid_samples"] == summary.dropped_by_reason["too_few_valid_samples"]


REQUEST_TIMEOUT_S = 0.01  # the first output of a request alone takes longer on CPU; 100 tokens take far longer
MAX_RETRIES = 1


@pytest.mark.timeout(600)
def test_generation_that_never_finishes_is_aborted_retried_failed_and_the_step_wait_is_bounded(ray_cluster, tmp_path):
    from protocol import ProtocolError, TrajectoryGroup, decode
    from services import pool as pool_api

    recipe = tiny_recipe(*POOL, "policy.max_total_sequence_length=256",
                         "policy.generation.max_new_tokens=200", f"policy.generation.request_timeout_s={REQUEST_TIMEOUT_S}",
                         f"policy.generation.max_retries={MAX_RETRIES}",
                         f"rollout_pool.channel_send_timeout_s={REQUEST_TIMEOUT_S / 2}", "grpo.max_num_steps=1",
                         "grpo.async_grpo.enabled=false",
                         "logger.parity_probe_sequences=0")  # the probe's scoring shares the 0.01 s request timeout
    with attached_job(recipe, tmp_path) as job:
        groups: list[TrajectoryGroup] = []
        receive = job.book.receive

        def record(data: bytes) -> None:  # keep what arrived, then let the job account for it as usual
            try:
                msg = decode(data)
            except ProtocolError:
                msg = None
            if isinstance(msg, TrajectoryGroup):
                groups.append(msg)
            receive(data)

        job.book.receive = record
        waited, err = first_step_times_out(job)
        stats = pool_api.connect(POOL_NAME).engine_stats.remote().result(timeout_s=60)
        summary = job.book.ledger.summary()
        samples = [t for g in groups for t in g.trajectories]
        failed = [t for t in samples if t.finish_reason == "error"]
        aborts, retries = (sum(s.counters[k] for s in stats.values()) for k in ("aborts", "retries"))
        print(f"never-finishing generation: StepTimeout after {waited:.1f} s ({err.value}); {len(groups)} groups, "
              f"{len(failed)}/{len(samples)} samples failed; engine aborts {aborts}, retries {retries}; "
              f"ledger {summary}")

        assert waited <= job.collect_timeout_s + 30, "the learner's wait was not bounded"
        assert "too_few_valid_samples" in str(err.value), "the timeout does not say what was dropped"
        assert f"last failed sample: timeout after {REQUEST_TIMEOUT_S:g}s" in str(err.value), "nor why"
        assert len(groups) >= 4 and samples
        assert failed == samples, [t.finish_reason for t in samples if t.finish_reason != "error"]
        pattern = re.compile(rf"timeout after {REQUEST_TIMEOUT_S:g}s \(request aborted\) "
                             rf"\(after {MAX_RETRIES + 1} attempts\)")
        assert all(t.reward is None and pattern.fullmatch(t.error) for t in failed), {t.error for t in failed}
        assert all(t.response_ids.size == 0 for t in failed)
        s = next(iter(stats.values()))
        c = s.counters
        assert c["aborts"] >= len(failed) * (MAX_RETRIES + 1) and c["retries"] >= len(failed) * MAX_RETRIES
        assert c["samples_ok"] == 0 and c["samples_failed"] >= len(failed)
        assert summary.trained == 0 and len(job.book.buffer) == 0
        assert summary.dropped_by_reason.get("too_few_valid_samples", 0) >= 4
        assert summary.dropped_by_reason["too_few_valid_samples"] == job.book.buffer.drops["too_few_valid_samples"]
        assert summary.scheduled == summary.dropped + summary.pending  # each drop replaced, none lost
