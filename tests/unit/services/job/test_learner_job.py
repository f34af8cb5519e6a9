"""The learner job's verbs (services/job/learner_job.py), built by its constructor on fakes of the pool, the
learner and the channel: start probes after the first push, push retries and skipped steps, the collect loop's
bounds (a quiet channel, a pool failing every prompt), undelivered prompts, colocated sleep and wake."""
from __future__ import annotations

import pytest
from job_fakes import CountingRefit, FakeLearner, FakePool, ListChannel, group, make_job

from protocol import encode
from protocol.pool_replies import UndeliveredPrompt
from services.job.backoff import ReplacementBackoff
from services.job.learner_job import REFIT_ATTEMPTS, StepTimeout
from services.refit import RefitResult


def test_the_job_probes_right_after_its_first_push(monkeypatch, tmp_path):
    refit = CountingRefit()
    job = make_job(monkeypatch, tmp_path, refit=refit)
    calls = []
    monkeypatch.setattr(job.parity, "checked", lambda version, push_again: calls.append(("probe", refit.pushes[:])))
    job.start(prefetch=2)
    assert calls == [("probe", [True])]
    assert sorted(job.book.ledger.pending().values()) == [1, 2]       # a fresh run schedules the next 2 steps


def test_push_weights_retries_then_names_the_learner_and_the_cause(monkeypatch, tmp_path):
    job = make_job(monkeypatch, tmp_path, refit=CountingRefit(failures=REFIT_ATTEMPTS))
    with pytest.raises(RuntimeError, match=rf"{job.id}: weight push v0 failed {REFIT_ATTEMPTS} times.*checksum"):
        job.push_weights()
    assert job.refit.pushes == [False] * REFIT_ATTEMPTS
    assert job.push_weights() == RefitResult(1, 0.1, 10, 1)            # the next one goes through


def test_a_push_after_a_skipped_step_sends_nothing_and_a_reset_push_still_does(monkeypatch, tmp_path):
    job = make_job(monkeypatch, tmp_path, refit=CountingRefit())
    assert job.push_weights(reset=True) == RefitResult(1, 0.1, 10, 1)  # start: v0 on every engine
    job.version = 1                                                    # a step applied
    assert job.push_weights().bytes == 10
    assert job.push_weights() is None and job.last_refit is None       # a skipped step: v1 is there already
    assert job.push_weights(reset=True).bytes == 10                    # a restarted engine waits for v1
    assert job.refit.pushes == [True, False, True]


@pytest.mark.parametrize("waiting", [False, True])
def test_a_quiet_channel_pushes_the_weights_to_an_engine_waiting_for_them(monkeypatch, tmp_path, waiting):
    """A restarted engine outside the weight group takes no work until it has the learner's version; with a
    one-engine pool nothing else would ever arrive, so a learner waiting for groups pushes to it."""
    channel = ListChannel(quiet_reads=2)
    job = make_job(monkeypatch, tmp_path, pool=FakePool(channel, answer=lambda req: group(req.prompt_id)),
                   refit=CountingRefit(waiting=waiting))
    job.schedule(1)
    (pid,) = job.book.ledger.scheduled
    assert [b.group.prompt_id for b in job.collect(1)] == [pid]
    assert job.refit.pushes == ([True, True] if waiting else [])


def test_undelivered_prompts_reported_by_the_pool_are_dropped_and_replaced(monkeypatch, tmp_path):
    pool = FakePool(ListChannel())
    job = make_job(monkeypatch, tmp_path, pool=pool)
    job.schedule(2)
    (pid,) = job.book.ledger.scheduled
    pool.undelivered = [UndeliveredPrompt(pid, scheduled_step=2, reason="channel send failed", engine_id="e0")]
    assert job.drop_undelivered() == 1 and job.drop_undelivered() == 0  # handed out once
    assert job.book.ledger.dropped == {pid: "undelivered"} and pool.asked_undelivered == [job.id] * 2
    assert len(pool.submitted) == 2                                     # the replacement


def test_colocated_sleep_and_wake_go_to_the_pool(monkeypatch, tmp_path):
    pool = FakePool(ListChannel())
    job = make_job(monkeypatch, tmp_path, pool=pool)
    job.sleep_engines()
    job.wake_engines()
    assert pool.calls == ["sleep", "wake"]


def failing_pool(heal_after: int | None = None) -> FakePool:
    """A pool whose engines fail every prompt at once (no valid sample); after ``heal_after`` submissions its
    groups are good."""
    pool = FakePool(ListChannel())
    pool.answer = lambda req: group(req.prompt_id, req.scheduled_step,
                                    good=heal_after is not None and len(pool.submitted) > heal_after)
    return pool


def test_a_pool_failing_every_prompt_at_once_costs_a_few_prompts_not_hundreds(monkeypatch, tmp_path):
    pool = failing_pool()
    job = make_job(monkeypatch, tmp_path, pool=pool)
    job.collect_timeout_s = 1.0
    job.book.backoff = ReplacementBackoff(base_s=0.05, max_s=0.2)
    job.schedule(1)
    with pytest.raises(StepTimeout, match="too_few_valid_samples"):
        job.collect(1)
    # 0, 0.05, 0.1, 0.2, 0.2, ... s apart: about 8 in 1 s (at once: thousands)
    assert 4 <= len(pool.submitted) <= 12, len(pool.submitted)
    gaps = [b[0] - a[0] for a, b in zip(pool.submitted, pool.submitted[1:], strict=False)]
    assert max(gaps) >= 0.19 and all(g < 0.5 for g in gaps)
    ledger = job.book.ledger
    assert set(ledger.scheduled) == {pid for _, pid in pool.submitted} | set(ledger.pending())


def test_after_the_pool_recovers_the_step_completes_and_the_failure_count_starts_again(monkeypatch, tmp_path):
    pool = failing_pool(heal_after=3)
    job = make_job(monkeypatch, tmp_path, pool=pool)
    job.collect_timeout_s = 5.0
    job.book.backoff = ReplacementBackoff(base_s=0.05, max_s=0.2)
    job.schedule(1)
    assert len(job.collect(1)) == 1
    assert job.book.backoff.failures_in_a_row == 0 and len(pool.submitted) == 4


def test_a_step_row_counts_the_refit_the_drops_and_the_rejected_messages(monkeypatch, tmp_path):
    from services.job.run_log import StepTimer

    pool = FakePool(ListChannel())
    job = make_job(monkeypatch, tmp_path, pool=pool, learner=FakeLearner(version=3),
                   overrides=("checkpointing.enabled=false",))
    job.push_weights(reset=True)
    job.book.receive(encode(group("never-scheduled")))
    row = job.finish_step(1, {"gen_kl_error": 0.5, "reward_mean": 0.25, "note": "text"}, StepTimer())
    assert row["step"] == 1 and row["policy_version"] == 3 and row["refit_bytes"] == 10
    assert row["train_gen_kl_error"] == 0.5 and row["reward_mean"] == 0.25 and "note" not in row
    assert row["parity_engines_probed"] == 0 and job.step == 1 and job.log.rows == [row]
    (report,) = pool.reports
    assert report["rejected"] == {"unexpected_group": 1} and job.book.rejected == {}
