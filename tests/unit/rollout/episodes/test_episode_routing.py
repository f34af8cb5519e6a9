"""A multi-turn episode's routed experts (routing replay): each turn's request is the whole episode so far, so the
last turn's routing covers every position before its last token, the environment's included; the trajectory
carries it (and it survives the wire), and carries none when a turn came back without routing."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_episode import FakeEngine, Scripted, make_sampler, prompt_of

from protocol import TrajectoryGroup, decode, encode
from rollout.episodes.turn_sampler import SampledTurn


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from services.models.tiny_model import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("episode-routing-tok"))


class RoutingEngine(FakeEngine):
    """Returns, with each turn, routing of its whole context but the last sampled token: position p routed to
    experts (p % 4, 4 + context length % 4), one MoE layer; ``without`` names turns (1-based) that return none."""

    def __init__(self, tok, without=()):
        super().__init__(tok)
        self.without, self.calls = set(without), 0

    async def generate(self, token_ids, budget, seed, temperature=None) -> SampledTurn:
        got = await super().generate(token_ids, budget, seed, temperature)
        self.calls += 1
        if self.calls in self.without:
            return got
        n = len(token_ids) + len(got.token_ids) - 1
        routed = np.stack([np.arange(n) % 4, np.full(n, 4 + len(token_ids) % 4)], axis=-1)[:, None, :]
        return SampledTurn(got.token_ids, got.logprobs, got.versions, got.finish_reason, got.text,
                           routed.astype(np.uint8))


def test_the_last_turns_routing_covers_the_episode_and_crosses_the_wire(tok):
    sampler, _ = make_sampler(tok, Scripted(n_more=2), max_turns=3, fake=RoutingEngine(tok))
    group = asyncio.run(sampler.group(prompt_of(tok), 1))
    t = group.trajectories[0]
    assert t.ok and (t.loss_mask == 0).any()  # environment tokens between the turns
    full = group.prompt_ids.size + t.response_ids.size
    assert t.routed_experts is not None and t.routed_experts.shape == (full - 1, 1, 2)
    last_context = full - 4  # the last turn sampled 4 tokens after the whole episode so far
    assert (t.routed_experts[:, 0, 1] == 4 + last_context % 4).all()  # the last turn's array, not an earlier one
    back = decode(encode(group), TrajectoryGroup).trajectories[0].routed_experts
    assert back is not None and np.array_equal(back, t.routed_experts)


def test_an_episode_with_a_turn_without_routing_carries_none(tok):
    sampler, _ = make_sampler(tok, Scripted(n_more=2), max_turns=3, fake=RoutingEngine(tok, without=(2,)))
    group = asyncio.run(sampler.group(prompt_of(tok), 1))
    assert group.trajectories[0].ok and group.trajectories[0].routed_experts is None
