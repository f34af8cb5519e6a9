"""First-fit-decreasing packing and the block-diagonal mask."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.packing import block_diagonal_causal_mask, first_fit_decreasing, pack


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


def test_block_diagonal_mask_blocks_other_sequences_and_the_future():
    mask = block_diagonal_causal_mask([2, 3])[0, 0]
    allowed = ~mask
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, expected)


def test_pack_restarts_positions_and_targets_stay_inside_each_sequence():
    seqs = [np.array([10, 11, 12]), np.array([20, 21, 22, 23, 24]), np.array([30, 31])]
    mbs, fill = pack(seqs, budget=8)
    assert [[s.index for s in mb.segments] for mb in mbs] == [[1, 0], [2]]
    first = mbs[0]
    assert first.tokens.tolist() == [[20, 21, 22, 23, 24, 10, 11, 12]]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert first.targets.tolist() == [[21, 22, 23, 24, 0, 11, 12, 0]]
    assert first.attention_mask.shape == (1, 1, 8, 8)
    assert fill == pytest.approx(10 / 16)


def test_pack_disabled_gives_one_sequence_per_micro_batch():
    seqs = [np.arange(4), np.arange(6)]
    mbs, fill = pack(seqs, budget=100, enabled=False)
    assert [mb.num_tokens for mb in mbs] == [4, 6]
    assert fill == pytest.approx(10 / 12)


def test_pack_rejects_sequences_without_a_response():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pack([np.arange(1)], budget=10)
