"""Fakes at the job wing's edges: a pool DeploymentHandle, a learner group, a channel (no Ray, no Serve, no
model); and a real :class:`LearnerJob` built on them through its own constructor."""
from __future__ import annotations

import time
from pathlib import Path

from protocol import PromptRequest, Trajectory, TrajectoryGroup
from protocol.pool_replies import UndeliveredPrompt
from services.job.channel import ChannelTimeout
from services.recipe.config import load_recipe
from services.job import learner_job
from services.job.learner_job import LearnerJob
from services.data.prompt_source import PromptSource
from handle_fakes import ServeMethod


def group(pid: str, step: int = 1, good: bool = True) -> TrajectoryGroup:
    trajs = [Trajectory([1, 2], [-0.5, -0.25], [0, 0], float(i) if good else None, "stop" if good else "error",
                        "" if good else "engine on fire") for i in range(2)]
    return TrajectoryGroup(f"g-{pid}", pid, [5], trajs, 2, 16, scheduled_step=step)


def prompts(n: int = 8) -> list[PromptRequest]:
    return [PromptRequest(f"p{i}", [1, 2, 3]) for i in range(n)]


class FakePool:
    """The pool's handle as the job uses it; ``answer(request)`` -> the group (or None) sent back to the job's
    channel for each submitted prompt."""

    def __init__(self, channel: ListChannel | None = None, answer=None):
        self.channel, self.answer = channel, answer
        self.submitted: list[tuple[float, str]] = []
        self.undelivered: list[UndeliveredPrompt] = []
        self.asked_undelivered: list[str] = []
        self.calls: list[str] = []
        self.reports: list[dict] = []
        self.attach = ServeMethod(lambda learner_id, channel: {})
        self.detach = ServeMethod(lambda learner_id: None)
        self.submit = ServeMethod(self._submit)
        self.take_undelivered = ServeMethod(self._take_undelivered)
        self.report_step = ServeMethod(self.reports.append)
        self.sleep_engines = ServeMethod(lambda: self.calls.append("sleep"))
        self.wake_engines = ServeMethod(lambda: self.calls.append("wake"))

    def _submit(self, encoded: list[bytes], group_size: int) -> int:
        from protocol import decode, encode

        for data in encoded:
            req = decode(data)
            self.submitted.append((time.monotonic(), req.prompt_id))
            reply = self.answer(req) if self.answer else None
            if reply is not None and self.channel is not None:
                self.channel.queue.append(encode(reply))
        return len(encoded)

    def _take_undelivered(self, learner_id: str) -> list[UndeliveredPrompt]:
        self.asked_undelivered.append(learner_id)
        out, self.undelivered = self.undelivered, []
        return out


class ListChannel:
    """A trajectory channel over a list; an empty one waits ``timeout_s`` and raises ``ChannelTimeout``."""

    def __init__(self, quiet_reads: int = 0):
        self.queue: list[bytes] = []
        self.quiet_reads = quiet_reads

    def recv(self, timeout_s: float) -> bytes:
        if self.quiet_reads:
            self.quiet_reads -= 1
            raise ChannelTimeout("empty")
        if self.queue:
            return self.queue.pop(0)
        time.sleep(timeout_s)
        raise ChannelTimeout("empty")

    def close(self) -> None:
        pass


class FakeLearner:
    """A learner group at version ``at_version``; records the methods called."""

    def __init__(self, version: int = 0):
        self.at_version, self.calls = version, []

    def version(self) -> int:
        self.calls.append("version")
        return self.at_version


class CountingRefit:
    """A weight transport that records its pushes (``reset`` each) and fails the first ``failures``."""

    def __init__(self, failures: int = 0, waiting: bool = False):
        self.pushes: list[bool] = []
        self.failures, self.waiting = failures, waiting

    def push(self, reset: bool):
        from services.refit import RefitResult

        self.pushes.append(reset)
        if self.failures:
            self.failures -= 1
            raise RuntimeError("pool 'p': weight push rejected; the old version keeps serving: checksum")
        return RefitResult(version=1, seconds=0.1, bytes=10, engines=1)

    def engines_waiting(self) -> bool:
        return self.waiting


def make_job(monkeypatch, run_dir: Path, pool: FakePool | None = None, refit: CountingRefit | None = None,
             learner: FakeLearner | None = None, overrides: tuple[str, ...] = ()) -> LearnerJob:
    """A :class:`LearnerJob` built by its constructor from a CPU recipe (one prompt a step, no parity probe,
    no TensorBoard), with the fakes above at its edges; the job reads ``pool.channel``."""
    recipe = load_recipe(None, ["logger.tensorboard_enabled=false", "logger.parity_probe_sequences=0",
                                "grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=2",
                                "grpo.max_num_steps=10", *overrides])
    pool = pool or FakePool(ListChannel())
    channel = pool.channel or ListChannel()
    monkeypatch.setattr(PromptSource, "of_task", classmethod(lambda cls, r, m: cls(prompts(), r.grpo.seed)))
    monkeypatch.setattr(learner_job.TrajectoryChannel, "create", staticmethod(lambda name, capacity: channel))
    monkeypatch.setattr(learner_job, "make_refit", lambda r, p, lrn: refit or CountingRefit())
    return LearnerJob(recipe, "no-model", pool, learner or FakeLearner(), run_dir, resume=False)
