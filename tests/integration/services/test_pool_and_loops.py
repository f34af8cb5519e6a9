"""The product through real Ray Serve, vLLM and Megatron-Core: a deployed pool,
its HTTP endpoints, short async and sync runs, and a learner killed and re-attached.

One pool is deployed per module (engine start is the expensive part); each test
attaches its own learner job to it, as users do: in-process jobs on the session's
one-rank learner, built again for each (``fresh_learner``), the killed and
re-attached ones as ``inflight learner attach`` subprocesses.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.recipe.config import load_recipe

TOKEN = "test-admin-token"
REQUIRED_METRICS = {"inflight_policy_version", "inflight_trajectory_age_steps", "inflight_buffer_groups",
                    "inflight_generation_tokens", "inflight_refit_seconds", "inflight_refit_bytes",
                    "inflight_step_seconds", "inflight_rejected_messages", "inflight_engine_up"}


def tiny_recipe(*overrides: str):
    return load_recipe(None, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                              "checkpointing.save_period=1", "logger.tensorboard_enabled=false", *overrides])


@pytest.fixture(scope="module")
def pool(ray_cluster, tmp_path_factory):
    """A deployed rollout pool; yields (recipe, base URL)."""
    from services import pool as pool_api
    from services.app import deploy_pool

    os.environ["INFLIGHT_ADMIN_TOKEN"] = TOKEN
    recipe = tiny_recipe("rollout_pool.route_prefix=/pool")  # its own path: the session's data pool has "/"
    deployed = deploy_pool(recipe, tmp_path_factory.mktemp("pool"))
    assert deployed.status.ready, deployed
    yield recipe, deployed.http
    pool_api.shutdown(recipe.rollout_pool.name)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_lent(fresh_learner, recipe, pool_name: str, run_dir: Path) -> Path:
    """``run_learner`` (``resume=False``) on the session's one-rank learner, reset for this run."""
    from concurrent.futures import Future

    from services.app import run_learner
    from services.models.variant import resolve_policy_model

    early: Future = Future()
    early.set_result(fresh_learner(recipe, resolve_policy_model(recipe.policy)))
    return run_learner(recipe, pool_name, run_dir, resume=False, early=early)


def scrape(url: str) -> dict[str, list]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_health_ready_status_and_metrics(pool):
    _, url = pool
    assert httpx.get(f"{url}/healthz", timeout=10).json()["status"] == "ok"
    ready = httpx.get(f"{url}/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["ready"] is True
    status = httpx.get(f"{url}/v1/status", timeout=10).json()
    assert status["name"] == "inflight-pool" and len(status["engines"]) == 1
    assert REQUIRED_METRICS <= set(scrape(url)), "missing Prometheus metrics"


def test_admin_endpoints_need_the_token(pool):
    _, url = pool
    assert httpx.post(f"{url}/v1/admin/pause", timeout=10).status_code == 401
    bad = httpx.post(f"{url}/v1/admin/pause", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert bad.status_code == 401 and "Bearer" in bad.json()["detail"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{url}/v1/admin/pause", headers=auth, timeout=10).json() == {"paused": True}
    assert httpx.post(f"{url}/v1/admin/resume", headers=auth, timeout=10).json()["paused"] is False


def test_async_lag1_run(pool, fresh_learner, tmp_path):
    recipe, url = pool
    run_lent(fresh_learner, tiny_recipe("grpo.max_num_steps=4"), recipe.rollout_pool.name, tmp_path)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in got] == [1, 2, 3, 4]
    assert got[0]["trajectory_age_mean"] == 0.0                          # step 1 has nothing to overlap with
    assert all(r["trajectory_age_mean"] == 1.0 for r in got[1:])          # lag-1 steady state
    assert all(r["trajectory_age_max"] <= 1 for r in got)                 # never older than the bound
    assert all(r["gen_kl_error"] < 1.5e-3 for r in got)                   # parity probe after every refit
    assert all(r["parity_max_abs_logprob_diff"] < 1e-3 for r in got)
    metrics = scrape(url)
    assert metrics["inflight_policy_version"][0].value == 4
    ages = {s.labels.get("le"): s.value for s in metrics["inflight_trajectory_age_steps"] if s.name.endswith("_bucket")}
    assert ages["0.0"] >= 4 and ages["1.0"] >= 16                         # 4 groups at age 0, 12 at age 1


def test_async_run_generates_max_trajectory_age_steps_ahead(pool, fresh_learner, tmp_path):
    """A = 2: prompts of step k+2 are scheduled when step k starts (engines on v(k-1)), so once the pipeline is
    full every trained group is exactly 2 versions old, and none is older."""
    recipe, _ = pool
    run_lent(fresh_learner, tiny_recipe("grpo.max_num_steps=5", "grpo.async_grpo.max_trajectory_age_steps=2"),
             recipe.rollout_pool.name, tmp_path)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in got] == [1, 2, 3, 4, 5]
    assert [r["trajectory_age_mean"] for r in got] == [0.0, 1.0, 2.0, 2.0, 2.0]  # warm-up (steps 1-2), then A
    assert all(r["trajectory_age_max"] <= 2 for r in got)                 # never older than the bound
    assert all(r.get("dropped_stale", 0) == 0 for r in got)
    assert all(r["gen_kl_error"] < 1.5e-3 for r in got)


def test_sync_run_is_on_policy(pool, fresh_learner, tmp_path):
    recipe, _ = pool
    run_lent(fresh_learner, tiny_recipe("grpo.max_num_steps=2", "grpo.async_grpo.enabled=false"),
             recipe.rollout_pool.name, tmp_path)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2]
    assert all(abs(r["probs_ratio_mean"] - 1.0) < 1e-6 for r in got)
    assert all(r["trajectory_age_max"] == 0 for r in got)
    assert all(r["train_gen_kl_error"] < 1.5e-3 for r in got)  # sync: generated by the same weights


def test_sync_run_with_two_learner_ranks(pool, tmp_path):
    """A learner job of two Megatron ranks (data parallel, gloo): every rank takes part in the export, rank 0
    sends it (a rank other than 0 used to fail the push: ``export_weights`` unpacked its None)."""
    from services.app import run_learner

    recipe, _ = pool
    run_learner(tiny_recipe("grpo.max_num_steps=2", "grpo.async_grpo.enabled=false", "rollout_pool.learner_gpus=2"),
                recipe.rollout_pool.name, tmp_path, resume=False)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2] and [r["policy_version"] for r in got] == [1, 2]
    assert all(r["train_gen_kl_error"] < 1.5e-3 for r in got)
    assert all(r["gen_kl_error"] < 1.5e-3 for r in got)  # what the engine installed is what both ranks trained


def test_async_run_with_collective_refit(pool, fresh_learner, tmp_path):
    """Weights go learner → engine worker over a gloo weight group instead of the object store."""
    recipe, url = pool
    run_lent(fresh_learner, tiny_recipe("grpo.max_num_steps=3", "policy.refit_transport=collective"),
             recipe.rollout_pool.name, tmp_path)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["policy_version"] for r in got] == [1, 2, 3]
    assert all(r["trajectory_age_mean"] == 1.0 for r in got[1:])
    assert all(r["gen_kl_error"] < 1.5e-3 for r in got)                   # what the engine installed is v
    assert all(r["parity_max_abs_logprob_diff"] < 1e-3 for r in got)
    assert all(r["refit_bytes"] > 0 and r["refit_pause_s"] >= r["refit_install_s"] > 0 for r in got)
    assert all(0 < r["refit_send_s"] < r["refit_s"] and 0 < r["refit_pool_s"] < r["refit_s"] for r in got)
    # the pool's part holds its calls to the engines, and those the engine actors' own answers
    assert all(0 < r["refit_engine_s"] <= r["refit_engine_call_s"] <= r["refit_pool_s"] for r in got)
    assert all(r["refit_engine_loop_lag_s"] >= 0 and r["refit_pool_loop_lag_s"] >= 0 for r in got)
    status = httpx.get(f"{url}/v1/status", timeout=10).json()
    assert status["version"] == 3 and all(e["version"] == 3 for e in status["engines"].values())
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    value = lambda name: float(re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.M).group(1))  # noqa: E731
    # the first push decides plain load vs reload; the CPU backend repacks its linear weights, so it reloads
    checked = value('inflight_weight_installs_total{path="checked"}')
    reloaded = value('inflight_weight_installs_total{path="reload"}')
    assert checked == 1 and reloaded >= 3 and 'path="direct"' not in metrics
    assert value("inflight_refit_pause_seconds_count") == checked + reloaded


def _attach(ray_address: str, run_dir: Path, steps: int, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS=ray_address, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "services.cli", "learner", "attach", "--pool", "inflight-pool",
           "--run-dir", str(run_dir), "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
           "checkpointing.save_period=1", "logger.tensorboard_enabled=false", f"grpo.max_num_steps={steps}",
           *overrides]
    log = open(run_dir / f"attach-{steps}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_learner_killed_then_reattached_resumes_from_checkpoint(pool, ray_cluster, tmp_path):
    _, url = pool
    first = _attach(ray_cluster, tmp_path, steps=50)
    deadline = time.monotonic() + 300
    latest = tmp_path / "results" / "checkpoints" / "latest"

    def checkpointed() -> int:  # a step's row is written before its checkpoint: wait for the checkpoint
        try:
            return int(latest.read_text().split("_")[1])
        except (OSError, IndexError, ValueError):  # not written yet, or being written
            return 0

    while checkpointed() < 3:
        assert first.poll() is None, (tmp_path / "attach-50.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "learner made no progress"
        time.sleep(1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    done = rows(tmp_path)
    ckpt_step = checkpointed()
    assert ckpt_step >= 3 and len(done) >= ckpt_step
    for _ in range(3):  # the pool keeps serving while no learner is attached
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        time.sleep(2)
    second = _attach(ray_cluster, tmp_path, steps=ckpt_step + 2)
    assert second.wait(300) == 0, (tmp_path / f"attach-{ckpt_step + 2}.log").read_text()[-3000:]
    after = rows(tmp_path)
    assert [r["step"] for r in after] == list(range(1, ckpt_step + 3))
    assert after[ckpt_step]["policy_version"] == ckpt_step + 1               # continues at the right version
    assert [r["step"] for r in after[:ckpt_step]] == [r["step"] for r in done[:ckpt_step]]
    status = httpx.get(f"{url}/v1/status", timeout=10).json()
    assert status["version"] == ckpt_step + 2


def _final_weights(run_dir: Path, step: int) -> dict:
    import torch

    from learner.checkpoint import rank_file
    path = rank_file(run_dir / "results" / "checkpoints" / f"step_{step:06d}", 0)
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.mark.fault
def test_killed_and_resumed_sync_run_ends_with_the_weights_of_an_uninterrupted_one(pool, ray_cluster, tmp_path):
    """Deterministic mode: seeded sampling (per prompt, sample and attempt), seeded data order, sync (every
    group generated by the previous version) and a fixed training order."""
    steps, sync = 4, "grpo.async_grpo.enabled=false"
    whole, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    whole.mkdir(), killed.mkdir()
    assert _attach(ray_cluster, whole, steps, sync).wait(300) == 0, (whole / f"attach-{steps}.log").read_text()[-3000:]
    first = _attach(ray_cluster, killed, steps, sync)
    deadline = time.monotonic() + 300
    while len(rows(killed)) < 2:
        assert first.poll() is None, (killed / f"attach-{steps}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "learner made no progress"
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(30)
    resumed_from = (killed / "results" / "checkpoints" / "latest").read_text()
    assert int(resumed_from.split("_")[1]) < steps, "the kill came after the last step"
    second = _attach(ray_cluster, killed, steps, sync)
    assert second.wait(300) == 0, (killed / f"attach-{steps}.log").read_text()[-3000:]
    assert [r["step"] for r in rows(killed)][-1] == steps
    import torch
    a, b = _final_weights(whole, steps), _final_weights(killed, steps)
    assert a.keys() == b.keys()
    diffs = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a if isinstance(a[k], torch.Tensor)}
    worst = max(diffs.values())
    identical = all(torch.equal(a[k], b[k]) for k in diffs)
    print(f"\nkilled after {resumed_from}, resumed: final weights {'bit-identical' if identical else 'differ'} "
          f"to the uninterrupted run (max |diff| {worst:.3g} over {len(diffs)} tensors)")
    assert worst <= 1e-6, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


class PoisonedSteps:
    """The job's learner, except that in the ``train_step`` calls numbered in ``calls`` (1-based) the first group's
    rewards overflow its advantage: 1.7e308 is finite, so the protocol takes it, but the group's mean is not, so
    the loss is non-finite and the learner skips the step, as it does for any non-finite loss or gradient."""

    def __init__(self, learner, calls: set[int]):
        self.learner, self.calls, self.train_calls = learner, calls, 0

    def train_step(self, group_refs: list, images: dict | None = None) -> dict:
        self.train_calls += 1
        if self.train_calls in self.calls:
            group_refs = self._poisoned(group_refs)
        return self.learner.train_step(group_refs, images)

    def __getattr__(self, name: str):
        return getattr(self.learner, name)

    @staticmethod
    def _poisoned(refs: list) -> list:
        import ray

        from protocol import TrajectoryGroup, decode, encode

        group = decode(ray.get(refs[0]), expect=TrajectoryGroup)
        for i, t in enumerate(group.valid):  # distinct (all-equal rewards give zero advantage), sum overflows
            t.reward = 1.7e308 - i * 1e307
        return [ray.put(encode(group)), *refs[1:]]


def _run_poisoned(fresh_learner, recipe, run_dir: Path, calls: set[int]):
    """Run the recipe's loop against the module's pool with :class:`PoisonedSteps` around the session's learner;
    returns (job, error raised)."""
    from services import pool as pool_api
    from services.job.learner_job import LearnerJob
    from services.job.loop_async import run_async
    from services.job.loop_sync import run_sync
    from services.models.source import resolve_model

    model_path = resolve_model(recipe.policy.model_name)
    learner = fresh_learner(recipe, model_path)
    job = LearnerJob(recipe, model_path, pool_api.connect(recipe.rollout_pool.name), PoisonedSteps(learner, calls),
                     run_dir, resume=False)
    try:
        if recipe.grpo.async_grpo.enabled:
            run_async(job)
        else:
            run_sync(job, colocated=False)
        return job, None
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return job, exc
    finally:
        job.close()
        learner.shutdown()


def _skipped_steps_counter(url: str) -> float:
    return sum(s.value for s in scrape(url).get("inflight_learner_skipped_steps", []) if s.name.endswith("_total"))


def test_async_run_survives_a_skipped_learner_step(pool, fresh_learner, tmp_path):
    """A skipped step (non-finite loss) is counted, pushes nothing (the engines keep v1: a push of the same
    version used to be refused three times and kill the run), drops its prompts as ``step_skipped``; the
    prompts prefetched for the next step are trained."""
    recipe, url = pool
    before = _skipped_steps_counter(url)
    job, error = _run_poisoned(fresh_learner, tiny_recipe("grpo.max_num_steps=4"), tmp_path, calls={2})
    assert error is None, f"{type(error).__name__}: {error}"
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["policy_version"] for r in got] == [1, 1, 2, 3]
    assert [r["step_skipped"] for r in got] == [0, 1, 0, 0]
    assert got[1]["skip_reason"] == "non-finite loss" and "skip_reason" not in got[2]
    assert got[1]["refit_bytes"] == 0 and all(r["refit_bytes"] > 0 for r in got[2:])
    assert all(r["gen_kl_error"] < 1.5e-3 for r in got)  # the probe after the skip compares v1 with v1
    assert _skipped_steps_counter(url) == before + 1
    assert httpx.get(f"{url}/v1/status", timeout=10).json()["version"] == 3
    summary = job.book.ledger.summary()
    assert summary.dropped_by_reason.get("step_skipped") == recipe.grpo.num_prompts_per_step
    assert summary.trained == 3 * recipe.grpo.num_prompts_per_step


def test_sync_run_stops_after_max_consecutive_skipped_steps_with_the_reason(pool, fresh_learner, tmp_path):
    """Skips at steps 2, 4 and 5 with ``grpo.max_consecutive_skipped_steps=2``: step 3 trains and resets the
    count, steps 4-5 are two in a row and stop the job, naming the learner's reason."""
    from services.job.skips import SkippedStepsError

    recipe, url = pool
    before = _skipped_steps_counter(url)
    _, error = _run_poisoned(fresh_learner, tiny_recipe("grpo.max_num_steps=6", "grpo.async_grpo.enabled=false",
                                         "grpo.max_consecutive_skipped_steps=2"), tmp_path, calls={2, 4, 5})
    assert isinstance(error, SkippedStepsError), f"{type(error).__name__}: {error}"
    assert "2 steps in a row skipped (steps 4..5" in str(error) and "last reason: non-finite loss" in str(error)
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]  # the rows of the skipped steps are written first
    assert [r["policy_version"] for r in got] == [1, 1, 2, 2, 2]
    deadline = time.monotonic() + 30
    while _skipped_steps_counter(url) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.5)  # report_step is not awaited
    assert _skipped_steps_counter(url) == before + 3
