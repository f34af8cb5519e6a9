"""learner.attention_buckets: a packed row's sequences grouped by length within the padding bound, and the index
tensors that take the row through the padded batches and back."""
from __future__ import annotations

import pytest
import torch

from learner.attention_buckets import bucket_plan, group_by_length


def test_groups_are_longest_first_and_within_the_padding_bound():
    blocks = [40, 3, 38, 10, 9, 39, 100, 8]
    groups = group_by_length(blocks, max_padding=0.25)
    assert groups == [[6], [0, 5, 2], [3, 4, 7], [1]]
    for g in groups:
        assert len(g) * blocks[g[0]] <= 1.25 * sum(blocks[i] for i in g)
    assert group_by_length(blocks, max_padding=0.0) == [[6], [0], [5], [2], [3], [4], [7], [1]]
    assert group_by_length([5, 5, 5], max_padding=0.0) == [[0, 1, 2]]
    assert len(group_by_length(blocks, max_padding=100.0)) == 1
    with pytest.raises(ValueError, match="max_padding must be >= 0, got -0.1"):
        group_by_length(blocks, max_padding=-0.1)


def test_plan_pads_each_sequence_to_its_bucket_and_restores_row_order():
    blocks = [4, 1, 3, 7]
    plan = bucket_plan(blocks, torch.device("cpu"), max_padding=0.5)
    assert [(b.count, b.length) for b in plan.buckets] == [(3, 7), (1, 1)]  # [7, 4, 3]: 21 slots for 14 tokens
    assert plan.buckets[0].gather.tolist() == [8, 9, 10, 11, 12, 13, 14] + [0, 1, 2, 3, 0, 0, 0] + [5, 6, 7, 5, 5, 5, 5]
    assert plan.buckets[0].keep.tolist() == list(range(7)) + [7, 8, 9, 10] + [14, 15, 16]
    assert [b.span for b in plan.buckets] == [None, (4, 5)]  # the lone 1-token sequence is a view of the row
    assert plan.buckets[1].gather is None and plan.buckets[1].keep is None
    row = torch.arange(sum(blocks)) * 10
    kept = torch.cat([row[slice(*b.span)] if b.span else row[b.gather][b.keep] for b in plan.buckets])
    assert plan.order is not None and torch.equal(kept[plan.order], row)  # every position once, back in its place


@pytest.mark.parametrize(("blocks", "spans"), [([9], [(0, 9)]), ([3, 3, 3], [(0, 9)]), ([5, 2, 2], [(0, 5), (5, 9)])])
def test_buckets_of_the_row_as_it_lies_are_views_and_keep_the_row_order(blocks, spans):
    plan = bucket_plan(blocks, torch.device("cpu"))
    assert [b.span for b in plan.buckets] == spans and plan.order is None
    assert all(b.gather is None and b.keep is None for b in plan.buckets)  # no index tensors to build or copy
