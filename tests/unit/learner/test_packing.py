"""First-fit-decreasing packing, block lengths and padding."""
from __future__ import annotations

import numpy as np
import pytest

from learner.packing import PAD_TOKEN, build_micro_batch, deal, first_fit_decreasing, pack, pad_micro_batch


@pytest.mark.parametrize("seed", range(5))
def test_ffd_respects_budget_and_places_everything_once(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, 60).tolist()
    bins = first_fit_decreasing(lengths, budget=128)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    # FFD never needs more than 11/9 OPT + 1 bins; OPT >= total / budget.
    assert len(bins) <= 11 / 9 * np.ceil(sum(lengths) / 128) + 1


def test_ffd_is_first_fit_decreasing():
    assert first_fit_decreasing([3, 7, 5, 5], budget=10) == [[1, 0], [2, 3]]


def test_ffd_rejects_a_sequence_longer_than_the_budget():
    with pytest.raises(ValueError, match="sequence 1 has 11 tokens.*train_mb_tokens=10"):
        first_fit_decreasing([3, 11], budget=10)


def test_pack_restarts_positions_and_targets_stay_inside_each_sequence():
    seqs = [np.array([10, 11, 12]), np.array([20, 21, 22, 23, 24]), np.array([30, 31])]
    mbs, fill = pack(seqs, budget=8)
    assert [[s.index for s in mb.segments] for mb in mbs] == [[1, 0], [2]]
    first = mbs[0]
    assert first.tokens.tolist() == [[20, 21, 22, 23, 24, 10, 11, 12]]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert first.targets.tolist() == [[21, 22, 23, 24, 0, 11, 12, 0]]
    assert first.blocks == (5, 3) and mbs[1].blocks == (2,)
    assert fill == pytest.approx(10 / 16)


def test_pack_disabled_gives_one_sequence_per_micro_batch():
    seqs = [np.arange(4), np.arange(6)]
    mbs, fill = pack(seqs, budget=100, enabled=False)
    assert [mb.num_tokens for mb in mbs] == [4, 6]
    assert fill == pytest.approx(10 / 12)


def test_pack_rejects_sequences_without_a_response():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pack([np.arange(1)], budget=10)


def _mbs(*lengths_per_mb):
    seqs, bins = [], []
    for lengths in lengths_per_mb:
        bins.append(list(range(len(seqs), len(seqs) + len(lengths))))
        seqs += [np.arange(100, 100 + n) for n in lengths]
    return [build_micro_batch(seqs, b) for b in bins]


def test_deal_without_equal_shapes_is_round_robin_and_pads_nothing():
    mbs = _mbs([5], [4], [3])
    mine, pad = deal(mbs, rank=1, ranks=2)
    assert mine == [mbs[1]] and pad == 0


def test_deal_with_equal_shapes_gives_every_rank_the_same_counts_and_widths():
    mbs = _mbs([5, 3], [6], [4])  # widths 8, 6 | 4
    shares = [deal(mbs, rank=r, ranks=2, equal_shapes=True) for r in range(2)]
    assert [[mb.num_tokens for mb in mine] for mine, _ in shares] == [[8, 4], [8, 4]]
    assert shares[0][1] == shares[1][1] == (8 - 6) + 4  # the round-0 pad and the all-padding micro-batch
    (r0, _), (r1, _) = shares
    assert r0[0] is mbs[0] and [s.index for s in r1[0].segments] == [2]
    assert r1[1].segments == [] and r1[1].tokens.tolist() == [[PAD_TOKEN] * 4]


def test_padding_is_a_block_of_its_own_and_leaves_the_sequences_untouched():
    mb = _mbs([3, 2])[0]
    padded = pad_micro_batch(mb, 8)
    assert padded.segments == mb.segments
    assert padded.tokens[0, :5].tolist() == mb.tokens[0].tolist()
    assert padded.tokens[0, 5:].tolist() == [PAD_TOKEN] * 3
    assert padded.position_ids[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert padded.blocks == (3, 2, 3)
    with pytest.raises(ValueError, match="cannot pad a micro-batch of 5 tokens to 4"):
        pad_micro_batch(mb, 4)
