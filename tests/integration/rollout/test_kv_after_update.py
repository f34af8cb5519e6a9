"""Running requests keep their KV cache across an in-flight update, or recompute it -- counted by vLLM itself.

``recompute_kv_cache_after_weight_updates`` False pauses with ``clear_cache=False``: the
requests running at the update must not be preempted or prefilled again. True pauses
with ``clear_cache=True``: vLLM preempts every running request and prefills its prompt
and the tokens it had sampled again, now with the new weights. The counters are vLLM's
scheduler statistics (``rollout.kv_stats``), exposed in ``RolloutEngine.stats()``.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from model_weights import model_tensors
from protocol import pack_buckets
from services.data.tasks import make_prompts

from rollout_engine_helpers import GROUP_SIZE, push_model

KV_KEYS = ("kv_preemptions", "kv_reprefill_tokens", "kv_reprefill_cached_tokens")
TOKENS_BEFORE_UPDATE = 8
"""Tokens per sample (on average) that the engine samples under v before the update is applied."""


def _generated_tokens() -> float:
    """vLLM's ``vllm:generation_tokens`` counter of this process (the harness engine's front end)."""
    from prometheus_client import REGISTRY
    return sum(s.value for m in REGISTRY.collect() if m.name == "vllm:generation_tokens"
               for s in m.samples if s.name.endswith("_total"))


def _update_while_running(harness, new_model_dir: str, recompute_kv: bool):
    """Run 3 groups, push ``new_model_dir`` while every sample runs; returns (requests, groups, v, counter deltas)."""
    engine = harness.engine
    reqs = make_prompts("repeat_letter", engine.tokenizer, 3, 23)
    v, n = engine.version, len(reqs) * GROUP_SIZE
    generated = _generated_tokens()

    async def scenario():
        tasks = [asyncio.create_task(engine.generate_group(r, GROUP_SIZE)) for r in reqs]
        while engine.stats()["requests_running"] < n:
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 60
        while _generated_tokens() - generated < TOKENS_BEFORE_UPDATE * n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the samples run as one batch: each has sampled some tokens under v
        manifest, buckets = pack_buckets(model_tensors(new_model_dir), v + 1, 1 << 20)
        await engine.install(manifest, buckets)
        return await asyncio.gather(*tasks)

    old_max, old_recompute = engine.generation.max_new_tokens, engine.installer.recompute_kv_cache_after_weight_updates
    before = engine.stats()
    engine.generation.max_new_tokens = 400
    engine.installer.recompute_kv_cache_after_weight_updates = recompute_kv
    try:
        groups = harness.run(scenario())
        after = engine.stats()
    finally:
        engine.generation.max_new_tokens = old_max
        engine.installer.recompute_kv_cache_after_weight_updates = old_recompute
        push_model(harness, harness.model_dir)
    return reqs, groups, v, {k: after[k] - before[k] for k in KV_KEYS}


def _split_at_update(reqs, groups, v: int) -> tuple[list[tuple[int, int]], list[int]]:
    """(prompt tokens, tokens sampled under v) of each sample with tokens of both v and v+1 (running at
    the update), and the prompt sizes of samples with v+1 tokens only (perhaps still in their first prefill)."""
    running, late = [], []
    for request, group in zip(reqs, groups):
        for t in group.trajectories:
            assert t.ok, t.error
            k = int((t.versions == v).sum())
            if 0 < k < t.response_ids.size:
                running.append((request.prompt_ids.size, k))
            elif k == 0:
                late.append(request.prompt_ids.size)
    return running, late


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_running_requests_keep_or_recompute_kv_cache(harness, tiny_model_dir_v2, recompute_kv):
    reqs, groups, v, kv = _update_while_running(harness, tiny_model_dir_v2, recompute_kv)
    running, late = _split_at_update(reqs, groups, v)
    expected_reprefill = sum(p + k for p, k in running)
    print(f"\nrecompute_kv={recompute_kv}: {len(running)} samples straddled the update "
          f"(prompt + pre-update tokens: {expected_reprefill}), {len(late)} had none under v; vLLM counted {kv}")
    assert len(running) >= len(reqs) * GROUP_SIZE // 2, "most samples must be running at the update"
    if not recompute_kv:
        assert kv == {k: 0 for k in KV_KEYS}, "running requests were prefilled again although their KV is kept"
        return
    # Every request running at the pause is preempted once and prefilled again with all its tokens.
    assert len(running) <= kv["kv_preemptions"] <= len(running) + len(late), kv
    assert expected_reprefill <= kv["kv_reprefill_tokens"] <= expected_reprefill + sum(late), kv
    recomputed = kv["kv_reprefill_tokens"] - kv["kv_reprefill_cached_tokens"]
    assert recomputed >= sum(k for _, k in running), "the tokens sampled before the update must be computed again"
