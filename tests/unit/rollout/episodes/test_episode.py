"""Multi-turn episodes (rollout.episodes.episode) with a fake generator in place of vLLM: the token layout (sampled turns
and environment ids end to end, loss mask, canonical log-probs and versions, wire round trip), per-turn versions,
truncation by turns and by context, environment and generation failures, openings, concurrency and counters.
The same loop on the real engine: tests/integration/rollout/test_multi_turn.py."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from protocol import PromptRequest, TrajectoryGroup, decode, encode
from rollout.episodes.chat_turns import ChatTurns
from rollout.config import GenerationConfig
from rollout.engine import RolloutEngine
from rollout.episodes.environment import EnvStep, Message, Turn, as_async
from rollout.labels import VersionLabels
from rollout.rewards.registry import get_reward_fn
from rollout.episodes.turn_sampler import SampledTurn
from rollout.sampling import GroupSampler, SampleFailed

MAX_NEW = 4


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from services.models.tiny_model import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("episode-tok"))


class FakeEngine:
    """Stands in for vLLM: each request samples ``[a, b, ..., <|im_end|>]`` (``a`` from the seed) within the
    budget; records every request's context."""

    def __init__(self, tok, fail_when=None):
        self.eos = tok.convert_tokens_to_ids("<|im_end|>")
        self.version = 0
        self.contexts: list[list[int]] = []
        self.fail_when = fail_when

    async def generate(self, token_ids: list[int], budget: int, seed: int, temperature=None) -> SampledTurn:
        self.contexts.append(list(token_ids))
        await asyncio.sleep(0)
        if self.fail_when is not None and self.fail_when(token_ids):
            raise SampleFailed("generation failed: boom")
        full = [30 + seed % 40, 31, 32, self.eos][:MAX_NEW]
        ids = full[:budget]
        reason = "stop" if ids[-1] == self.eos else "length"
        return SampledTurn(ids, [-0.5] * len(ids), np.full(len(ids), self.version, np.int32), reason, "x")


def make_sampler(tok, env, max_turns=3, truncated_reward=0.0, max_model_len=256, fake=None):
    fake = fake or FakeEngine(tok)
    sampler = GroupSampler("t", GenerationConfig(max_new_tokens=MAX_NEW, max_retries=1), get_reward_fn("format"),
                           5.0, VersionLabels(), max_model_len, llm=lambda: None, version=lambda: fake.version,
                           dead_reason=lambda: "", environment=as_async(env, 5.0), max_turns=max_turns,
                           truncated_reward=truncated_reward)
    sampler.chat_turns = ChatTurns(tok)
    sampler.vocab_size = len(tok)
    sampler._generate = fake.generate  # type: ignore[method-assign]
    return sampler, fake


def prompt_of(tok, text="Repeat the letter a.") -> PromptRequest:
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    return PromptRequest("p0", np.asarray(ids), {"letter": "a"})


class Scripted:
    """Answers ``more`` with a user message ``n_more`` times, then ``final(1.0)``; records every turn."""

    def __init__(self, n_more=2, opening=(), fail_step_of=None, fail_reset_of=None, gate=None):
        self.n_more, self.opening = n_more, opening if callable(opening) else list(opening)
        self.fail_step_of, self.fail_reset_of, self.gate = fail_step_of, fail_reset_of, gate
        self.resets = 0
        self.turns: dict[int, list[Turn]] = {}
        self.in_step = 0
        self.most_in_step = 0

    async def reset(self, task):
        sample = self.resets
        self.resets += 1
        if sample == self.fail_reset_of:
            raise RuntimeError("no sandbox")
        self.turns[sample] = []
        opening = self.opening(sample) if callable(self.opening) else self.opening
        return {"sample": sample, "steps": 0}, opening

    async def step(self, state, turn):
        self.turns[state["sample"]].append(turn)
        self.in_step += 1
        self.most_in_step = max(self.most_in_step, self.in_step)
        try:
            if self.gate is not None and state["steps"] == 0:
                await self.gate(state)
            await asyncio.sleep(0.01)
        finally:
            self.in_step -= 1
        if state["sample"] == self.fail_step_of:
            raise RuntimeError("judge said 503")
        state["steps"] += 1
        if state["steps"] <= self.n_more:
            return EnvStep.more([Message("user", f"again {state['steps']}")])
        return EnvStep.final(1.0, {"format": 1.0})


def round_trip(group: TrajectoryGroup) -> TrajectoryGroup:
    return decode(encode(group), TrajectoryGroup)


def test_turns_and_environment_ids_lie_end_to_end_with_the_mask_and_canonical_fill(tok):
    env = Scripted(n_more=2)
    sampler, _ = make_sampler(tok, env, max_turns=3)
    request = prompt_of(tok)
    group = asyncio.run(sampler.group(request, 3))
    chat = ChatTurns(tok)
    for i, t in enumerate(group.trajectories):
        assert t.ok, t.error
        turns = [list(x.token_ids) for x in env.turns[i]]
        assert [x.final for x in env.turns[i]] == [False, False, True]
        env1 = chat.after_turn(turns[0], [Message("user", "again 1")])
        env2 = chat.after_turn(turns[1], [Message("user", "again 2")])
        assert t.response_ids.tolist() == turns[0] + env1 + turns[1] + env2 + turns[2]
        assert t.loss_mask.tolist() == [1] * 4 + [0] * len(env1) + [1] * 4 + [0] * len(env2) + [1] * 4
        assert (t.logprobs[t.sampled] == -0.5).all() and (t.logprobs[~t.sampled] == 0).all()
        assert t.turn_finish_reasons == ["stop"] * 3 and t.finish_reason == "stop"
        assert t.reward == 1.0 and t.reward_components == {"format": 1.0}
    assert group.prompt_ids.tolist() == request.prompt_ids.tolist()
    back = round_trip(group)
    for a, b in zip(back.trajectories, group.trajectories, strict=True):
        assert a.response_ids.tolist() == b.response_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    s = sampler.stats
    assert (s.episodes, s.turns, s.samples_ok, s.samples_failed, s.groups) == (3, 9, 3, 0, 1)
    assert s.env_tokens == sum(int((~t.sampled).sum()) for t in group.trajectories)
    assert s.env_wait_seconds >= 9 * 0.01 and s.episodes_truncated == 0 and s.env_failures == 0


def test_each_turn_is_sampled_after_the_whole_episode_so_far(tok):
    env = Scripted(n_more=1)
    sampler, fake = make_sampler(tok, env, max_turns=2)
    request = prompt_of(tok)
    [t] = asyncio.run(sampler.group(request, 1)).trajectories
    prompt = request.prompt_ids.tolist()
    first_turn_len = len(env.turns[0][0].token_ids)
    env_len = int((~t.sampled).sum())
    assert fake.contexts == [prompt, prompt + t.response_ids.tolist()[:first_turn_len + env_len]]


def test_a_push_between_turns_gives_each_turn_its_version(tok):
    fake = FakeEngine(tok)

    async def push(state):
        fake.version += 1 if state["sample"] == 0 else 0

    env = Scripted(n_more=1, gate=push)
    sampler, _ = make_sampler(tok, env, max_turns=2, fake=fake)
    [t] = asyncio.run(sampler.group(prompt_of(tok), 1)).trajectories
    n1 = len(env.turns[0][0].token_ids)
    assert t.versions[:n1].tolist() == [0] * n1
    assert (t.versions[n1:][~t.sampled[n1:]] == 0).all()  # env tokens: the version of the token before them
    assert (t.versions[t.sampled][n1:] == 1).all()
    round_trip(TrajectoryGroup("g", "p", np.asarray([1]), [t], 1, len(tok)))


def test_an_episode_past_its_turns_gets_the_truncated_reward_or_fails(tok):
    env = Scripted(n_more=99)
    sampler, _ = make_sampler(tok, env, max_turns=2, truncated_reward=-0.5)
    group = asyncio.run(sampler.group(prompt_of(tok), 2))
    for i, t in enumerate(group.trajectories):
        assert (t.reward, t.finish_reason, t.turn_finish_reasons) == (-0.5, "length", ["stop", "stop"])
        assert [x.final for x in env.turns[i]] == [False, True]
        assert t.loss_mask.tolist()[-4:] == [1] * 4  # no environment ids after the last turn
    assert sampler.stats.episodes_truncated == 2
    round_trip(group)
    sampler.truncated_reward = None
    group = asyncio.run(sampler.group(prompt_of(tok), 2))
    assert all(not t.ok and t.reward is None and "grpo.max_rollout_turns=2" in t.error for t in group.trajectories)


def test_an_episode_that_fills_the_context_is_truncated(tok):
    request = prompt_of(tok)
    env = Scripted(n_more=99)
    # room for turn 1 and one environment message, then a turn whose budget is below max_new_tokens
    probe = ChatTurns(tok).after_turn([tok.convert_tokens_to_ids("<|im_end|>")], [Message("user", "again 1")])
    max_len = len(request.prompt_ids) + MAX_NEW + len(probe) + 2
    sampler, _ = make_sampler(tok, env, max_turns=9, truncated_reward=0.0, max_model_len=max_len)
    [t] = asyncio.run(sampler.group(request, 1)).trajectories
    assert t.ok and t.finish_reason == "length" and t.reward == 0.0
    assert t.turn_finish_reasons == ["stop", "length"]  # the second turn was cut at its budget of 2 tokens
    assert [x.final for x in env.turns[0]] == [False, True]
    assert len(request.prompt_ids) + t.response_ids.size == max_len
    sampler.truncated_reward = None
    [t] = asyncio.run(sampler.group(request, 1)).trajectories
    assert not t.ok and "max_model_len" in t.error


def test_an_environment_failure_fails_only_its_sample_with_the_reason(tok):
    env = Scripted(n_more=1, fail_step_of=1)
    sampler, _ = make_sampler(tok, env, max_turns=3)
    group = asyncio.run(sampler.group(prompt_of(tok), 3))
    bad = group.trajectories[1]
    assert (bad.ok, bad.reward, bad.finish_reason) == (False, None, "error")
    assert bad.error == "environment 'Scripted': step raised RuntimeError: judge said 503"
    assert bad.failure_kind == "environment" and all(t.failure_kind == "" for t in group.valid)
    assert all(t.ok and t.reward == 1.0 for i, t in enumerate(group.trajectories) if i != 1)
    assert (sampler.stats.env_failures, sampler.stats.samples_failed) == (1, 1)
    round_trip(group)
    env = Scripted(fail_reset_of=0)
    sampler, _ = make_sampler(tok, env)
    group = asyncio.run(sampler.group(prompt_of(tok), 2))
    assert group.trajectories[0].error == "environment 'Scripted': reset raised RuntimeError: no sandbox"
    assert group.trajectories[0].failure_kind == "environment" and group.trajectories[1].ok


def test_a_turn_that_cannot_be_sampled_fails_the_sample_after_its_retries(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    fake = FakeEngine(tok, fail_when=lambda ids: ids.count(eos) > 1)  # the second turn (the prompt has one)
    sampler, _ = make_sampler(tok, Scripted(n_more=1), max_turns=2, fake=fake)
    [t] = asyncio.run(sampler.group(prompt_of(tok), 1)).trajectories
    assert not t.ok and t.error == "turn 2: generation failed: boom (after 2 attempts)"
    assert t.failure_kind == "generation"
    assert sampler.stats.retries == 1 and sampler.stats.env_failures == 0


def test_the_reset_messages_are_the_groups_prompt_and_must_agree(tok):
    opening = [Message("user", "Guess my number.")]
    request = prompt_of(tok)
    sampler, fake = make_sampler(tok, Scripted(n_more=0, opening=opening))
    group = asyncio.run(sampler.group(request, 2))
    want = ChatTurns(tok).opening(request.prompt_ids.tolist(), opening)
    assert group.prompt_ids.tolist() == want != request.prompt_ids.tolist()
    assert all(t.ok for t in group.trajectories) and fake.contexts == [want, want]
    sampler, _ = make_sampler(tok, Scripted(n_more=0, opening=lambda i: [Message("user", f"game {i % 2}")]))
    group = asyncio.run(sampler.group(request, 3))
    assert [t.ok for t in group.trajectories] == [True, False, True]
    assert group.trajectories[1].error == ("a group shares its prompt; reset gave sample 1 a different opening "
                                           "than sample 0")


def test_the_samples_of_a_group_await_their_environment_concurrently(tok):
    arrived = asyncio.Event()
    count = [0]

    async def barrier(state):
        count[0] += 1
        if count[0] == 4:
            arrived.set()
        await asyncio.wait_for(arrived.wait(), 5)  # would time out if the samples ran one after another

    env = Scripted(n_more=0, gate=barrier)
    sampler, _ = make_sampler(tok, env)
    group = asyncio.run(sampler.group(prompt_of(tok), 4))
    assert all(t.ok for t in group.trajectories) and env.most_in_step == 4


def test_engine_validates_the_turn_settings():
    with pytest.raises(ValueError, match="max_rollout_turns"):
        RolloutEngine("/nonexistent", GenerationConfig(max_new_tokens=8), 64, get_reward_fn("format"),
                      max_rollout_turns=0)
