"""Per-token weight versions without engine-side labels (vLLM releases before per-token labels, e.g. 0.25.1).

Each request streams ``DELTA`` outputs into a :class:`StreamedSample`;
:class:`VersionTracker` keeps the samples still running. An install pauses
generation, lets the front end deliver the outputs produced before the pause
(:func:`drain_frontend`), and -- still paused, once the new version is current
-- marks each running sample's token count: tokens before the mark carry the
old version, tokens after it the new one. The marks are exact unless the front
end is still behind when the drain's bound runs out (:func:`drain_frontend`
then returns False; docs/rollout.md, "Versions").
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

DRAIN_LIMIT_S = 0.5
"""Longest wait for the front end to deliver the outputs produced before a pause."""


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

    def relabel(self, version: int) -> None:
        """Tokens produced from now on carry ``version``."""
        self.marks.append((len(self.token_ids), version))

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

    def relabel_all(self, version: int) -> int:
        """Mark every running sample: its next tokens carry ``version``. Returns how many were marked."""
        for sample in self._live.values():
            sample.relabel(version)
        return len(self._live)


async def drain_frontend(llm, limit_s: float = DRAIN_LIMIT_S) -> bool:
    """Wait (at most ``limit_s``) until the engine's output queue is empty, then let consumers run.

    Call while generation is paused. Returns False if the queue was still not
    empty at the bound, or the installed vLLM has no such queue to watch."""
    queue = getattr(getattr(llm, "engine_core", None), "outputs_queue", None)
    if not isinstance(queue, asyncio.Queue):
        return False
    deadline = time.monotonic() + limit_s
    while not queue.empty():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.001)
    for _ in range(4):  # the output handler's last chunk, then the per-request consumers
        await asyncio.sleep(0)
    return True
