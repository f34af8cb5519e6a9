"""One real vLLM rollout engine for the rollout integration tests, driven from a private event loop.

The engine (tiny Qwen2, float32, eager) starts once; tests run coroutines on
its loop with :func:`run`. Tests that change the engine's weights, sampling
settings or reward function put them back before they finish.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from rollout.config import GenerationConfig, VllmConfig
from rollout.engine import RolloutEngine
from rollout.rewards import get_reward_fn

MAX_MODEL_LEN = 512
CALL_TIMEOUT_S = 300.0


class EngineHarness:
    """A started :class:`RolloutEngine` and the loop it lives on."""

    def __init__(self, engine: RolloutEngine, loop: asyncio.AbstractEventLoop, model_dir: str):
        self.engine = engine
        self.loop = loop
        self.model_dir = model_dir

    def run(self, coro, timeout: float = CALL_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def harness(tiny_model_dir):
    """The started engine; module-scoped so it is shut down (its core and RAM freed) before other packages' tests."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="rollout-engine-loop", daemon=True)
    thread.start()
    generation = GenerationConfig(max_new_tokens=16, request_timeout_s=120.0, max_retries=1,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0,
                                                      gpu_memory_utilization=0.5))
    engine = RolloutEngine(tiny_model_dir, generation, MAX_MODEL_LEN, get_reward_fn("repeat_letter"),
                           engine_id="test", initial_version=0)
    h = EngineHarness(engine, loop, tiny_model_dir)
    try:
        h.run(engine.start(), timeout=engine.start_timeout_s + 10)
        yield h
    finally:
        h.run(engine.shutdown(), timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
