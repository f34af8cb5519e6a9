"""Session-wide Megatron learners on the tiny models (each built once, on first use; never trained — tests that
train build their own)."""
from __future__ import annotations

import os
import warnings

import pytest

from learner_batches import make_learner

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", category=UserWarning)


FROZEN = ("qwen2", "qwen2_tied", "qwen3", "llama", "llama3", "qwen3_moe", "mistral", "nemotron_h",
          "nemotron_h_moe")
"""The families of tests/conftest.py's FAMILIES that get a frozen learner."""


class FrozenLearners(dict):
    """{family: (model_dir, Learner)} at version 0, each built the first time a test asks for it."""

    def __init__(self, family_models):
        super().__init__()
        self.family_models = family_models

    def __missing__(self, name: str):
        if name not in FROZEN:
            raise KeyError(f"{name!r} gets no frozen learner (FROZEN: {FROZEN})")
        self[name] = (self.family_models(name), make_learner(self.family_models(name)))
        return self[name]


@pytest.fixture(scope="session")
def frozen_learners(family_models):
    """:class:`FrozenLearners` of every family in FROZEN."""
    out = FrozenLearners(family_models)
    yield out
    for _, learner in out.values():
        learner.shutdown()
