"""One real vLLM rollout engine for the rollout integration tests, driven from a private event loop.

The engine (tiny Qwen2, float32, eager) starts once for every module of this
directory; tests run coroutines on its loop with :func:`run`. Tests that change
the engine's weights, sampling settings or reward function put them back before
they finish. It is shut down after the directory's last test, before the tests
of other directories run (:func:`pytest_runtest_teardown`).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from rollout.config import GenerationConfig, VllmConfig, VllmKwargs
from rollout.engine import RolloutEngine
from rollout.rewards.registry import get_reward_fn
from rollout_engine_helpers import HARNESS_VLLM_KWARGS

MAX_MODEL_LEN = 512
CALL_TIMEOUT_S = 300.0
HERE = Path(__file__).resolve().parent
_RUNNING: list[Callable[[], None]] = []
"""The shutdown of the shared engine while it runs."""


class EngineHarness:
    """A started :class:`RolloutEngine` and the loop it lives on."""

    def __init__(self, engine: RolloutEngine, loop: asyncio.AbstractEventLoop, model_dir: str):
        self.engine = engine
        self.loop = loop
        self.model_dir = model_dir
        self.closed = False

    def run(self, coro, timeout: float = CALL_TIMEOUT_S):
        if self.closed:
            coro.close()
            raise RuntimeError("the rollout harness engine was shut down after the last test of "
                               f"{HERE} ran; run this directory's tests together")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="session")
def harness(tiny_model_dir):
    """The started engine, shared by the modules of this directory; shut down (its core and RAM freed) after the
    directory's last test, before other directories' tests (a session fixture torn down early: this directory
    is not a Python package, so pytest's "package" scope would keep it to the end of the session)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rollout-engine-loop", daemon=True)
    thread.start()
    generation = GenerationConfig(max_new_tokens=16, request_timeout_s=120.0, max_retries=1,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0,
                                                      gpu_memory_utilization=0.5),
                                  vllm_kwargs=VllmKwargs.model_validate(HARNESS_VLLM_KWARGS))
    engine = RolloutEngine(tiny_model_dir, generation, MAX_MODEL_LEN, get_reward_fn("repeat_letter"),
                           engine_id="test", initial_version=0)
    h = EngineHarness(engine, loop, tiny_model_dir)

    def close() -> None:
        if h.closed:
            return
        try:
            h.run(engine.shutdown(), timeout=120)
        finally:
            h.closed = True
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)

    _RUNNING.append(close)
    try:
        h.run(engine.start(), timeout=engine.start_timeout_s + 10)
        yield h
    finally:
        if close in _RUNNING:
            _RUNNING.remove(close)
        close()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After this directory's last test (the next one is elsewhere, or none): shut the shared engine down."""
    if _RUNNING and (nextitem is None or HERE not in Path(nextitem.path).resolve().parents):
        _RUNNING.pop()()
