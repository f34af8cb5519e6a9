"""The rollout engine on real vLLM (CPU, tiny float32 Qwen2): groups, streaming, versions, refits, failures."""
from __future__ import annotations

import asyncio
import functools
import time

import numpy as np
import psutil
import pytest
import torch

from protocol import pack_buckets
from rollout.rewards.registry import RewardFailure
from services.data.tasks import make_prompts
from rollout.install.weight_receiver import WeightUpdateError
from rollout.options import OUTPUT_CHUNK_ENV

from model_weights import model_tensors
from rollout_engine_helpers import GROUP_SIZE, push_model


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(model_dir: str, prompt: list[int], response: list[int]) -> np.ndarray:
    """Float32 ``transformers`` log-probs of ``response`` given ``prompt``."""
    model = hf_model(model_dir)
    tokens = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(tokens).logits[0, :-1].float()
    lps = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
    return lps[len(prompt) - 1:].numpy()


def tokens_of(group) -> list[list[int]]:
    return [t.response_ids.tolist() for t in group.trajectories]


def prompts(harness, n: int, task: str = "repeat_letter", seed: int = 0):
    return make_prompts(task, harness.engine.tokenizer, n, seed)


def test_group_has_g_samples_with_logprobs_and_current_version(harness):
    engine = harness.engine
    group = harness.run(engine.generate_group(prompts(harness, 1)[0], GROUP_SIZE))
    assert len(group.trajectories) == GROUP_SIZE == group.group_size
    assert group.vocab_size == engine.vocab_size
    for t in group.trajectories:
        assert t.ok, t.error
        assert 0 < t.response_ids.size <= engine.generation.max_new_tokens
        assert t.logprobs.shape == t.response_ids.shape and np.isfinite(t.logprobs).all()
        assert (t.logprobs <= 0).all()
        assert (t.versions == engine.version).all()
        assert t.reward is not None and 0.0 <= t.reward <= 1.0
    assert len({tuple(ids) for ids in tokens_of(group)}) > 1, "samples of a group should differ"


def test_groups_stream_as_they_finish(harness):
    """The slow group (its reward takes 3 s) must not hold back the fast ones."""
    engine = harness.engine
    reqs = prompts(harness, 3)
    slow_id = reqs[0].prompt_id
    reqs[0].task["slow"] = 1
    original = engine.sampler.reward_fn

    async def reward(batch):
        if batch[0].task.get("slow"):
            await asyncio.sleep(3.0)
        return [0.5] * len(batch)

    async def collect():
        arrivals = []
        async for group in engine.generate(reqs, GROUP_SIZE):
            arrivals.append((group.prompt_id, time.monotonic()))
        return arrivals

    engine.sampler.reward_fn = reward
    try:
        arrivals = harness.run(collect())
    finally:
        engine.sampler.reward_fn = original
    order = [pid for pid, _ in arrivals]
    assert sorted(order) == sorted(r.prompt_id for r in reqs)
    assert order[-1] == slow_id, order
    assert arrivals[-1][1] - arrivals[0][1] > 2.0, "the first group should arrive well before the slow one"


def test_push_changes_outputs_and_restoring_with_reset_is_bit_identical(harness, tiny_model_dir, tiny_model_dir_v2):
    engine = harness.engine
    request = prompts(harness, 1, seed=7)[0]
    before = harness.run(engine.generate_group(request, GROUP_SIZE))
    v_before = engine.version
    assert push_model(harness, tiny_model_dir_v2) == v_before + 1 == engine.version
    changed = harness.run(engine.generate_group(request, GROUP_SIZE))
    assert tokens_of(changed) != tokens_of(before)
    assert all((t.versions == v_before + 1).all() for t in changed.trajectories)
    manifest, buckets = pack_buckets(model_tensors(tiny_model_dir), v_before, 1 << 20)
    assert harness.run(engine.install(manifest, buckets, reset=True)) == v_before == engine.version
    restored = harness.run(engine.generate_group(request, GROUP_SIZE))
    assert tokens_of(restored) == tokens_of(before)
    for a, b in zip(restored.trajectories, before.trajectories):
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    stats = engine.stats()
    assert stats["refits"] >= 2 and stats["refit_bytes_total"] > 0 and stats["refit_seconds_last"] > 0
    print(f"\nrefit {stats['refit_seconds_last'] * 1e3:.0f} ms (pause {stats['pause_seconds_last'] * 1e3:.0f} ms), "
          f"{stats['refit_bytes_total'] // stats['refits']} bytes per push")


@pytest.mark.parametrize("recompute_kv,streamed", [(False, False), (True, False), (False, True), (False, "behind")])
def test_update_during_running_requests_splits_versions(harness, tiny_model_dir, tiny_model_dir_v2, recompute_kv,
                                                        streamed):
    """Tokens sampled before the pause carry v and match the old weights; the rest carry v+1.

    With the KV cache recomputed after the update, the v+1 tokens match a full
    forward of the new weights; with the old KV kept, they differ from the old weights.
    ``streamed``: labels from streamed outputs (the path for a vLLM without engine labels); ``"behind"``: the
    same with the front end behind the engine core when the pause takes effect: the last five engine outputs
    before it still wait in the client's output queue, not yet taken by vLLM's output handler (on an
    H100 the 0.25.1 queue was not empty 0.5 s into most pauses), so the marks must count their tokens."""
    engine = harness.engine
    engine_labels = engine.labels.streamed
    reqs = prompts(harness, 3, seed=11)
    old_max = engine.generation.max_new_tokens
    v = engine.version
    core = engine.async_llm().engine_core
    queue = core.outputs_queue

    async def pause_behind(mode, clear_cache, pause=core.pause_scheduler_async):
        held: list = []
        queue.put_nowait = held.append  # the engine core samples on; its outputs stop short of the handler
        deadline = time.monotonic() + 2.0
        while len(held) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        await pause(mode=mode, clear_cache=clear_cache)
        del queue.put_nowait
        queue._queue.extend(held)  # queued, the handler not woken: it takes them with the first output after
        assert held, "no engine output came in 2 s"

    async def scenario():
        tasks = [asyncio.create_task(engine.generate_group(r, GROUP_SIZE)) for r in reqs]
        while engine.stats()["requests_running"] < len(reqs) * GROUP_SIZE:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # let every sample produce some tokens under v
        manifest, buckets = pack_buckets(model_tensors(tiny_model_dir_v2), v + 1, 1 << 20)
        await engine.install(manifest, buckets)
        if streamed == "behind":
            queue._wakeup_next(queue._getters)  # the handler takes the held outputs even if no sample runs on
        return await asyncio.gather(*tasks)

    engine.generation.max_new_tokens = 400
    engine.installer.recompute_kv_cache_after_weight_updates = recompute_kv
    engine.labels.streamed = bool(streamed) or engine_labels
    if streamed == "behind":
        core.pause_scheduler_async = pause_behind
    try:
        groups = harness.run(scenario())
        installs = engine.installer.stats
        complete, pending, queued = (installs.drain_complete_last, installs.drain_pending_tokens_last,
                                     installs.drain_backlog_last)
    finally:
        core.__dict__.pop("pause_scheduler_async", None)  # the client's own method again
        engine.generation.max_new_tokens = old_max
        engine.installer.recompute_kv_cache_after_weight_updates = False
        engine.labels.streamed = engine_labels
        push_model(harness, tiny_model_dir)
    if streamed:
        assert complete, "the front end's backlog was not read"
    if streamed == "behind":
        assert pending > 0, "the front end was not behind at the pause: nothing tested"
        print(f"\nthe marks counted {pending} tokens the front end still held ({queued} queued engine outputs)")
    split = 0
    for request, group in zip(reqs, groups):
        assert len(group.trajectories) == GROUP_SIZE
        for t in group.trajectories:
            assert t.ok, t.error  # no request lost
            assert set(np.unique(t.versions)) <= {v, v + 1}
            assert (np.diff(t.versions) >= 0).all()
            k = int((t.versions == v).sum())
            prompt, response = request.prompt_ids.tolist(), t.response_ids.tolist()
            ref_old = hf_logprobs(tiny_model_dir, prompt, response)
            np.testing.assert_allclose(t.logprobs[:k], ref_old[:k], atol=2e-4)
            if 0 < k < t.response_ids.size:
                split += 1
                assert abs(t.logprobs[k] - ref_old[k]) > 1e-2, "the first v+1 token must not be old weights"
                if recompute_kv:
                    ref_new = hf_logprobs(tiny_model_dir_v2, prompt, response)
                    np.testing.assert_allclose(t.logprobs[k:], ref_new[k:], atol=2e-4)
    assert split >= 1, "no sample straddled the update"


def test_logprobs_of_matches_transformers_after_push(harness, tiny_model_dir, tiny_model_dir_v2):
    engine = harness.engine
    reqs = prompts(harness, 2, task="arithmetic", seed=3)
    rng = np.random.default_rng(0)
    responses = [rng.integers(3, engine.vocab_size - 64, size=24).tolist() for _ in reqs]
    push_model(harness, tiny_model_dir_v2)
    try:
        got = harness.run(engine.logprobs_of([r.prompt_ids.tolist() for r in reqs], responses))
    finally:
        push_model(harness, tiny_model_dir)
    diffs = np.concatenate([np.abs(g - hf_logprobs(tiny_model_dir_v2, r.prompt_ids.tolist(), resp))
                            for g, r, resp in zip(got, reqs, responses)])
    print(f"\nparity vLLM vs transformers (float32): max |diff| {diffs.max():.2e}, mean {diffs.mean():.2e}")
    assert diffs.max() < 1e-3


@pytest.mark.parametrize("damage", ["checksum", "corrupt_bytes", "missing_tensor", "wrong_shape",
                                    "wrong_dtype", "unknown_name", "stale_version"])
def test_bad_push_is_rejected_and_old_weights_keep_serving(harness, damage):
    engine = harness.engine
    request = prompts(harness, 1, seed=5)[0]
    before = harness.run(engine.generate_group(request, GROUP_SIZE))
    v = engine.version
    tensors = list(model_tensors(harness.model_dir))
    version = v + 1
    if damage == "missing_tensor":
        tensors = tensors[1:]
    elif damage == "wrong_shape":
        name, dtype, shape, raw = tensors[0]
        tensors[0] = (name, dtype, (shape[0] * shape[1],), raw)
    elif damage == "wrong_dtype":
        name, _, shape, raw = tensors[0]
        tensors[0] = (name, "int32", shape, raw)
    elif damage == "unknown_name":
        name, dtype, shape, raw = tensors[0]
        tensors[0] = ("model.not_a_layer.weight", dtype, shape, raw)
    elif damage == "stale_version":
        version = v
    manifest, buckets = pack_buckets(tensors, version, 1 << 16)
    if damage == "checksum":
        buckets[1].checksum = "crc32:00000000"
    elif damage == "corrupt_bytes":
        data = buckets[0].data.copy()
        data[10] ^= 0xFF
        buckets[0].data = data
    with pytest.raises(WeightUpdateError) as err:
        harness.run(engine.install(manifest, buckets))
    print(f"\n{damage}: {err.value}")
    assert engine.version == v
    after = harness.run(engine.generate_group(request, GROUP_SIZE))
    assert tokens_of(after) == tokens_of(before)


def test_timed_out_requests_are_retried_then_failed_not_scored(harness):
    engine = harness.engine
    gen = engine.generation
    old_timeout, old_retries = gen.request_timeout_s, gen.max_retries
    aborts = engine.stats()["aborts"]
    gen.request_timeout_s, gen.max_retries = 0.001, 1
    try:
        group = harness.run(engine.generate_group(prompts(harness, 1)[0], GROUP_SIZE))
    finally:
        gen.request_timeout_s, gen.max_retries = old_timeout, old_retries
    for t in group.trajectories:
        assert t.finish_reason == "error" and t.reward is None
        assert "timeout after 0.001s" in t.error and "after 2 attempts" in t.error
    assert engine.stats()["aborts"] - aborts == 2 * GROUP_SIZE
    healthy = harness.run(engine.generate_group(prompts(harness, 1)[0], GROUP_SIZE))
    assert all(t.ok for t in healthy.trajectories)


@pytest.mark.parametrize("kind", ["raises", "hangs", "per_sample_failure"])
def test_reward_errors_fail_samples_with_reason(harness, kind):
    engine = harness.engine
    original, old_timeout = engine.sampler.reward_fn, engine.sampler.reward_timeout_s

    def raises(batch):
        raise RuntimeError("grader crashed")

    async def hangs(batch):
        await asyncio.sleep(60)

    def per_sample(batch):
        return [RewardFailure("no answer found")] + [1.0] * (len(batch) - 1)

    engine.sampler.reward_fn = {"raises": raises, "hangs": hangs, "per_sample_failure": per_sample}[kind]
    engine.sampler.reward_timeout_s = 0.5
    try:
        group = harness.run(engine.generate_group(prompts(harness, 1)[0], GROUP_SIZE))
    finally:
        engine.sampler.reward_fn, engine.sampler.reward_timeout_s = original, old_timeout
    failed = [t for t in group.trajectories if not t.ok]
    expect = {"raises": "RuntimeError: grader crashed", "hangs": "timed out after 0.5s",
              "per_sample_failure": "no answer found"}[kind]
    assert len(failed) == (1 if kind == "per_sample_failure" else GROUP_SIZE)
    for t in failed:
        assert t.reward is None and t.finish_reason == "error" and expect in t.error
    assert all(t.reward == 1.0 for t in group.trajectories if t.ok)


def test_gpu_only_options_are_reported_ignored_on_cpu(harness):
    options = harness.engine.options
    assert options.platform == "cpu"
    messages = [i.message(options.platform) for i in options.ignored]
    assert any(m.startswith("policy.generation.vllm_cfg.gpu_memory_utilization=0.5 ignored on cpu") for m in messages)
    cpu_env = {k: v for k, v in options.env.items() if k != OUTPUT_CHUNK_ENV}  # test_options checks that one
    assert cpu_env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    names = [p.name() for p in psutil.Process().children(recursive=True)]
    assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names, names  # the worker is in the engine core
    harness.run(harness.engine.sleep())
    harness.run(harness.engine.wake_up())
    assert harness.engine.stats()["sleeps_skipped_on_cpu"] >= 1


def test_an_answer_budget_of_the_whole_context_is_capped_by_the_prompt(harness):
    """NeMo-RL's recipes set max_new_tokens = the context: an answer gets min(max_new_tokens, context - prompt)."""
    from protocol.messages import PromptRequest

    engine = harness.engine
    gen, context = engine.generation, engine.max_model_len
    old = gen.max_new_tokens
    base = prompts(harness, 1)[0]
    long_ids = np.resize(base.prompt_ids, context - 12)
    gen.max_new_tokens = context
    try:
        group = harness.run(engine.generate_group(PromptRequest("long", long_ids, dict(base.task)), GROUP_SIZE))
        full = harness.run(engine.generate_group(PromptRequest("full", np.resize(base.prompt_ids, context),
                                                               dict(base.task)), 2))
    finally:
        gen.max_new_tokens = old
    assert all(t.ok for t in group.trajectories), [t.error for t in group.trajectories]
    lengths = [t.response_ids.size for t in group.trajectories]
    assert max(lengths) == 12 and all(0 < n <= 12 for n in lengths), lengths
    assert all(t.finish_reason == "length" for t in group.trajectories if t.response_ids.size == 12)
    assert all(not t.ok and "leaves no room for an answer" in t.error for t in full.trajectories)
