"""Scaling a real pool (Ray Serve + vLLM) while an async learner (Megatron-Core) trains on CPU (issue 20, item 5).

A pool of one engine (the tiny model) is deployed for the module. The test runs the async lag-1 loop
(services/job/loop_async.py, spelled out so that the run can end once the scaling is done) while a thread:

- checks the admin endpoint first: no token -> 401, a bad body or value -> 422 naming the field;
- scales the pool to 2 engines through ``POST /v1/admin/scale`` once step 1 is written: the new engine boots
  ("starting" in ``/v1/status``), installs the pool's current version, then takes work; every group it
  delivers is labelled with versions no older than the pool's version when the request came (never the
  model on disk), and the parity probe finds it serving the learner's weights;
- scales back to 1 through the handle (``RolloutPool.scale``) while the new engine has a batch in vLLM, with
  a drain bound of 0 s: its batches are handed back to engine 0.

The run then trains two more steps: every prompt is trained once or dropped with a reason (0 lost, 0 trained
twice: the ledger raises on a second training), and the removed engine's actor is gone.
"""
from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from test_faults import GroupLog
from test_pool_and_loops import rows, scrape, tiny_recipe

from services.job.run_log import StepTimer

POOL_NAME = "inflight-scale-pool"
TOKEN = "scale-admin-token"
POOL_OVERRIDES = (f"rollout_pool.name={POOL_NAME}", "rollout_pool.num_engines=1",
                  "rollout_pool.route_prefix=/scale-pool")  # its own path: the session's data pool has "/"
ENGINE_0, ENGINE_1 = f"{POOL_NAME}-engine-0", f"{POOL_NAME}-engine-1"
MAX_STEPS = 200  # the run ends two steps after the scale-down, or at RUN_BUDGET_S
RUN_BUDGET_S = 300.0
GROUPS_FROM_NEW_ENGINE = 2


@pytest.fixture(scope="module")
def pool(ray_cluster, tmp_path_factory):
    """A deployed one-engine pool; yields (recipe, DeploymentHandle, base URL)."""
    from services import pool as pool_api
    from services.app import deploy_pool

    os.environ["INFLIGHT_ADMIN_TOKEN"] = TOKEN
    recipe = tiny_recipe(*POOL_OVERRIDES)
    deployed = deploy_pool(recipe, tmp_path_factory.mktemp("scale-pool"))
    assert deployed.status.ready and list(deployed.status.engines) == [ENGINE_0], deployed
    yield recipe, pool_api.connect(POOL_NAME), deployed.http
    pool_api.shutdown(POOL_NAME)


def _status(handle) -> dict:
    """The pool's status as ``/v1/status`` serves it."""
    return handle.status.remote().result(timeout_s=30).to_json()


class Scaler(threading.Thread):
    """1 -> 2 once step 1 is written (HTTP), then 2 -> 1 once the new engine has delivered groups and has a batch
    in vLLM (the handle); records what it saw."""

    def __init__(self, handle, url: str, run_dir, received: GroupLog):
        super().__init__(daemon=True)
        self.handle, self.url, self.run_dir, self.received = handle, url, run_dir, received
        self.states_seen: set[str] = set()
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            self.error = exc
        finally:
            self.done.set()

    def _wait(self, condition, what: str, timeout_s: float = RUN_BUDGET_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)

    def _run(self) -> None:
        import ray

        admin = f"{self.url}/v1/admin/scale"
        assert httpx.post(admin, json={"engines": 2}, timeout=30).status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for body, says in (({"engines": 0}, "rollout_pool.num_engines"), ({"engines": 2000}, "1024"),
                           ({"engines": "two"}, "engines"), ({"engines": 2, "extra": 1}, "extra")):
            r = httpx.post(admin, json=body, headers=auth, timeout=30)
            assert r.status_code == 422 and says in r.json()["detail"], (body, r.status_code, r.text)

        self._wait(lambda: len(rows(self.run_dir)) >= 1, "step 1")
        self.version_at_request = _status(self.handle)["version"]
        t0 = time.monotonic()
        request = threading.Thread(target=self._scale_up, args=(admin, auth), daemon=True)
        request.start()
        self.version_while_starting = self.version_at_request
        while request.is_alive():  # what /v1/status says of the new engine while it is added
            status = httpx.get(f"{self.url}/v1/status", timeout=30).json()
            state = status["engines"].get(ENGINE_1)
            if state:
                self.states_seen.add(state["state"])
                if state["state"] == "starting":  # the pool's version before the new engine could take work
                    self.version_while_starting = status["version"]
            time.sleep(0.2)
        self.up_s = time.monotonic() - t0
        assert self.up_reply.status_code == 200, self.up_reply.text
        self.up_result = self.up_reply.json()

        self._wait(lambda: len(self.from_new_engine()) >= GROUPS_FROM_NEW_ENGINE, "groups from the new engine")
        actor = ray.get_actor(ENGINE_1, namespace="inflight")
        self._wait(lambda: ray.get(actor.stats.remote(), timeout=30).counters.sampling.requests_running > 0,
                   "a batch of the new engine in vLLM")
        t0 = time.monotonic()
        self.down_result = self.handle.scale.remote(1, 0.0).result(timeout_s=300)
        self.down_s = time.monotonic() - t0
        self.steps_at_down = len(rows(self.run_dir))

    def _scale_up(self, admin: str, auth: dict) -> None:
        self.up_reply = httpx.post(admin, json={"engines": 2}, headers=auth, timeout=600)

    def from_new_engine(self) -> list[tuple[str, float, int]]:
        return [g for g in self.received.groups if g[0] == ENGINE_1]


@pytest.mark.timeout(600)
def test_scale_1_to_2_to_1_during_an_async_run_loses_no_prompt_and_trains_none_twice(pool, fresh_learner, tmp_path):
    import ray

    from services.job.learner_job import LearnerJob
    from services.models.source import resolve_model
    from services.pool.fleet import ScaleRequestError

    recipe, handle, url = pool
    with pytest.raises(ScaleRequestError, match="cannot have 0 engines: rollout_pool.num_engines"):
        handle.scale.remote(0).result(timeout_s=60)  # through the handle: the same error, not a traceback text
    run_recipe = tiny_recipe(*POOL_OVERRIDES, f"grpo.max_num_steps={MAX_STEPS}", "checkpointing.enabled=false")
    model_path = resolve_model(recipe.policy.model_name)
    learner = fresh_learner(run_recipe, model_path)
    job = LearnerJob(run_recipe, model_path, handle, learner, tmp_path, resume=False)
    received = GroupLog(job)
    scaler = Scaler(handle, url, tmp_path, received)
    requeued_before = _status(handle)["requeued_prompts"]
    t_start = time.monotonic()
    try:
        scaler.start()
        job.start(prefetch=True)
        step = 0
        while True:
            step += 1
            final = (step == MAX_STEPS or time.monotonic() - t_start > RUN_BUDGET_S or scaler.error is not None
                     or (scaler.done.is_set() and step >= scaler.steps_at_down + 2))
            timer = StepTimer()
            if not final:
                job.schedule(step + 1)
            metrics = job.train(job.collect(step))
            job.push_weights()
            job.finish_step(step, metrics, timer)
            if final:
                break
        scaler.join(60)
    finally:
        job.close()
        learner.shutdown()
    if scaler.error:
        raise scaler.error
    summary = job.book.ledger.summary()
    new_groups = scaler.from_new_engine()
    status = _status(handle)
    print(f"\nscale 1 -> 2: {scaler.up_s:.1f} s (HTTP, states seen {sorted(scaler.states_seen)}), new engine at "
          f"v{min(g[2] for g in new_groups)}+ (pool at v{scaler.version_at_request} when asked, "
          f"v{scaler.version_while_starting} while it started), "
          f"{len(new_groups)} groups from it; scale 2 -> 1: {scaler.down_s:.1f} s, "
          f"{scaler.down_result.handed_back_prompts} prompts handed back; {step} steps in "
          f"{time.monotonic() - t_start:.0f} s; requeued {status['requeued_prompts'] - requeued_before}; "
          f"ledger {summary}; rejected {job.book.rejected}")

    assert scaler.up_result["added"] == [ENGINE_1] and scaler.up_result["engines"] == 2
    assert "starting" in scaler.states_seen
    # It takes work only at the pool's version, which never goes back: none of its tokens may be older than the
    # pool's version while it was still starting (the model on disk is version 0).
    assert min(g[2] for g in new_groups) >= max(1, scaler.version_while_starting), \
        "the new engine took work before it held the pool's version"
    probed = [r for r in rows(tmp_path) if ENGINE_1 in r.get("parity_gen_kl_by_engine", {})]
    assert probed and all(r["parity_gen_kl_by_engine"][ENGINE_1] < 1.5e-3 for r in probed), probed[:1]

    assert scaler.down_result.removed == [ENGINE_1] and scaler.down_result.engines == 1
    assert list(status["engines"]) == [ENGINE_0] and status["engines"][ENGINE_0]["state"] == "up"
    with pytest.raises(ValueError):
        ray.get_actor(ENGINE_1, namespace="inflight")
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, step + 1))
    assert summary.trained == step * run_recipe.grpo.num_prompts_per_step  # none twice (else LedgerError)
    assert summary.pending == 0, f"prompts neither trained nor dropped: {job.book.ledger.pending()}"
    assert set(summary.dropped_by_reason) <= {"stale", "too_few_valid_samples"}, summary

    samples = scrape(url)
    events = {(s.labels["direction"], s.labels["outcome"]): s.value
              for s in samples["inflight_pool_scale_events"] if s.name.endswith("_total")}
    assert events[("up", "done")] == 1 and events[("down", "done")] == 1
    assert {s.labels["state"]: s.value for s in samples["inflight_engines"]}["up"] == 1
