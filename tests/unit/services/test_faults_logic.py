"""Pure fault-handling logic: duplicate groups at the learner, refit retries, refit failure reasons, parity checks,
replacement back-off."""
from __future__ import annotations

import asyncio
import time

import pytest

from protocol import ControlMessage, PromptRequest, Trajectory, TrajectoryGroup, decode, encode
from services.backoff import ReplacementBackoff
from services.buffer import TrajectoryBuffer
from services.job import REFIT_ATTEMPTS, LearnerJob, StepTimeout
from services.ledger import PromptLedger
from services.parity import ParityError, check_parity, parity_stats
from services.pool import _refit_failure_reason
from services.refit import CollectiveRefit, ObjectStoreRefit


def group(pid: str, step: int = 1) -> TrajectoryGroup:
    trajs = [Trajectory([1, 2], [-0.5, -0.25], [0, 0], float(i)) for i in range(2)]
    return TrajectoryGroup(f"g-{pid}", pid, [5], trajs, 2, 16, scheduled_step=step)


def receiving_job() -> LearnerJob:
    """A LearnerJob with just the state ``_receive`` uses (no pool, learner or channel)."""
    job = LearnerJob.__new__(LearnerJob)
    job.ledger, job.buffer, job.rejected, job.open_requests, job.step = PromptLedger(), TrajectoryBuffer(1), {}, {}, 0
    job.rescheduled, job.backoff = [], ReplacementBackoff()
    job.schedule = lambda step, n=None, delay_s=0.0: job.rescheduled.append((step, n))
    return job


def test_buffer_refuses_a_second_group_of_a_buffered_prompt():
    buf = TrajectoryBuffer(max_age=1)
    assert buf.add(group("a"), b"1") and buf.holds("a")
    assert not buf.add(group("a"), b"2")
    assert len(buf) == 1 and buf.all_groups()[0].data == b"1"
    buf.take(1, 1)
    assert not buf.holds("a")


def test_duplicates_of_requeued_prompts_are_counted_and_never_trained():
    job = receiving_job()
    job.ledger.schedule("a", 1)
    job.ledger.schedule("b", 1)
    job._receive(encode(group("a")))
    job._receive(encode(group("a")))                                   # buffered already
    job._receive(encode(group("zz")))                                  # never scheduled
    job.ledger.mark_trained("b", 1)
    job._receive(encode(group("b")))                                   # trained already
    assert job.rejected == {"duplicate": 2, "unexpected_group": 1}
    assert [bg.group.prompt_id for bg in job.buffer.all_groups()] == ["a"]


def test_an_error_report_for_a_buffered_prompt_does_not_drop_it():
    job = receiving_job()
    job.ledger.schedule("a", 1)
    job.ledger.schedule("b", 1)
    job._receive(encode(group("a")))
    for pid in ("a", "b"):
        job._receive(encode(ControlMessage("error", {"prompt_id": pid, "scheduled_step": 1, "reason": "x"}, 0.0)))
    assert job.ledger.is_open("a") and job.buffer.holds("a")           # its first group stays and is trained
    assert job.ledger.dropped == {"b": "generation_failed"} and job.rescheduled == [(1, 1)]


class _Refused:
    def __init__(self, calls: list):
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return self

    def result(self, timeout_s: float):
        raise RuntimeError("pool 'p': weight push v3 rejected; the old version v2 keeps serving: checksum")


def test_push_weights_retries_then_names_the_learner_and_the_cause():
    calls, exports = [], []
    job = LearnerJob.__new__(LearnerJob)
    job.id, job.version, job.pushed_version = "learner-x", 3, 2
    job.recipe = type("R", (), {"policy": type("P", (), {"refit_bucket_mb": 1, "refit_timeout_s": 1.0, "generation": type(
        "G", (), {"request_timeout_s": 1.0})})})
    job.learner = type("L", (), {"call": lambda self, m, *a: exports.append(m) or (b"manifest", [])})()
    job.pool = type("Pool", (), {"update_weights": _Refused(calls)})()
    job.refit = ObjectStoreRefit(job.recipe, job.pool, job.learner)
    with pytest.raises(RuntimeError, match=rf"learner-x: weight push v3 failed {REFIT_ATTEMPTS} times.*checksum"):
        job.push_weights()
    assert len(calls) == REFIT_ATTEMPTS and exports == ["export_weights"] * REFIT_ATTEMPTS


def test_refit_failure_reasons():
    assert _refit_failure_reason([asyncio.TimeoutError()]) == "timeout"
    assert _refit_failure_reason([RuntimeError("RayTaskError(WeightUpdateError): bad shape")]) == "rejected"
    assert _refit_failure_reason([ValueError("ProtocolError: buckets: missing [3]")]) == "rejected"
    assert _refit_failure_reason([RuntimeError("no engine is up")]) == "failed"


def test_refit_failure_reason_looks_inside_ray_task_errors():
    class RayTaskErrorLike(Exception):
        cause = asyncio.TimeoutError()

    assert _refit_failure_reason([RayTaskErrorLike("ray::EngineActor.apply_weights() traceback ...")]) == "timeout"


class _Response:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s: float):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return _Response(self.fn(*args))


class _GroupPool:
    """The pool's side of a collective push: the group is current until a push fails."""

    def __init__(self):
        self.current, self.joined, self.received = False, 0, []
        self.weight_group_current = _Method(lambda: self.current)
        self.weight_group_plan = _Method(lambda timeout: {"ranks": {"e0": 1}, "world_size": 2})
        self.join_weight_group = _Method(self._join)
        self.receive_weights = _Method(self._receive)

    def _join(self, host, port, plan, timeout):
        self.joined += 1
        self.current = True

    def _receive(self, reset, timeout):
        self.received.append(reset)
        return {"version": 1, "seconds": 0.1, "bytes": 10, "engines": 1}


class _GroupLearner:
    def __init__(self, fail_sends: int):
        self.fail_sends, self.calls = fail_sends, []

    def call(self, method, *args):
        self.calls.append(method)
        if method == "weight_group_address":
            return "127.0.0.1", 1234
        if method == "send_staged":
            if self.fail_sends:
                self.fail_sends -= 1
                raise RuntimeError("gloo: connection reset by peer")
            return {"seconds": 0.05}

    def call_async(self, method, *args):
        self.calls.append(method)
        return []

    def wait(self, refs, method):
        return None


def test_collective_refit_forms_the_group_once_and_again_after_a_failed_send():
    recipe = type("R", (), {"policy": type("P", (), {"refit_bucket_mb": 1, "refit_timeout_s": 1.0, "generation": type(
        "G", (), {"request_timeout_s": 1.0})})})
    pool, learner = _GroupPool(), _GroupLearner(fail_sends=0)
    refit = CollectiveRefit(recipe, pool, learner)
    out = refit.push(reset=False)
    assert out["groups_formed"] == 1 and pool.received == [True]  # a new group: members may hold any version
    refit.push(reset=False)
    assert pool.joined == 1 and pool.received == [True, False]    # the group is current: no new one
    learner.fail_sends = 1
    with pytest.raises(RuntimeError, match="connection reset"):
        refit.push(reset=False)
    refit.push(reset=False)                                         # the next attempt re-forms the group
    assert pool.joined == 2 and refit.groups_formed == 2 and pool.received[-1] is True


def test_parity_check_passes_close_logprobs_and_names_a_scrambled_engine():
    learner = [[-1.0, -2.0, -0.5], [-3.0]]
    close = parity_stats([[-1.0001, -2.0, -0.5], [-3.0002]], learner)
    assert close["gen_kl_error"] < 1e-7
    check_parity(close, 0.1, 4)
    scrambled = parity_stats([[-4.0, -0.1, -3.5], [-0.2]], learner)  # e.g. gate/up halves swapped
    with pytest.raises(ParityError, match=r"v4: gen KL .* > logger.parity_max_gen_kl 0.1"):
        check_parity(scrambled, 0.1, 4)
    with pytest.raises(ParityError):
        check_parity({**close, "gen_kl_error": float("nan")}, 0.1, 4)


def test_parity_check_stops_a_jump_over_the_runs_own_level_below_the_absolute_limit():
    # measured on H200, random MoE with FlashInfer CUTLASS: reload_weights 2.6e-6, plain load_weights 3.0e-4
    right, wrong = (dict(gen_kl_error=kl, parity_mean_abs_logprob_diff=0.0, parity_max_abs_logprob_diff=0.0)
                    for kl in (2.6e-6, 3.0e-4))
    check_parity(wrong, 0.01, 7)                                     # under the absolute limit
    check_parity(wrong, 0.01, 7, history=[], max_ratio=20.0)         # no history yet: nothing to compare
    check_parity(right, 0.01, 7, history=[2.5e-6, 2.7e-6], max_ratio=20.0)
    with pytest.raises(ParityError, match=r"v7: gen KL 0.0003 is 115x the median 2.6e-06 .*ratio 20\)"):
        check_parity(wrong, 0.01, 7, history=[2.6e-6], max_ratio=20.0)
    check_parity(wrong, 0.01, 7, history=[2.6e-6], max_ratio=0.0)  # disabled
    # float32 noise far below the floor never makes a jump
    check_parity(dict(right, gen_kl_error=1e-9), 0.01, 7, history=[1e-11, 2e-11], max_ratio=20.0)


class _Undelivered:
    def __init__(self, records: list[dict]):
        self.records, self.asked = records, []

    def remote(self, learner_id: str):
        self.asked.append(learner_id)
        return self

    def result(self, timeout_s: float):
        out, self.records = self.records, []
        return out


def test_undelivered_prompts_are_dropped_with_a_reason_and_replaced_once():
    job = receiving_job()
    job.id = "learner-x"
    for pid in ("a", "b", "c"):
        job.ledger.schedule(pid, 2)
    job._receive(encode(group("b", 2)))                                 # b's group did arrive (buffered)
    job.ledger.mark_dropped("c", "stale")
    take = _Undelivered([{"prompt_id": p, "scheduled_step": 2, "reason": "channel send failed: ChannelTimeout: full",
                          "engine_id": "e0"} for p in ("a", "b", "c")])
    job.pool = type("Pool", (), {"take_undelivered": take})()
    assert job.drop_undelivered() == 1                                 # only a: b is buffered, c already finished
    assert job.ledger.dropped == {"c": "stale", "a": "undelivered"} and job.rescheduled == [(2, 1)]
    assert job.rejected == {"undelivered": 1} and take.asked == ["learner-x"]
    assert job.drop_undelivered() == 0                                  # handed out once


class _QuietChannel:
    """A channel that stays empty for ``timeouts`` reads, then delivers ``data``."""

    def __init__(self, timeouts: int, data: bytes):
        self.timeouts, self.data = timeouts, data

    def recv(self, timeout_s: float) -> bytes:
        from services.channel import ChannelTimeout
        if self.timeouts:
            self.timeouts -= 1
            raise ChannelTimeout("empty")
        return self.data


@pytest.mark.parametrize("waiting", [False, True])
def test_a_quiet_channel_pushes_the_weights_to_an_engine_waiting_for_them(waiting):
    """A restarted engine outside the weight group takes no work until it has the learner's version; with a
    one-engine pool nothing else would ever arrive, so a learner waiting for groups pushes to it."""
    job = receiving_job()
    job.id, job.version, job.n_per_step, job.collect_timeout_s = "learner-x", 1, 1, 60.0
    job.last_sample_error = ""
    job.recipe = type("R", (), {"rollout_pool": type("P", (), {"name": "p"})})
    job.pool = type("Pool", (), {"take_undelivered": _Undelivered([])})()
    job.ledger.schedule("a", 1)
    job.channel = _QuietChannel(2, encode(group("a")))
    job.refit = type("Refit", (), {"engines_waiting": lambda self: waiting})()
    pushes = []
    job.push_weights = lambda reset=False: pushes.append(reset)
    assert [b.group.prompt_id for b in job.collect(1)] == ["a"]
    assert pushes == ([True, True] if waiting else [])


def test_replacement_backoff_doubles_per_failure_in_a_row_and_starts_again_after_a_good_group():
    now = [100.0]
    backoff = ReplacementBackoff(base_s=0.5, max_s=4.0, clock=lambda: now[0])
    assert [backoff.delay_after("too_few_valid_samples") for _ in range(6)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.delay_after("stale") == 0.0 and backoff.failures_in_a_row == 6  # not a failure of the pool
    for _ in range(2000):  # hours of failures in a row stay at the cap
        assert backoff.delay_after("generation_failed") <= 4.0
    backoff.succeeded()
    assert backoff.delay_after("generation_failed") == 0.0 and backoff.delay_after("undelivered") == 0.5
    backoff.hold(["a"], 1.0)
    backoff.hold(["b", "c"], 0.25)
    assert backoff.next_due_in() == 0.25 and backoff.due() == []
    now[0] += 0.5
    assert backoff.due() == ["b", "c"] and backoff.next_due_in() == 0.5
    now[0] += 0.5
    assert backoff.due() == ["a"] and backoff.next_due_in() is None


class _FailingPool:
    """A pool whose engines fail every prompt at once: each submitted prompt comes back as a group with no
    valid sample; after ``heal_after`` submissions its groups are good."""

    def __init__(self, channel, heal_after: int | None = None):
        self.channel, self.heal_after, self.submitted = channel, heal_after, []
        self.take_undelivered = _Undelivered([])

    @property
    def submit(self):
        return self

    def remote(self, encoded: list[bytes], group_size: int):
        for data in encoded:
            req = decode(data)
            self.submitted.append((time.monotonic(), req.prompt_id))
            good = self.heal_after is not None and len(self.submitted) > self.heal_after
            trajs = [Trajectory([1, 2], [-0.5, -0.25], [0, 0], float(i) if good else None,
                                "stop" if good else "error", "" if good else "engine on fire") for i in range(2)]
            self.channel.queue.append(encode(TrajectoryGroup(f"g-{req.prompt_id}", req.prompt_id, [5], trajs, 2, 16,
                                                             scheduled_step=req.scheduled_step)))
        return self

    def result(self, timeout_s: float):
        return None


class _ListChannel:
    def __init__(self):
        self.queue = []

    def recv(self, timeout_s: float) -> bytes:
        from services.channel import ChannelTimeout
        if self.queue:
            return self.queue.pop(0)
        time.sleep(timeout_s)
        raise ChannelTimeout("empty")


def _collecting_job(pool, channel, collect_timeout_s: float) -> LearnerJob:
    from services.data import PromptSource
    job = LearnerJob.__new__(LearnerJob)
    job.ledger, job.buffer, job.rejected, job.open_requests, job.step = PromptLedger(), TrajectoryBuffer(1), {}, {}, 0
    job.id, job.version, job.n_per_step, job.group_size, job.last_step = "learner-x", 0, 1, 2, 10
    job.collect_timeout_s, job.last_sample_error = collect_timeout_s, ""
    job.recipe = type("R", (), {"rollout_pool": type("P", (), {"name": "p"})})
    job.source = PromptSource([PromptRequest(f"p{i}", [1, 2, 3]) for i in range(8)], seed=0)
    job.backoff = ReplacementBackoff(base_s=0.05, max_s=0.2)
    job.pool, job.channel = pool, channel
    job.refit = type("Refit", (), {"engines_waiting": lambda self: False})()
    return job


def test_a_pool_failing_every_prompt_at_once_costs_a_few_prompts_not_hundreds():
    channel = _ListChannel()
    pool = _FailingPool(channel)
    job = _collecting_job(pool, channel, collect_timeout_s=1.0)
    job.schedule(1)
    with pytest.raises(StepTimeout, match="too_few_valid_samples"):
        job.collect(1)
    # 0, 0.05, 0.1, 0.2, 0.2, ... s apart: about 8 in 1 s (at once: thousands)
    assert 4 <= len(pool.submitted) <= 12, len(pool.submitted)
    gaps = [b[0] - a[0] for a, b in zip(pool.submitted, pool.submitted[1:])]
    assert max(gaps) >= 0.19 and all(g < 0.5 for g in gaps)
    assert set(job.ledger.scheduled) == {pid for _, pid in pool.submitted} | set(job.ledger.pending())


def test_after_the_pool_recovers_the_step_completes_and_the_failure_count_starts_again():
    channel = _ListChannel()
    pool = _FailingPool(channel, heal_after=3)
    job = _collecting_job(pool, channel, collect_timeout_s=5.0)
    job.schedule(1)
    assert len(job.collect(1)) == 1
    assert job.backoff.failures_in_a_row == 0 and len(pool.submitted) == 4
