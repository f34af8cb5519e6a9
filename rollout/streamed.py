"""Per-token weight versions without engine-side labels (vLLM releases before per-token labels, e.g. 0.25.1).

vLLM 0.32 stamps every output token with the weight version it was sampled
under (``CompletionOutput.weight_versions``); older releases, such as the
0.25.1 that runs on the GPU hosts, do not. There the engine streams each
request (``output_kind=DELTA``) into a :class:`StreamedSample`, and
:class:`VersionTracker` keeps every sample still running. An in-flight weight
update pauses generation (``keep``), lets the front end deliver the outputs
the engine produced before the pause (:func:`drain_frontend`), and -- still
paused, at the moment the new version becomes current -- marks each running
sample's token count: tokens before the mark carry the old version, tokens
after it the new one.

Exactness: vLLM resolves the pause reply as soon as it reaches the front end,
while step outputs pass through an output queue and the output handler first
(``AsyncLLM.pause_generation`` sleeps a fixed 20 ms for this, and the engine
keeps that sleep on this path). :func:`drain_frontend` then waits, up to a bound,
until that queue is empty and yields to the tasks that consume the outputs,
so the marks are exact unless the front end is still
behind when the bound runs out (then some tokens sampled under v are labelled
v+1; the log-probs recorded for them are still the ones they were sampled
with). :func:`drain_frontend` reports whether the drain completed.
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
