"""Multi-turn episodes on the real vLLM engine (CPU, tiny Qwen2): token-in/token-out, a push between turns,
truncation by turns and by context, environment failures and openings.

Each test sets the sampler's environment settings and puts them back (:func:`episodes`)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np

from learner.batch import collect
from learner.config import TrainStepConfig
from protocol import TrajectoryGroup, decode, encode
from rollout.episodes.chat_turns import ChatTurns
from rollout.episodes.environment import EnvStep, Message, Turn, as_async
from services.data.tasks import make_prompts

from rollout_engine_helpers import push_model


@contextlib.contextmanager
def episodes(harness, env, max_turns: int, truncated_reward: float | None = 0.0, max_model_len: int | None = None):
    """The harness engine plays episodes against ``env`` inside the block; everything is put back after it."""
    sampler = harness.engine.sampler
    saved = sampler.environment, sampler.max_turns, sampler.truncated_reward, sampler.max_model_len
    sampler.environment, sampler.max_turns, sampler.truncated_reward = as_async(env, 60.0), max_turns, truncated_reward
    sampler.max_model_len = max_model_len or sampler.max_model_len
    try:
        yield sampler
    finally:
        sampler.environment, sampler.max_turns, sampler.truncated_reward, sampler.max_model_len = saved


class Recorder:
    """Records every turn; answers ``n_more`` times with a user message, then the final reward (sample index).
    ``gate``: awaited in each sample's first step; ``opening``: reset's messages for sample i;
    ``fail``: the sample whose steps raise."""

    def __init__(self, n_more: int, gate=None, opening=None, fail: int | None = None):
        self.n_more, self.gate, self.opening, self.fail = n_more, gate, opening, fail
        self.turns: dict[int, list[Turn]] = {}
        self.first_steps = 0
        self.lock = threading.Lock()

    async def reset(self, task):
        i = len(self.turns)
        self.turns[i] = []
        return {"i": i}, (self.opening(i) if self.opening else [])

    async def step(self, state, turn):
        i = state["i"]
        self.turns[i].append(turn)
        if len(self.turns[i]) == 1:
            with self.lock:
                self.first_steps += 1
            if self.gate is not None:
                await self.gate.wait()
        if i == self.fail:
            raise RuntimeError("sandbox crashed")
        if len(self.turns[i]) <= self.n_more:
            return EnvStep.more([Message("user", f"Say it again ({len(self.turns[i])}).")])
        return EnvStep.final(float(i))


def request(harness, seed: int = 0):
    return make_prompts("repeat_letter", harness.engine.tokenizer, 1, seed)[0]


def env_ids_from_template(tok, sampled: list[int], messages: list[Message]) -> list[int]:
    """What the environment appends after ``sampled``, computed from the template here (ChatML's rendering)."""
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"}]
    before = tok.apply_chat_template(history, tokenize=False)
    after = tok.apply_chat_template(history + [m.to_chat() for m in messages], tokenize=False,
                                    add_generation_prompt=True)
    assert after.startswith(before) and before.endswith("A<|im_end|>\n")
    closing = "\n" if sampled[-1] == tok.convert_tokens_to_ids("<|im_end|>") else "<|im_end|>\n"
    return tok(closing + after[len(before):], add_special_tokens=False)["input_ids"]


def test_token_in_token_out_across_three_turns(harness):
    engine = harness.engine
    tok = engine.tokenizer
    env = Recorder(n_more=2)
    req = request(harness)
    before = engine.stats()
    with episodes(harness, env, max_turns=3):
        group = harness.run(engine.generate_group(req, 2))
    after = engine.stats()
    assert group.prompt_ids.tolist() == req.prompt_ids.tolist()
    chat = ChatTurns(tok)
    for i, t in enumerate(group.trajectories):
        assert t.ok, t.error
        s = [list(turn.token_ids) for turn in env.turns[i]]
        assert [turn.final for turn in env.turns[i]] == [False, False, True]
        said = [[Message("user", f"Say it again ({k}).")] for k in (1, 2)]
        e = [chat.after_turn(s[k], said[k]) for k in (0, 1)]
        assert e == [env_ids_from_template(tok, s[k], said[k]) for k in (0, 1)]
        assert t.response_ids.tolist() == s[0] + e[0] + s[1] + e[1] + s[2]
        assert t.loss_mask.tolist() == [1] * len(s[0]) + [0] * len(e[0]) + [1] * len(s[1]) + [0] * len(e[1]) + \
            [1] * len(s[2])
        assert (t.logprobs[~t.sampled] == 0).all() and (t.logprobs[t.sampled] < 0).all()
        assert (t.versions == engine.version).all()
        assert t.turn_finish_reasons == [("stop" if x[-1] == tok.eos_token_id else "length") for x in s]
        assert t.reward == float(i)
        # the engine sampled each turn after exactly these ids: its log-probs given the whole sequence agree
        [again] = harness.run(engine.logprobs_of([req.prompt_ids.tolist()], [t.response_ids.tolist()]))
        np.testing.assert_allclose(again[t.sampled], t.logprobs[t.sampled], atol=1e-3)
    assert after["episodes"] - before["episodes"] == 2 and after["turns"] - before["turns"] == 6
    assert after["env_tokens"] - before["env_tokens"] == sum(int((~t.sampled).sum()) for t in group.trajectories)
    assert after["env_wait_seconds"] > before["env_wait_seconds"]
    back = decode(encode(group), TrajectoryGroup)
    for a, b in zip(back.trajectories, group.trajectories, strict=True):
        for name in ("response_ids", "logprobs", "versions", "loss_mask"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a.turn_finish_reasons == b.turn_finish_reasons
    # the learner trains exactly the sampled turns, with the environment ids as context
    batch = collect([back], 4096, False, TrainStepConfig())
    for i, (smp, t) in enumerate(zip(batch.samples, group.trajectories, strict=True)):
        assert smp.tokens.tolist() == req.prompt_ids.tolist() + t.response_ids.tolist()
        trained = smp.tokens[smp.prompt_len:][smp.loss_mask].tolist()
        assert trained == [tok_id for turn in env.turns[i] for tok_id in turn.token_ids]
    assert batch.env_tokens == sum(int((~t.sampled).sum()) for t in group.trajectories)


def test_a_push_between_two_turns_gives_the_second_turn_the_new_version(harness, tiny_model_dir, tiny_model_dir_v2):
    engine = harness.engine
    gate = asyncio.Event()
    env = Recorder(n_more=1, gate=gate)
    v = engine.version
    with episodes(harness, env, max_turns=2):
        running = asyncio.run_coroutine_threadsafe(engine.generate_group(request(harness, 3), 2), harness.loop)
        try:
            deadline = time.monotonic() + 120
            while env.first_steps < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert env.first_steps == 2, "the samples did not reach their first step"
            assert push_model(harness, tiny_model_dir_v2) == v + 1
        finally:
            harness.loop.call_soon_threadsafe(gate.set)
            try:
                group = running.result(300)
            finally:
                push_model(harness, tiny_model_dir)  # the original weights serve again (at version v + 2)
    for i, t in enumerate(group.trajectories):
        assert t.ok, t.error
        n1 = len(env.turns[i][0].token_ids)
        assert (t.versions[:n1] == v).all()
        assert (t.versions[~t.sampled] == v).all()  # environment ids: the version of the token before them
        assert (t.sampled_versions[n1:] == v + 1).all() and t.sampled_versions.size > n1
    decode(encode(group), TrajectoryGroup)


def test_episodes_cut_by_turns_or_by_context_get_the_truncated_reward(harness):
    engine = harness.engine
    req = request(harness, 5)
    before = engine.stats()["episodes_truncated"]
    with episodes(harness, Recorder(n_more=99), max_turns=2, truncated_reward=-1.0):
        by_turns = harness.run(engine.generate_group(req, 2))
    for t in by_turns.trajectories:
        assert (t.ok, t.reward, t.finish_reason, len(t.turn_finish_reasons)) == (True, -1.0, "length", 2)
        assert t.loss_mask[-1] == 1  # no environment ids after the last turn
    # a context with room for one turn and one environment message, then (after a long first turn) a turn
    # shorter than max_new_tokens
    max_new, prompt = engine.generation.max_new_tokens, len(req.prompt_ids)
    longest_env = len(ChatTurns(engine.tokenizer).after_turn([0], [Message("user", "Say it again (1).")]))
    limit = prompt + max_new + longest_env + max_new // 2
    env = Recorder(n_more=99)
    with episodes(harness, env, max_turns=9, truncated_reward=-1.0, max_model_len=limit):
        by_context = harness.run(engine.generate_group(req, 2))
    for i, t in enumerate(by_context.trajectories):
        assert t.ok and t.reward == -1.0 and t.finish_reason == "length", t.error
        assert prompt + t.response_ids.size <= limit and len(env.turns[i]) >= 2
        starts = np.flatnonzero(np.diff(np.concatenate([[0], t.loss_mask.astype(int)])) == 1)
        budgets = [min(max_new, limit - prompt - int(at)) for at in starts]
        assert [turn.final for turn in env.turns[i]] == [b < max_new for b in budgets]  # "no turn follows"
    assert engine.stats()["episodes_truncated"] - before == 4
    with episodes(harness, Recorder(n_more=99), max_turns=1, truncated_reward=None):
        failed = harness.run(engine.generate_group(req, 2))
    assert all(not t.ok and t.reward is None and "grpo.max_rollout_turns=1" in t.error for t in failed.trajectories)
    decode(encode(by_turns), TrajectoryGroup), decode(encode(by_context), TrajectoryGroup)


def test_openings_become_the_prompt_and_failures_fail_only_their_sample(harness):
    engine = harness.engine
    req = request(harness, 9)
    opening = [Message("user", "Now a new game.")]
    env = Recorder(n_more=1, fail=1, opening=lambda i: opening if i < 3 else [Message("user", "another game")])
    before = engine.stats()["env_failures"]
    with episodes(harness, env, max_turns=2):
        group = harness.run(engine.generate_group(req, 4))
    assert group.prompt_ids.tolist() == ChatTurns(engine.tokenizer).opening(req.prompt_ids.tolist(), opening)
    ok, crashed, ok2, other = group.trajectories
    assert ok.ok and ok2.ok and ok.reward == 0.0 and ok2.reward == 2.0
    assert (crashed.ok, crashed.reward, crashed.finish_reason) == (False, None, "error")
    assert crashed.error == "environment 'Recorder': step raised RuntimeError: sandbox crashed"
    assert not other.ok and other.error == ("a group shares its prompt; reset gave sample 3 a different opening "
                                            "than sample 0")
    assert engine.stats()["env_failures"] - before == 2
    decode(encode(group), TrajectoryGroup)
