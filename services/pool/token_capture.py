"""Token capture for the pool's OpenAI endpoint (issue 38, item 2, its core): what vLLM sampled, never re-tokenized.

:class:`CapturingClient` is the engine client vLLM's chat serving talks to: the engine's ``AsyncLLM``, whose
``generate`` also records, per request id, the prompt's token ids and each choice's sampled token ids, their
log-probs (asked of vLLM as ``logprobs=0`` when the caller did not ask: the answer is unchanged) and the policy
version of each token (the engine's ``weight_versions`` spans). A request made in a rollout *session* (the
``x-inflight-session`` header the trainer hands the agent) is kept under that session, bounded, until the
trainer takes the session's completions (:class:`SessionStore`). Pure Python: vLLM's outputs are duck-typed.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

MAX_SESSIONS = 4096
"""Sessions kept per engine; the oldest is dropped beyond (a trainer takes its sessions when episodes end)."""
MAX_COMPLETIONS_PER_SESSION = 1024


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` of one choice were sampled by policy ``version``."""

    version: int
    """The policy version (-1: the engine's label was not a version, i.e. it was never labelled)."""
    start: int
    end: int


@dataclass
class CapturedChoice:
    """One sampled answer: its token ids, the log-prob of each under the policy that sampled it, and versions."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    finish_reason: str = ""
    """Why vLLM ended the answer (``stop``, ``length``, ``abort``); "" while it had not ended."""

    def versions(self) -> list[int]:
        """The policy version of each token (-1 where the engine gave no span)."""
        out = [-1] * len(self.token_ids)
        for s in self.spans:
            out[s.start:s.end] = [s.version] * (min(s.end, len(out)) - s.start)
        return out


@dataclass
class CapturedCompletion:
    """One served request: the prompt's token ids as the engine saw them, and each choice in order."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    choices: dict[int, CapturedChoice] = field(default_factory=dict)

    def in_order(self) -> list[CapturedChoice]:
        return [self.choices[i] for i in sorted(self.choices)]


class CapturingClient:
    """The engine's ``AsyncLLM`` as vLLM's serving layer sees it, recording every request's tokens."""

    def __init__(self, llm: Any):
        self._llm = llm
        self.captured: dict[str, CapturedCompletion] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                       **kwargs: Any) -> AsyncIterator[Any]:
        if getattr(sampling_params, "logprobs", 0) is None:  # the sampled token's log-prob, for the capture
            sampling_params = copy.copy(sampling_params)
            sampling_params.logprobs = 0
        delta = getattr(getattr(sampling_params, "output_kind", None), "name", "") == "DELTA"
        record = self.captured.setdefault(request_id, CapturedCompletion(request_id))
        async for out in self._llm.generate(prompt, sampling_params, request_id, *args, **kwargs):
            if out.prompt_token_ids is not None:
                record.prompt_token_ids = list(out.prompt_token_ids)
            for c in out.outputs:
                _record(record.choices.setdefault(c.index, CapturedChoice()), c, delta)
            yield out

    def take(self, request_id: str) -> CapturedCompletion:
        """The capture of ``request_id`` (forgotten here; empty if it made none)."""
        return self.captured.pop(request_id, CapturedCompletion(request_id))


def _record(choice: CapturedChoice, out: Any, delta: bool) -> None:
    ids = list(out.token_ids)
    lps = [_sampled_logprob(d, t) for d, t in zip(out.logprobs or [], ids, strict=False)]
    if delta:
        choice.token_ids.extend(ids)
        choice.logprobs.extend(lps)
    else:
        choice.token_ids, choice.logprobs = ids, lps
    if getattr(out, "finish_reason", None):
        choice.finish_reason = str(out.finish_reason)
    if getattr(out, "weight_versions", None):
        choice.spans = [VersionSpan(_version(s.version), s.start, s.end) for s in out.weight_versions]


def _sampled_logprob(by_token: Any, token_id: int) -> float:
    entry = by_token.get(token_id) if by_token is not None else None
    return float(entry.logprob) if entry is not None else float("nan")


def _version(label: str) -> int:
    return int(label) if label.isdecimal() else -1


class SessionStore:
    """Captured completions by rollout session, bounded (oldest session dropped; a full session refuses more)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, max_per_session: int = MAX_COMPLETIONS_PER_SESSION):
        self.max_sessions, self.max_per_session = max_sessions, max_per_session
        self._sessions: OrderedDict[str, list[CapturedCompletion]] = OrderedDict()
        self.dropped = 0
        """Completions not kept: their session was full or pushed out by newer sessions."""

    def add(self, session: str, completion: CapturedCompletion) -> None:
        kept = self._sessions.setdefault(session, [])
        self._sessions.move_to_end(session)
        if len(kept) >= self.max_per_session:
            self.dropped += 1
            return
        kept.append(completion)
        while len(self._sessions) > self.max_sessions:
            _, gone = self._sessions.popitem(last=False)
            self.dropped += len(gone)

    def peek(self, session: str) -> list[CapturedCompletion]:
        """The session's completions kept so far, in the order they finished (still kept)."""
        return list(self._sessions.get(session, ()))

    def take(self, session: str) -> list[CapturedCompletion]:
        """The session's completions in the order they finished (forgotten here)."""
        return self._sessions.pop(session, [])
