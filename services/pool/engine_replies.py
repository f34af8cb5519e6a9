"""What an :class:`~services.pool.engine_actor.EngineActor` answers the pool's ``start``, ``health``, ``stats``
and ``generate`` calls.

Typed values crossing Ray (pickled), read by attribute in start-up, the fleet, the dispatcher, the health watcher,
the object-store fan-out and the status page. Where a plain dict is wanted (JSON, logs), ``dataclasses.asdict``
gives the same keys as the fields; :meth:`EngineStats.as_dict` gives the flat dict of the engine's counters, and
:meth:`EngineStats.reply` the :class:`~protocol.pool_replies.EngineStatsReply` the pool's ``engine_stats`` answers
(the job wing's parity probe reads it, without naming this module).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.pool_replies import EngineStatsReply, UndeliveredPrompt

if TYPE_CHECKING:
    from rollout.counters import RolloutCounters


@dataclass(frozen=True)
class EngineStarted:
    """:meth:`EngineActor.start`'s answer: the vLLM engine is running."""

    engine_id: str
    """The engine actor's name (``<pool>-engine-<i>``)."""
    version: int
    """The policy version its vLLM engine serves (0: the model on disk)."""
    pid: int
    """The actor's process id."""
    incarnation: str
    """``<pid>.<vLLM starts>``: changes when the process or its vLLM engine restarts."""


@dataclass(frozen=True)
class EngineHealth:
    """:meth:`EngineActor.health`'s answer: whether its vLLM engine can serve, and what it holds."""

    engine_id: str
    """The engine actor's name (``<pool>-engine-<i>``)."""
    ok: bool
    """vLLM itself can serve: started, and its engine core alive."""
    error: str
    """Why it cannot serve ('' while ``ok``)."""
    version: int
    """The policy version its vLLM engine serves (0: the model on disk)."""
    synced: bool
    """A push was installed since this vLLM engine started (a restarted one serves the model on disk)."""
    running_batches: int
    """Batches of :meth:`EngineActor.generate` in progress."""
    pid: int
    """The actor's process id."""
    incarnation: str
    """``<pid>.<vLLM starts>``: changes when the process or its vLLM engine restarts."""


@dataclass(frozen=True)
class ChatCounters:
    """An engine's OpenAI-compatible chat serving (``policy.generation.vllm_cfg.expose_http_server``), cumulative
    since its actor started."""

    answers_spliced: int
    """Earlier answers of a session put back into a later prompt as the ids sampled
    (``inflight_openai_answers_spliced``)."""
    splice_refused: int
    """Earlier answers a later prompt of their session gave back as other text (an edited answer), left as
    rendered (``inflight_openai_answers_splice_refused``)."""


@dataclass(frozen=True)
class EngineStats:
    """:meth:`EngineActor.stats`'s answer: its rollout engine's counters and the actor's own."""

    engine_id: str
    """The engine actor's name (``<pool>-engine-<i>``)."""
    version: int
    """The policy version its vLLM engine serves (0: the model on disk)."""
    pid: int
    """The actor's process id."""
    incarnation: str
    """``<pid>.<vLLM starts>``: changes when the process or its vLLM engine restarts (its counters start again)."""
    running_batches: int
    """Batches of :meth:`EngineActor.generate` in progress."""
    channel_send_failures: int
    """Messages (groups, error reports) the learner's channel did not take."""
    counters: RolloutCounters
    """The rollout engine's counters (sampling, installs, vLLM's KV counts); its ``env`` is the agent driver's
    when an agent plays the episodes."""
    chat: ChatCounters | None = None
    """The OpenAI-compatible chat serving's counters (None: not served)."""

    def as_dict(self) -> dict[str, Any]:
        """The flat dict: the rollout engine's ``stats()`` keys (``env`` included), then ``openai_answers_spliced``
        and ``openai_splice_refused`` (only with chat serving), ``channel_send_failures``, ``running_batches``,
        ``pid`` and ``incarnation``; ``engine_id`` and ``version`` are the actor's."""
        out = self.counters.as_dict()
        if self.chat is not None:
            out.update(openai_answers_spliced=self.chat.answers_spliced, openai_splice_refused=self.chat.splice_refused)
        out.update(engine_id=self.engine_id, version=self.version, channel_send_failures=self.channel_send_failures,
                   running_batches=self.running_batches, pid=self.pid, incarnation=self.incarnation)
        return out

    def reply(self) -> EngineStatsReply:
        """What the pool's ``engine_stats`` answers for this engine: the fields its callers read, and
        :meth:`as_dict` as the reply's ``counters``."""
        return EngineStatsReply(self.engine_id, version=self.version, pid=self.pid, incarnation=self.incarnation,
                                refits=self.counters.installs.refits, counters=self.as_dict())


@dataclass(frozen=True)
class BatchReport:
    """What :meth:`EngineActor.generate` answers the pool once a batch is delivered or given up on."""

    prompts: int
    undelivered: list[UndeliveredPrompt]
    """Prompts whose group (or error report) the channel did not take in time."""
    engine_dead: str = ""
    """Why the vLLM engine core died during the batch ('' if it did not)."""
    requeue: list[int] = field(default_factory=list)
    """With ``engine_dead``: the indices of the prompts not delivered, for the pool to send elsewhere."""
