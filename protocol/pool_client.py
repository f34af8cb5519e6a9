"""The learner's typed handle on the rollout pool: one method per pool call, no method named by a string.

The pool is a Ray Serve application; its callers hold a ``DeploymentHandle``
whose ``handle.<method>.remote(...)`` escapes the type checker (any name,
any arguments, an untyped answer). :class:`PoolClient` wraps such a handle
with the calls the learner job, its parity probe and validator, and the CLI
make, each with its arguments, its bound (invariant 5) and its typed answer
(:mod:`protocol.pool_replies`). It imports neither Ray nor the pool: the
pool's ``RolloutPool`` answers these calls, the job wing reads the answers,
and neither wing names the other. The weight transports' calls (push,
weight group, CUDA IPC) are theirs, in ``services/refit/``.
"""
from __future__ import annotations

from typing import Any, Generic, TypeVar

from protocol.pool_replies import EngineStatsReply, EvaluationReply, PoolStatus, UndeliveredPrompt

T = TypeVar("T")

STATUS_TIMEOUT_S = 60.0
ATTACH_TIMEOUT_S = 60.0
DETACH_TIMEOUT_S = 30.0
SUBMIT_TIMEOUT_S = 120.0
ENGINE_STATS_TIMEOUT_S = 120.0
ENGINE_SLEEP_TIMEOUT_S = 600.0
EVALUATE_GRACE_S = 30.0
"""What ``evaluate`` may take past the batch's own deadline before the caller gives up on the pool."""


class Pending(Generic[T]):
    """A started call (a Serve ``DeploymentResponse``) whose answer is read later (several engines probed at
    once): typed ``result``."""

    def __init__(self, reply: Any):
        self._reply = reply

    def result(self, timeout_s: float | None = None) -> T:
        return self._reply.result(timeout_s=timeout_s)


class PoolClient:
    """Typed calls on a rollout pool's handle (a Serve ``DeploymentHandle``, or a fake of one in tests)."""

    def __init__(self, handle: Any):
        self.handle = handle
        """The handle itself: the weight transports build their own calls on it (``services.refit``)."""

    @classmethod
    def of(cls, pool: Any) -> PoolClient:
        """``pool`` itself when it is a client already, else a client on the handle ``pool``."""
        return pool if isinstance(pool, PoolClient) else cls(pool)

    def status(self, timeout_s: float = STATUS_TIMEOUT_S) -> PoolStatus:
        return self.handle.status.remote().result(timeout_s=timeout_s)

    def attach(self, learner_id: str, channel: Any, timeout_s: float = ATTACH_TIMEOUT_S) -> PoolStatus:
        """Make ``learner_id`` (with its trajectory channel) the pool's one learner."""
        return self.handle.attach.remote(learner_id, channel).result(timeout_s=timeout_s)

    def detach(self, learner_id: str, timeout_s: float = DETACH_TIMEOUT_S) -> None:
        self.handle.detach.remote(learner_id).result(timeout_s=timeout_s)

    def take_undelivered(self, learner_id: str, timeout_s: float = STATUS_TIMEOUT_S) -> list[UndeliveredPrompt]:
        """The prompts the engines could not put into ``learner_id``'s channel since the last call."""
        return self.handle.take_undelivered.remote(learner_id).result(timeout_s=timeout_s)

    def submit(self, prompt_bytes: list[bytes], group_size: int, timeout_s: float = SUBMIT_TIMEOUT_S) -> int:
        """Queue encoded ``PromptRequest`` s, ``group_size`` answers each; the pool's answer (prompts queued)."""
        return self.handle.submit.remote(prompt_bytes, group_size).result(timeout_s=timeout_s)

    def evaluate(self, prompt_bytes: list[bytes], num_generations: int, temperature: float,
                 deadline_s: float) -> EvaluationReply:
        """Validation: the prompts' groups returned to the caller, bounded by ``deadline_s`` plus
        :data:`EVALUATE_GRACE_S`."""
        return self.handle.evaluate.remote(prompt_bytes, num_generations, temperature, deadline_s).result(
            timeout_s=deadline_s + EVALUATE_GRACE_S)

    def engine_stats(self, timeout_s: float = ENGINE_STATS_TIMEOUT_S) -> dict[str, EngineStatsReply]:
        """Each engine id -> its stats (``version``, ``incarnation``, ``refits``, its ``counters``; only ``error``
        if it did not answer)."""
        return self.handle.engine_stats.remote().result(timeout_s=timeout_s)

    def start_logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]], engine_id: str,
                          image_prompts: list[bytes] | None = None) -> Pending[list[list[float]]]:
        """Start one engine's scoring of the responses (the parity probe asks several engines at once)."""
        extra = (image_prompts,) if image_prompts else ()
        return Pending(self.handle.logprobs_of.remote(prompt_ids, response_ids, engine_id, *extra))

    def sleep_engines(self, timeout_s: float = ENGINE_SLEEP_TIMEOUT_S) -> None:
        self.handle.sleep_engines.remote().result(timeout_s=timeout_s)

    def wake_engines(self, timeout_s: float = ENGINE_SLEEP_TIMEOUT_S) -> None:
        self.handle.wake_engines.remote().result(timeout_s=timeout_s)

    def report_step(self, report: dict) -> None:
        """Hand the pool a step's row for its metrics and history; not waited for."""
        self.handle.report_step.remote(report)

    def colocation_group(self, timeout_s: float = STATUS_TIMEOUT_S) -> Any:
        """The pool's colocation placement group (None for separate pools)."""
        return self.handle.colocation_group.remote().result(timeout_s=timeout_s)
