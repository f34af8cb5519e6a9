"""Session-wide fixtures: tiny models are built once per test session."""
from __future__ import annotations

import os

import pytest
from time_budget import (  # noqa: F401  (hooks: each module's seconds, tests/budgets.toml)
    pytest_addoption,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
"""On CPU, vLLM 0.32 then runs the model worker inside the engine core process (the "uni" executor) instead of a
third process of its own (vllm/platforms/cpu.py switches "uni" to "mp" only when it is 1): one fewer process to
start and import per engine, about 15 s of the ~57 s a one-engine pool took to deploy on 2 cores (42 s with it).
``AsyncLLM`` keeps its engine core in a child process either way, so the tests that kill the engine core still
kill a process of its own. Set before Ray starts, so the session's cluster, its actors and the CLI subprocesses
inherit it, as the GPU hosts do (docs/gpu.md)."""


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
    from services.models.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-s0"), seed=0, arch="qwen2"))


@pytest.fixture(scope="session")
def tiny_model_dir_v2(tmp_path_factory, tiny_model_dir):
    """Same architecture and tokenizer as ``tiny_model_dir``, different random weights (seed 1)."""
    from services.models.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-s1"), seed=1, arch="qwen2",
                               tokenizer_from=tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, top-2)."""
    from services.models.tiny_model import make_tiny_model
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-moe"), seed=0, arch="qwen3_moe"))


FAMILIES = {"qwen2": ("qwen2", False), "qwen2_tied": ("qwen2", True), "qwen3": ("qwen3", False),
            "llama": ("llama", False), "llama3": ("llama3", False), "qwen3_moe": ("qwen3_moe", False),
            "mistral": ("mistral", False), "nemotron_h": ("nemotron_h", False),
            "nemotron_h_moe": ("nemotron_h_moe", False)}
"""Every supported model family as a tiny model: name -> (``make_tiny_model`` arch, tie_word_embeddings)."""


@pytest.fixture(scope="session")
def family_models(tmp_path_factory, tiny_model_dir, tiny_moe_dir):
    """``family_models(name, seed=0)``: the tiny model of a family in :data:`FAMILIES` (tokenizer of
    ``tiny_model_dir``), built on first use and reused for the rest of the session."""
    from services.models.tiny_model import make_tiny_model

    built = {("qwen2", 0): tiny_model_dir, ("qwen3_moe", 0): tiny_moe_dir}

    def get(name: str, seed: int = 0) -> str:
        if (name, seed) not in built:
            arch, tied = FAMILIES[name]
            out = tmp_path_factory.mktemp(f"tiny-{name}-s{seed}")
            built[name, seed] = str(make_tiny_model(out, seed=seed, arch=arch, tie_word_embeddings=tied,
                                                    tokenizer_from=tiny_model_dir))
        return built[name, seed]
    return get
