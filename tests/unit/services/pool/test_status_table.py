"""``inflight pool status`` renders the pool's status dict as tables; the dict is built the way the deployment
builds it (``RolloutPool.status`` on a fleet and a dispatcher of fake engines)."""
from __future__ import annotations

import asyncio
import types

from pool_fakes import FakeEngine, pool_of

from protocol.pool_replies import AttachedLearner
from services.pool.deployment import RolloutPool
from services.pool.status_table import fmt_bytes, fmt_seconds, render


def status_of(pool, report: dict | None = None) -> dict:
    """The JSON of ``RolloutPool.status`` itself (the class under Serve's deployment; what ``inflight pool status``
    renders), on the parts of ``pool``, after the learner's step ``report`` went through
    ``RolloutPool.report_step``."""
    me = types.SimpleNamespace(name=pool.fleet.name, fleet=pool.fleet, dispatcher=pool.dispatcher,
                               metrics=pool.fleet.metrics, _last_report=None, _ensure_started=lambda: None,
                               history=types.SimpleNamespace(record=lambda *args: None))
    cls = RolloutPool.func_or_class  # type: ignore[attr-defined]
    if report is not None:
        asyncio.run(cls.report_step(me, {**report, "trajectory_ages": [1, 1], "rejected": {}}))
    return asyncio.run(cls.status(me)).to_json()


def test_table_shows_engines_learner_and_refit():
    pool = pool_of({"engine-0": FakeEngine(True), "engine-1": FakeEngine(True)})
    pool.fleet.version = 2
    pool.fleet.table.set_version("engine-0", 2)
    pool.fleet.mark_down("engine-1", RuntimeError("engine died:\nCUDA error"))
    pool.dispatcher.learner = AttachedLearner(id="learner-7", since=1000.0)
    report = {"step": 7, "reward_mean": 0.53125, "gen_kl_error": 1.5e-4, "refit_s": 0.31,
              "refit_bytes": 3 * 1024 ** 2, "refit_pause_s": 0.012}
    text = render(status_of(pool, report), now=1100.0)
    lines = text.splitlines()
    assert lines[0].startswith(f"pool {pool.fleet.name}: version 2, not ready")
    row0 = next(li for li in lines if li.startswith("engine-0")).split()
    assert row0[:4] == ["engine-0", "up", "2", "1"]
    row1 = next(li for li in lines if li.startswith("engine-1"))
    assert "down" in row1 and "RuntimeError: engine died: CUDA error" in row1  # one line
    assert "attached      yes, 1m40s ago" in text and "learner-7" in text
    assert "step          7" in text and "0.5312" in text
    assert "310ms" in text and "3.0 MiB" in text and "12ms" in text
    assert "recent errors" not in text


def test_table_without_learner_or_report():
    pool = pool_of({"engine-0": FakeEngine(True)})
    pool.fleet.errors.append("refit v1 timeout: {'engine-0': 'TimeoutError'}")
    text = render(status_of(pool))
    assert "ready" in text.splitlines()[0] and "not ready" not in text.splitlines()[0]
    assert "attached      no" in text
    assert "seconds     -" in text and "bytes       -" in text
    assert "recent errors:\n  refit v1 timeout" in text


def test_engine_up_at_an_old_version_is_stale():
    text = render({"name": "p", "version": 3, "engines": {"e": {"up": True, "version": 2, "pid": 9}}})
    assert text.splitlines()[5].split()[:2] == ["e", "stale"]


def test_engines_starting_stale_and_draining_during_a_scale_show_their_state_in_engine_order():
    pool = pool_of({f"p-engine-{i}": FakeEngine(True) for i in (0, 2, 10)})
    pool.fleet.version = 3
    pool.fleet.table.set_version("p-engine-0", 3)
    pool.fleet.table.mark_draining("p-engine-2")                    # being removed
    pool.fleet.table.mark_starting("p-engine-11")                   # being added
    status = status_of(pool)
    assert {e: s["state"] for e, s in status["engines"].items()} == {
        "p-engine-0": "up", "p-engine-2": "draining", "p-engine-10": "stale", "p-engine-11": "starting"}
    rows = [li.split()[:2] for li in render(status).splitlines() if li.startswith("p-engine")]
    assert rows == [["p-engine-0", "up"], ["p-engine-2", "draining"], ["p-engine-10", "stale"],
                    ["p-engine-11", "starting"]]


def test_formats():
    assert fmt_seconds(None) == "-" and fmt_seconds(float("nan")) == "-"
    assert fmt_seconds(2.5) == "2.50s" and fmt_seconds(0.0451) == "45ms"
    assert fmt_bytes(512) == "512 B" and fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(5 * 1024 ** 4) == "5120.0 GiB"


def test_status_json_of_a_skipped_step_is_strict_json():
    """A skipped step reports grad_norm NaN: ``GET /v1/status`` (Starlette's JSONResponse, which refuses NaN) and
    ``pool status --json`` must still answer, with null in its place."""
    import json

    from starlette.responses import JSONResponse

    pool = pool_of({"engine-0": FakeEngine(True)})
    report = {"step": 3, "step_skipped": 1.0, "grad_norm": float("nan"), "refit_s": float("inf"),
              "reward_mean": 0.25, "logprob_mismatch_engine_e0_max": float("-inf")}
    status = status_of(pool, report)
    body = json.loads(JSONResponse(status).body)
    assert body["last_report"]["grad_norm"] is None and body["last_report"]["refit_s"] is None
    assert body["last_report"]["logprob_mismatch_engine_e0_max"] is None
    assert body["last_report"]["reward_mean"] == 0.25 and body["last_report"]["step"] == 3
    assert "step          3" in render(status)
