"""Session-wide fixtures: tiny models are built once per test session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Qwen2 (seed 0, float32) with its local tokenizer."""
    from services.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-s0"), seed=0, arch="qwen2"))


@pytest.fixture(scope="session")
def tiny_model_dir_v2(tmp_path_factory, tiny_model_dir):
    """Same architecture and tokenizer as ``tiny_model_dir``, different random weights (seed 1)."""
    from services.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-s1"), seed=1, arch="qwen2",
                               tokenizer_from=tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, top-2)."""
    from services.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-moe"), seed=0, arch="qwen3_moe"))
