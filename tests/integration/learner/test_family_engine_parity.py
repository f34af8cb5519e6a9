"""Every model family through real vLLM (CPU, float32): an engine started on other random weights serves the
learner's log-probs after one push of the learner's export, and the job's parity check stops a damaged push.

One engine per family, started and shut down inside its test (~30 s each on 2 cores). After the push the
engine takes damaged copies of the same export, one tensor each (:data:`DAMAGES`: an attention output
projection for every family; for the Nemotron-H hybrids also the Mamba tensors a loader has got wrong
upstream: ``D`` dropped, the ``conv1d`` alias mangled, ``A_log``, which vLLM stores as ``A = -exp(A_log)``),
and :func:`services.job.parity.check_parity` with the recipe defaults must refuse each. Plain Qwen2 is
covered by tests/integration/rollout (push, then vLLM vs transformers) and the pool tests' parity probe
(learner vs engine after every refit; a scrambled install on one of two engines in test_faults)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
import torch

from learner_batches import sequences

ENGINE_FAMILIES = ["qwen2_tied", "qwen3", "llama3", "qwen3_moe", "mistral", "nemotron_h", "nemotron_h_moe"]
ATOL = 1e-4
DAMAGES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "o_proj.weight": lambda t: t.flip(0),       # attention output rows reversed
    "mixer.D": torch.zeros_like,                # Mamba's skip term dropped
    "mixer.conv1d.weight": lambda t: t.flip(-1),  # causal conv kernel reversed
    "mixer.A_log": torch.neg,                   # A = -exp(-A_log): the decay of every head changed
}
"""Name suffix -> what a damaged install does to the first exported tensor whose name ends with it."""


def _damaged(state: dict[str, torch.Tensor], suffix: str) -> tuple[str, dict[str, torch.Tensor]] | None:
    name = next((n for n in state if n.endswith(suffix)), None)
    return None if name is None else (name, {**state, name: DAMAGES[suffix](state[name])})


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_serves_the_learners_logprobs_after_a_push(frozen_learners, family_models, family):
    from learner.hf_export import export_hf_state_dict, pack_hf_buckets
    from rollout.config import GenerationConfig, VllmConfig
    from rollout.engine import RolloutEngine
    from rollout.rewards.registry import get_reward_fn
    from services.recipe.logger import LoggerConfig
    from services.job.parity import ParityError, check_parity, parity_stats

    _, learner = frozen_learners[family]
    prompts, responses = sequences(4, seed=3)
    ours = learner.logprobs(prompts, responses)
    state = export_hf_state_dict(learner.gpt, learner.arch, learner.hf_metas)
    assert state is not None
    damaged = {suffix: d for suffix in DAMAGES if (d := _damaged(state, suffix)) is not None}
    assert ("mixer.A_log" in damaged) == (learner.arch.hybrid is not None)
    generation = GenerationConfig(max_new_tokens=4, request_timeout_s=120.0, max_retries=1,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0,
                                                      gpu_memory_utilization=0.5))
    engine = RolloutEngine(family_models(family, seed=1), generation, 128, get_reward_fn("repeat_letter"),
                           engine_id=f"family-{family}")
    p, r = [x.tolist() for x in prompts], [y.tolist() for y in responses]

    async def push(tensors: dict[str, torch.Tensor], version: int) -> list:
        assert await engine.install(*pack_hf_buckets(tensors, learner.hf_metas, version, 1 << 20)) == version
        return await engine.logprobs_of(p, r)

    async def before_after_and_damaged():
        await asyncio.wait_for(engine.start(), engine.start_timeout_s + 10)
        try:
            before = await engine.logprobs_of(p, r)
            after = await push(state, 1)
            wrong = {suffix: await push(tensors, 2 + i) for i, (suffix, (_, tensors)) in enumerate(damaged.items())}
            return before, after, wrong
        finally:
            await engine.shutdown()

    before, after, wrong = asyncio.run(before_after_and_damaged())
    diff = lambda got: max(float(np.abs(a - b).max()) for a, b in zip(got, ours))  # noqa: E731
    print(f"\n{family}: max |Δ logprob| engine vs learner before the push {diff(before):.2e}, "
          f"after {diff(after):.2e}")
    assert diff(before) > 0.1  # other weights: the comparison can fail
    for a, b in zip(after, ours):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
    limits = LoggerConfig()
    right = parity_stats(after, ours)
    check_parity(right, limits.parity_max_gen_kl, 1)
    for version, (suffix, lps) in enumerate(wrong.items(), start=2):
        stats = parity_stats(lps, ours)
        print(f"  {damaged[suffix][0]} damaged: gen KL {stats['gen_kl_error']:.2e} (right push "
              f"{right['gen_kl_error']:.2e}), max |Δ logprob| {stats['parity_max_abs_logprob_diff']:.2e}")
        with pytest.raises(ParityError, match="not serving the learner's weights"):
            check_parity(stats, limits.parity_max_gen_kl, version, [right["gen_kl_error"]],
                         limits.parity_max_gen_kl_ratio)
