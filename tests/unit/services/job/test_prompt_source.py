"""The seeded, resumable prompt stream (services/job/prompt_source.py)."""
from __future__ import annotations

import numpy as np
import pytest

from protocol import PromptRequest
from services.job.prompt_source import PromptSource


def _prompts(n):
    return [PromptRequest(f"p{i}", np.array([i + 1]), {"answer": str(i)}) for i in range(n)]


def test_prompt_source_is_seeded_unique_and_resumable():
    a, b = PromptSource(_prompts(5), seed=7), PromptSource(_prompts(5), seed=7)
    first = [r.prompt_id for r in a.next(12, step=1)]
    assert first == [r.prompt_id for r in b.next(12, step=1)]
    assert len(set(first)) == 12  # ids stay unique across epochs
    assert {r.split("@")[1] for r in first} == {"0", "1", "2"}
    pos = a.position()
    c = PromptSource(_prompts(5), seed=7)
    c.seek(pos)
    assert [r.prompt_id for r in c.next(4, 3)] == [r.prompt_id for r in a.next(4, 3)]
    assert all(r.scheduled_step == 3 for r in c.next(2, 3))
    assert [r.prompt_id for r in PromptSource(_prompts(5), seed=8).next(5, 1)] != first[:5]
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], seed=0)
