"""Every model family through real vLLM (CPU, float32): an engine started on other random weights serves the
learner's log-probs after one push of the learner's export.

One engine per family, started and shut down inside its test (~30 s each on 2 cores). Plain Qwen2 is covered
by tests/integration/rollout (push, then vLLM vs transformers) and the pool tests' parity probe (learner vs
engine after every refit)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from learner_batches import sequences

ENGINE_FAMILIES = ["qwen2_tied", "qwen3", "llama3", "qwen3_moe", "mistral"]
ATOL = 1e-4


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_serves_the_learners_logprobs_after_a_push(frozen_learners, family_models, family):
    from learner.hf_weights import export_hf_state_dict, pack_hf_buckets
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards import get_reward_fn

    _, learner = frozen_learners[family]
    prompts, responses = sequences(4, seed=3)
    ours = learner.logprobs(prompts, responses)
    state = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    assert state is not None
    manifest, buckets = pack_hf_buckets(state, learner.hf_metas, version=1, bucket_bytes=1 << 20)
    generation = GenerationConfig(max_new_tokens=4, request_timeout_s=120.0, max_retries=1,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0,
                                                      gpu_memory_utilization=0.5))
    engine = RolloutEngine(family_models(family, seed=1), generation, 128, get_reward_fn("repeat_letter"),
                           engine_id=f"family-{family}")
    p, r = [x.tolist() for x in prompts], [y.tolist() for y in responses]

    async def before_and_after():
        await asyncio.wait_for(engine.start(), engine.start_timeout_s + 10)
        try:
            before = await engine.logprobs_of(p, r)
            assert await engine.install(manifest, buckets) == 1
            return before, await engine.logprobs_of(p, r)
        finally:
            await engine.shutdown()

    before, after = asyncio.run(before_and_after())
    diff = lambda got: max(float(np.abs(a - b).max()) for a, b in zip(got, ours))  # noqa: E731
    print(f"\n{family}: max |Δ logprob| engine vs learner before the push {diff(before):.2e}, "
          f"after {diff(after):.2e}")
    assert diff(before) > 0.1  # other weights: the comparison can fail
    for a, b in zip(after, ours):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
