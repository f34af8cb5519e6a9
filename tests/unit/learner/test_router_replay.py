"""Routing replay's pieces without a model (learner.router_replay): each sequence's routing lands at its segment
of the packed row (-1 past its positions and on padding); a router replays the known rows with its own scores
gathered at the engine's experts and keeps its own top-k elsewhere, counting the flips it caught."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from learner.packing import pack, pad_micro_batch
from learner.router_replay import TokenReplay, routing_row


def test_each_sequence_routing_lands_at_its_segment_and_the_rest_is_minus_one():
    seqs = [np.arange(5), np.arange(3), np.arange(4)]
    routed = [np.full((4, 2, 2), 1, np.uint8), None, np.stack([np.full((2, 2), 7)] * 4).astype(np.uint8)]
    (mb,), _ = pack(seqs, 16)
    mb = pad_micro_batch(mb, 16)
    row = routing_row(mb, routed, 2, 2)
    assert row is not None and row.shape == (16, 2, 2)
    for seg in mb.segments:
        r = routed[seg.index]
        got = row[seg.start:seg.start + seg.length, 0, 0].tolist()
        want = [-1] * seg.length if r is None else [int(r[0, 0, 0])] * min(len(r), seg.length) + \
            [-1] * (seg.length - min(len(r), seg.length))
        assert got == want, (seg, got)
    assert (row[12:] == -1).all()  # padding block
    assert routing_row(mb, [None, None, None], 2, 2) is None
    with pytest.raises(ValueError, match="3 MoE layers"):
        routing_row(mb, [np.zeros((4, 3, 2), np.uint8), None, None], 2, 2)


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_a_router_replays_known_rows_and_routes_the_others_itself():
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.3, 0.2, 0.4, 0.1]])
    rep = TokenReplay(0)
    rep.target_topk_idx = torch.tensor([[0, 1], [0, 1], [-1, -1]])
    rep.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, idx = rep.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert idx.tolist() == [[0, 1], [0, 1], [2, 0]]  # row 2 has no routing: its own top-2
    assert torch.equal(probs, scores.gather(1, idx))
    assert int(rep.replayed) == 2 and int(rep.flipped) == 1  # row 1's own choice was {3, 2}
    rep.clear_router_replay_action()
    assert rep.get_replay_topk(scores, 2, default_compute_topk=_topk)[1].tolist()[1] == [3, 2]
    rep.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    rep.target_topk_idx = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="routing has"):
        rep.get_replay_topk(scores, 2, default_compute_topk=_topk)
