"""The prompt book: where each prompt of a learner job stands, from its draw to its outcome.

One object with three parts: the :class:`PromptLedger` (each prompt trained once or dropped with a
reason, invariant 3), the :class:`TrajectoryBuffer` (groups by scheduled step, screened for age,
invariant 2) and the :class:`ReplacementBackoff` (replacements of failed prompts wait). It draws
prompts from the :class:`PromptSource`, hands them to the ``submit`` function it is given, reads the
pool's messages, drops prompts with a reason and replaces them, and counts what it rejects. It
knows nothing of Ray or of the pool: the job passes it bytes and records.

Dynamic sampling (DAPO, ``grpo.use_dynamic_sampling``): a group that arrives with two or more valid samples
all of the same reward (:func:`services.job.batch_stats.zero_advantage`) is dropped (reason
``zero_advantage``) and its prompt replaced for the same step, at once, like a stale group, as long as fewer
than ``dynamic_sampling_max_gen_batches x num_prompts_per_step`` prompts have been drawn for that step. Past
that bound zero-advantage groups are kept: every drop is replaced one for one, so the step still gets exactly
``num_prompts_per_step`` groups and trains on them; the zero-advantage ones it trains are counted
(``dynamic_sampling_exhausted``). Replacements of other drops (failures, stale) count towards the bound but
are never refused by it.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from learner.config import RewardScalingConfig
from protocol import ControlMessage, PromptRequest, ProtocolError, TrajectoryGroup, decode, encode
from protocol.pool_replies import UndeliveredPrompt
from services.data.prompt_source import DataExhausted, PromptSource
from services.job.backoff import ReplacementBackoff
from services.job.batch_stats import zero_advantage
from services.job.buffer import BufferedGroup, TrajectoryBuffer
from services.job.failures import FailureLog
from services.job.ledger import PromptLedger
from services.job.skips import DROP_REASON

log = logging.getLogger("inflight.job")
ZERO_ADVANTAGE = "zero_advantage"
"""The drop reason of dynamic sampling."""


@dataclass
class BookState:
    """What a checkpoint keeps of the book (the keys of the learner checkpoint's ``extra``)."""

    data_position: dict
    ledger: dict
    buffer: list[bytes]
    open_requests: list[bytes]
    drops: dict[str, int]


@dataclass(frozen=True)
class SamplingStats:
    """Dynamic sampling's numbers for one step (the step row's ``dynamic_sampling_*`` keys)."""

    dropped: int
    """Zero-advantage groups dropped and replaced for the step."""
    attempts: float
    """Prompts drawn for the step over ``num_prompts_per_step`` (1.0: no replacement)."""
    exhausted: int
    """Zero-advantage groups the step trains on because the bound was reached."""

    def metrics(self) -> dict[str, float]:
        return {"dynamic_sampling_dropped": float(self.dropped), "dynamic_sampling_attempts": self.attempts,
                "dynamic_sampling_exhausted": float(self.exhausted)}


class PromptBook:
    def __init__(self, source: PromptSource, submit: Callable[[list[PromptRequest]], object], per_step: int,
                 last_step: int, max_age: int, backoff: ReplacementBackoff | None = None,
                 max_prompts_per_step: int | None = None, reward_scaling: RewardScalingConfig | None = None,
                 failures: FailureLog | None = None):
        """``submit(requests)`` sends prompts to the pool; ``per_step`` groups make a step; no prompt is drawn
        for a step after ``last_step``; groups older than ``max_age`` versions are dropped as stale. With
        ``max_prompts_per_step`` (dynamic sampling on), zero-advantage groups are dropped and replaced while
        fewer prompts than that have been drawn for their step, judged on rewards after ``reward_scaling``.
        ``failures`` records the failed samples of every accepted group and failed prompt (default: counts
        only, no file)."""
        self.source, self.submit = source, submit
        self.per_step, self.last_step = per_step, last_step
        self.ledger = PromptLedger()
        self.buffer = TrajectoryBuffer(max_age)
        self.backoff = backoff or ReplacementBackoff()
        self.failures = failures or FailureLog(None, "", 0)
        self.open_requests: dict[str, PromptRequest] = {}
        """Scheduled prompts with no outcome yet, kept to resubmit them after a resume."""
        self.rejected: dict[str, int] = {}
        """Messages refused and prompts dropped since the last step's report, by reason."""
        self.last_sample_error = ""
        """Why a sample of the last group dropped for too few valid samples failed."""
        self.max_prompts_per_step = max_prompts_per_step
        self.reward_scaling = reward_scaling
        self.drawn: Counter = Counter()
        """Prompts drawn for each step not yet taken (dynamic sampling's bound)."""
        self.zero_advantage_drops: Counter = Counter()
        """Zero-advantage groups dropped for each step not yet taken."""

    # ------------------------------------------------------------ drawing and submitting
    def schedule(self, step: int, n: int | None = None, delay_s: float = 0.0) -> None:
        """Draw ``n`` (default ``per_step``) prompts for ``step`` and submit them, after ``delay_s``
        (:mod:`services.job.backoff`); nothing for a step after ``last_step``. When the data's last epoch
        (``grpo.max_num_epochs``) cannot fill ``step``, ``last_step`` becomes ``step - 1``: the run ends there."""
        if step > self.last_step:
            return
        try:
            requests = self.source.next(n or self.per_step, step, past_end=n is not None)
        except DataExhausted as exc:
            if step == 1:
                raise ValueError(f"data: not one step of {self.per_step} prompts in the training data ({exc})") from exc
            log.info("%s: the run ends at step %d", exc, step - 1)
            self.last_step = step - 1  # a new step needs new data; replacements (n given) draw past the end
            return
        self.drawn[step] += len(requests)
        for r in requests:
            self.ledger.schedule(r.prompt_id, step)
            self.open_requests[r.prompt_id] = r
        if delay_s > 0:
            self.backoff.hold(requests, delay_s)
        else:
            self.submit(requests)

    def resubmit_outstanding(self) -> bool:
        """Submit the open prompts that have no group buffered (after a resume); False when there are none."""
        buffered = {b.group.prompt_id for b in self.buffer.all_groups()}
        pending = [self.open_requests[p] for p in self.ledger.pending() if p not in buffered]
        if pending:
            self.submit(pending)
        return bool(pending)

    def submit_due(self) -> None:
        """Submit the held replacements whose time has come."""
        held = self.backoff.due()
        if held:
            self.submit(held)

    def next_due_in(self) -> float | None:
        return self.backoff.next_due_in()

    # ------------------------------------------------------------ what comes back
    def receive(self, data: bytes) -> None:
        """Account for one message from the channel: buffer a group, or drop and replace a failed prompt,
        or count why it was refused (``malformed``, ``unexpected_group``, ``duplicate``, ``unexpected_kind``)."""
        try:
            msg = decode(data)
        except ProtocolError as err:
            self._reject("malformed")
            log.warning("rejected a message from the pool: %s", err)
            return
        if isinstance(msg, TrajectoryGroup):
            if msg.prompt_id not in self.ledger.scheduled:
                self._reject("unexpected_group")
            elif not self.ledger.is_open(msg.prompt_id) or self.buffer.holds(msg.prompt_id):
                self._reject("duplicate")  # a re-queued prompt whose first group arrived too
            else:
                self.failures.group(msg)  # whatever becomes of the group: its failed samples are on record
                self._accept(msg, data)
        elif isinstance(msg, ControlMessage) and msg.action == "error":
            pid = str(msg.payload.get("prompt_id", ""))
            if self.ledger.is_open(pid) and not self.buffer.holds(pid):
                step = int(msg.payload.get("scheduled_step", self.ledger.scheduled[pid]))
                self.failures.prompt(pid, step, str(msg.payload.get("reason", "generation failed")),
                                     str(msg.payload.get("engine_id", "")))
                self.drop(pid, "generation_failed", replace_for=step)
        else:
            self._reject("unexpected_kind")

    def _accept(self, group: TrajectoryGroup, data: bytes) -> None:
        """Buffer an open prompt's group, or drop it for dynamic sampling (zero advantage) and replace it."""
        if self._resample(group):
            step = self.ledger.scheduled[group.prompt_id]
            self.buffer.drops[ZERO_ADVANTAGE] += 1
            self.zero_advantage_drops[step] += 1
            self.drop(group.prompt_id, ZERO_ADVANTAGE, replace_for=step)
        else:
            self.buffer.add(group, data)

    def drop_undelivered(self, records: list[UndeliveredPrompt]) -> int:
        """Drop (reason ``undelivered``) and replace the open prompts of ``records`` that have no group
        buffered; returns how many were dropped."""
        dropped = 0
        for u in records:
            if self.ledger.is_open(u.prompt_id) and not self.buffer.holds(u.prompt_id):
                log.warning("prompt %s (step %s) was not delivered by engine %s: %s", u.prompt_id,
                            u.scheduled_step, u.engine_id, u.reason)
                self.drop(u.prompt_id, "undelivered", replace_for=u.scheduled_step)
                dropped += 1
        return dropped

    def screen(self, step: int, version: int) -> int:
        """Drop and replace the buffered groups of ``step`` too old for ``version`` or with too few valid
        samples; returns how many good groups ``step`` has."""
        for group, reason in self.buffer.screen(step, version):
            if reason == "too_few_valid_samples":
                self.last_sample_error = next((t.error for t in group.trajectories if t.error),
                                              self.last_sample_error)
            self.drop(group.prompt_id, reason, replace_for=step)
        return self.buffer.ready(step)

    def progressed(self) -> None:
        """A group passed screening: failures are no longer in a row."""
        self.backoff.succeeded()

    def ready(self, step: int) -> int:
        return self.buffer.ready(step)

    def take(self, step: int) -> list[BufferedGroup]:
        """The step's ``per_step`` screened groups."""
        return self.buffer.take(step, self.per_step)

    def sampling_stats(self, step: int, groups: list[BufferedGroup]) -> SamplingStats | None:
        """Dynamic sampling's numbers for ``step``, whose taken ``groups`` are given, and forget the step's
        counts; None when dynamic sampling is off."""
        drawn, dropped = self.drawn.pop(step, 0), self.zero_advantage_drops.pop(step, 0)
        if self.max_prompts_per_step is None:
            return None
        exhausted = sum(zero_advantage(b.group, self.reward_scaling) for b in groups)
        return SamplingStats(dropped, drawn / self.per_step, exhausted)

    def _resample(self, group: TrajectoryGroup) -> bool:
        """Whether dynamic sampling drops ``group`` (zero advantage, and its step's bound not reached)."""
        limit = self.max_prompts_per_step
        step = self.ledger.scheduled[group.prompt_id]
        return limit is not None and self.drawn[step] < limit and zero_advantage(group, self.reward_scaling)

    def settle(self, groups: list[BufferedGroup], trained: bool) -> None:
        """The groups of a train step: trained, or dropped as ``step_skipped`` (:mod:`services.job.skips`)."""
        for b in groups:
            if trained:
                self.ledger.mark_trained(b.group.prompt_id, b.group.scheduled_step)
            else:
                self.ledger.mark_dropped(b.group.prompt_id, DROP_REASON)
            self.open_requests.pop(b.group.prompt_id, None)

    def drop(self, prompt_id: str, reason: str, replace_for: int) -> None:
        """Drop an open prompt with ``reason`` and draw its replacement for step ``replace_for``."""
        self.ledger.mark_dropped(prompt_id, reason)
        self.open_requests.pop(prompt_id, None)
        self._reject(reason)
        self.schedule(replace_for, n=1, delay_s=self.backoff.delay_after(reason))

    def take_rejected(self) -> dict[str, int]:
        """The counts since the last call (for the step's report), cleared."""
        out, self.rejected = dict(self.rejected), {}
        return out

    def losses(self) -> str:
        """What became of the prompts so far, for a step timeout's message."""
        dropped = self.ledger.summary().dropped_by_reason
        return (f"prompts dropped so far, by reason: {dropped or 'none'}; {len(self.ledger.pending())} still pending"
                + (f"; last failed sample: {self.last_sample_error}" if self.last_sample_error else ""))

    def _reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    # ------------------------------------------------------------ checkpoints
    def state(self) -> BookState:
        return BookState(self.source.position(), self.ledger.state(), [b.data for b in self.buffer.all_groups()],
                         [encode(r) for r in self.open_requests.values()], dict(self.buffer.drops))

    def restore(self, state: BookState) -> None:
        self.source.seek(state.data_position)
        self.ledger = PromptLedger.from_state(state.ledger)
        for data in state.buffer:
            self.buffer.add(cast(TrajectoryGroup, decode(data, expect=TrajectoryGroup)), data)
        requests = [cast(PromptRequest, decode(b, expect=PromptRequest)) for b in state.open_requests]
        self.open_requests = {r.prompt_id: r for r in requests}
        self.buffer.drops.update(state.drops)
        open_steps = set(self.ledger.pending().values())
        self.drawn = Counter({s: n for s, n in self.ledger.per_step().items() if s in open_steps})
        self.zero_advantage_drops = Counter({s: n for s, n in self.ledger.per_step(ZERO_ADVANTAGE).items()
                                             if s in open_steps})
