"""Per-token weight versions without engine-side labels (vLLM releases before per-token labels, e.g. 0.25.1).

Each request streams ``DELTA`` outputs into a :class:`StreamedSample`;
:class:`VersionTracker` keeps the samples still running. An install pauses
generation and, without waiting for the front end, reads how many tokens each
request produced before the pause (:func:`frontend_backlog`: those its sample
holds plus those still in vLLM's output queue or the request's collector);
still paused, once the new version is current, each running sample is marked
at that count: tokens before the mark carry the old version, tokens after it
the new one (docs/rollout.md, "Versions").
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class StreamedSample:
    """The tokens, log-probs and text of one streamed request, and where its weight version changed."""

    version: int
    """The version current when the request was submitted (labels its first tokens)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)
    """``(token count, version)``: tokens from that count on carry that version."""
    finish_reason: str | None = None

    def add(self, completion) -> None:
        """Append one DELTA ``CompletionOutput`` (new tokens, their log-probs and text)."""
        ids = list(completion.token_ids)
        if ids and (completion.logprobs is None or len(completion.logprobs) != len(ids)):
            got = 0 if completion.logprobs is None else len(completion.logprobs)
            raise ValueError(f"streamed output has {got} log-probs for {len(ids)} new tokens")
        self.logprobs += [completion.logprobs[i][tok].logprob for i, tok in enumerate(ids)]
        self.token_ids += ids
        self.text.append(completion.text)
        self.finish_reason = completion.finish_reason

    def relabel(self, version: int, at: int) -> None:
        """Tokens from count ``at`` on carry ``version``."""
        self.marks.append((at, version))

    def versions(self) -> np.ndarray:
        """One version per token."""
        out = np.full(len(self.token_ids), self.version, np.int32)
        for start, version in self.marks:
            out[start:] = version
        return out


class VersionTracker:
    """The streamed samples still running, so an update can mark them all."""

    def __init__(self) -> None:
        self._live: dict[str, StreamedSample] = {}

    def open(self, request_id: str, version: int) -> StreamedSample:
        sample = StreamedSample(version)
        self._live[request_id] = sample
        return sample

    def close(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def boundaries(self, backlog: FrontendBacklog | None) -> dict[str, int | None]:
        """Where each running sample's tokens change version if the version changes at this pause: its count now
        plus its tokens still in the front end's ``backlog`` (None: it had finished, no token of it is to come; 0:
        vLLM had not yet registered it). Without a backlog, the tokens each sample holds."""
        if backlog is None:
            return {request_id: len(sample.token_ids) for request_id, sample in self._live.items()}
        return {request_id: backlog.boundary(request_id, sample) for request_id, sample in self._live.items()}

    def relabel_all(self, version: int, at: dict[str, int | None] | None = None) -> int:
        """Mark every running sample: its tokens from count ``at[request]`` on (:meth:`boundaries`, read at the
        pause; a sample opened since: from its next token) carry ``version``. Returns how many were marked."""
        marked = 0
        for request_id, sample in self._live.items():
            count = (at or {}).get(request_id, len(sample.token_ids))
            if count is not None:
                sample.relabel(version, count)
                marked += 1
        return marked


@dataclass(frozen=True)
class FrontendBacklog:
    """The tokens vLLM's front end had received from the engine core but not yet handed to each request's
    consumer, read in one go while generation is paused."""

    registered: frozenset[str]
    """Requests the front end's output processor still follows (not finished, not aborted)."""
    pending: dict[str, int]
    """Request -> its tokens in the output queue (engine outputs not yet processed) or in its collector
    (processed, not yet taken by the consumer)."""
    frames: int
    """Engine outputs waiting in the output queue."""

    @property
    def tokens(self) -> int:
        """Tokens produced before the pause that had not reached their samples."""
        return sum(self.pending.values())

    def boundary(self, request_id: str, sample: StreamedSample) -> int | None:
        """The count at which ``sample``'s tokens change version; None when it has no tokens to come."""
        if request_id in self.registered:
            return len(sample.token_ids) + self.pending.get(request_id, 0)
        if sample.token_ids or sample.finish_reason is not None:
            return None  # finished before the pause: every token it will hold is already counted
        return 0  # not yet registered with vLLM: each of its tokens comes after the pause


def frontend_backlog(llm: Any) -> FrontendBacklog | None:
    """Read, without waiting, what vLLM's front end (``AsyncLLM``, 0.25.1 and 0.32) holds that its consumers have
    not taken: the engine outputs in the client's output queue and each request's collected output. Call while
    paused, on the engine's event loop, with no await in between: every output produced before the pause has
    then been received (it comes before the pause's reply on the same socket), and the output handler processes
    one engine output whole between two awaits (``VLLM_V1_OUTPUT_PROC_CHUNK_SIZE`` at least ``max_num_seqs``,
    rollout.options). None where the installed vLLM keeps these elsewhere."""
    queue = getattr(getattr(llm, "engine_core", None), "outputs_queue", None)
    states = getattr(getattr(llm, "output_processor", None), "request_states", None)
    waiting = getattr(queue, "_queue", None)
    if not isinstance(queue, asyncio.Queue) or not isinstance(states, dict) or waiting is None:
        return None
    external = {internal: getattr(state, "external_req_id", internal) for internal, state in states.items()}
    pending: Counter[str] = Counter()
    frames = 0
    for item in list(waiting):
        if isinstance(item, Exception):
            continue
        frames += 1
        for out in getattr(item, "outputs", None) or ():
            if out.request_id in external:
                pending[external[out.request_id]] += len(out.new_token_ids)
    for internal, state in states.items():
        collected = getattr(getattr(state, "queue", None), "output", None)
        for completion in getattr(collected, "outputs", None) or ():
            pending[external[internal]] += len(completion.token_ids)
    return FrontendBacklog(frozenset(external.values()), dict(pending), frames)
