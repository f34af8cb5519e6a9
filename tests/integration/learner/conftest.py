"""Session-wide Megatron learners on the tiny models (built once; never trained — tests that
train build their own)."""
from __future__ import annotations

import os
import warnings

import pytest

from learner_batches import make_learner

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", category=UserWarning)


FROZEN = ("qwen2", "qwen2_tied", "qwen3", "llama", "llama3", "qwen3_moe", "mistral")
"""The families of tests/conftest.py's FAMILIES that get a frozen learner."""


@pytest.fixture(scope="session")
def frozen_learners(family_models):
    """{family: (model_dir, Learner)} for every family in FROZEN at version 0."""
    out = {name: (family_models(name), make_learner(family_models(name))) for name in FROZEN}
    yield out
    for _, learner in out.values():
        learner.shutdown()
