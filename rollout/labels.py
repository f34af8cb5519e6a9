"""Per-token weight versions: which of the two labelling modes an engine uses, and each mode's bookkeeping.

Engine-side labels (vLLM 0.32): the engine core stamps every step's output with
a version label (``AsyncLLM.update_weight_version``, changed only while
generation is paused) and a finished request reports ``weight_versions`` spans;
requests run ``FINAL_ONLY``. Streamed labels (older vLLM, e.g. the GPU hosts'
0.25.1): requests stream ``DELTA`` outputs and an install marks each running
sample's token count while paused (:mod:`rollout.streamed`). docs/rollout.md
("Versions") has the details.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout.streamed import StreamedSample, VersionTracker, frontend_backlog

logger = logging.getLogger(__name__)


def engine_labels_available() -> bool:
    """Whether the installed vLLM labels outputs with weight versions itself."""
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    return "weight_versions" in CompletionOutput.__dataclass_fields__ and hasattr(AsyncLLM, "update_weight_version")


@dataclass(frozen=True)
class Drain:
    """Where the running samples' versions change at a pause (streamed labels), read without waiting."""

    complete: bool
    """The front end's backlog could be read, so every mark is exact (always True with engine-side labels)."""
    backlog: int
    """Engine outputs still waiting in the front end's queue when the pause took effect (0 with engine-side
    labels, or when the installed vLLM has no such queue)."""
    pending_tokens: int = 0
    """Tokens produced before the pause that had not yet reached their samples (counted into the marks)."""
    at: dict[str, int | None] | None = None
    """Request -> the token count where its version changes (``VersionTracker.boundaries``); None: no marks."""


class VersionLabels:
    """How one engine's tokens get their weight version: engine-side spans, or streamed marks."""

    def __init__(self) -> None:
        self.engine_side = False
        """The installed vLLM labels outputs (set by :meth:`detect`); its label is then kept current."""
        self.streamed = True
        """Label tokens by streaming rather than by the engine's spans; read at every request, and at
        every install (tests switch it to exercise the streamed path on a vLLM with labels)."""
        self._tracker = VersionTracker()

    def detect(self, engine_id: str) -> None:
        """Choose the mode the installed vLLM supports (call once, before the engine starts)."""
        self.engine_side = engine_labels_available()
        self.streamed = not self.engine_side
        logger.info("rollout engine %s: per-token weight versions from %s", engine_id,
                    "the engine's labels" if self.engine_side else "streamed outputs (no engine labels)")

    def open(self, request_id: str, version: int) -> StreamedSample | None:
        """Start following a request submitted under ``version``; None when the engine's spans label it."""
        return self._tracker.open(request_id, version) if self.streamed else None

    def close(self, request_id: str) -> None:
        self._tracker.close(request_id)

    async def set_label(self, llm: Any, version: int) -> None:
        """Make ``version`` the engine's label for the tokens it samples from now on (engine-side mode only)."""
        if self.engine_side:
            await llm.update_weight_version(str(version))

    def drain(self, llm: Any) -> Drain:
        """While paused with streamed labels: read where each running sample's version changes, counting the
        tokens the front end still holds (no wait; nothing to do with engine-side labels)."""
        if not self.streamed:
            return Drain(True, 0)
        backlog = frontend_backlog(llm)
        at = self._tracker.boundaries(backlog)
        if backlog is None:
            return Drain(False, 0, 0, at)
        return Drain(True, backlog.frames, backlog.tokens, at)

    def mark_running(self, version: int, drained: Drain) -> None:
        """While still paused, once ``version`` is current: the running streamed samples' tokens from the pause
        on carry it."""
        self._tracker.relabel_all(version, drained.at)

    @staticmethod
    def span_versions(completion: Any, n_tokens: int) -> np.ndarray:
        """One version per output token from a finished request's ``weight_versions`` spans; ValueError
        if the spans do not cover every token."""
        versions = np.empty(n_tokens, np.int32)
        covered = 0
        for span in completion.weight_versions or []:
            versions[span.start:span.end] = int(span.version)
            covered += span.end - span.start
        if covered != n_tokens:
            raise ValueError(f"engine reported weight versions for {covered} of {n_tokens} tokens")
        return versions
