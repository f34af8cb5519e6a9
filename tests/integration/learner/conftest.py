"""Session-wide Megatron learners on the tiny models (built once; never trained — tests that
train build their own)."""
from __future__ import annotations

import os
import warnings

import pytest

from learner_batches import make_learner

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", category=UserWarning)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory, tiny_model_dir):
    from services.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0, arch="llama",
                               tokenizer_from=tiny_model_dir))


@pytest.fixture(scope="session")
def frozen_learners(tiny_model_dir, llama_dir, tiny_moe_dir):
    """{arch: (model_dir, Learner)} for qwen2, llama and qwen3_moe at version 0."""
    out = {"qwen2": (tiny_model_dir, make_learner(tiny_model_dir)),
           "llama": (llama_dir, make_learner(llama_dir)),
           "qwen3_moe": (tiny_moe_dir, make_learner(tiny_moe_dir))}
    yield out
    for _, learner in out.values():
        learner.shutdown()
