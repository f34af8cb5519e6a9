"""Length buckets of a packed row, for the ``sdpa_batched`` core attention (:mod:`learner.attention`).

A row's sequences are sorted by length and grouped so that each group, right-padded to its longest, wastes at most
``max_padding`` of its real tokens; each group then runs as one batched causal SDPA call instead of one call per
sequence. Right padding changes no real position's output under a causal mask: a real query only sees keys at or
before it, all real. The plan holds the index tensors that move the row's positions into the padded batches and the
kept outputs back into row order, built once per row and shared by every layer; a bucket that is a stretch of the
row as it lies (one sequence alone, say) is read as a view instead.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

MAX_PADDING = 0.25
"""Default bound on a bucket's padded slots, as a share of its real tokens."""


@dataclass(frozen=True)
class Bucket:
    """Sequences of a row run as one ``[count, heads, length, d]`` batch."""

    count: int
    """Sequences in the bucket."""
    length: int
    """The longest one's length: every sequence is right-padded to it."""
    gather: torch.Tensor | None
    """``[count · length]`` row positions filling the batch, slot by slot (a pad slot repeats its sequence's first
    position: it is seen only by pad queries, whose outputs are dropped); None with a ``span``."""
    keep: torch.Tensor | None
    """The slots holding real positions, in slot order (``[tokens of the bucket]``); None with a ``span``."""
    span: tuple[int, int] | None = None
    """``(start, stop)`` when the batch is the row's positions ``start:stop`` as they lie (its sequences adjacent,
    in order, none padded): a view fills it, with no index tensors (one long sequence per row: no copy in the
    forward, no scatter-add in the backward, no host-to-device copy of indices)."""


@dataclass(frozen=True)
class BucketPlan:
    """How one packed row's positions go through :class:`Bucket` batches and back."""

    buckets: tuple[Bucket, ...]
    order: torch.Tensor | None
    """``[T]``: for each row position, its index in the buckets' kept outputs concatenated in bucket order; None
    when that is the row's own order."""


def group_by_length(blocks: Sequence[int], max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Indices of ``blocks`` grouped longest first: a group takes the next (shorter) block while its count times
    its first block's length stays within ``1 + max_padding`` times its real tokens."""
    if max_padding < 0:
        raise ValueError(f"max_padding must be >= 0, got {max_padding}")
    groups: list[list[int]] = []
    tokens = 0
    for i in sorted(range(len(blocks)), key=lambda j: -blocks[j]):
        if groups and (len(groups[-1]) + 1) * blocks[groups[-1][0]] <= (1 + max_padding) * (tokens + blocks[i]):
            groups[-1].append(i)
            tokens += blocks[i]
        else:
            groups.append([i])
            tokens = blocks[i]
    return groups


def _indices(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` as an index tensor on ``device``; to a GPU through pinned memory without waiting for it (a plain
    copy from pageable memory synchronises the stream: the host stops until the GPU has run all it was given)."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values).pin_memory().to(device, non_blocking=True)


def bucket_plan(blocks: Sequence[int], device: torch.device, max_padding: float = MAX_PADDING) -> BucketPlan:
    """The :class:`BucketPlan` of a row made of ``blocks`` (lengths > 0), its index tensors on ``device``."""
    starts = [0, *accumulate(blocks[:-1])]
    buckets, kept_positions = [], []
    for group in group_by_length(blocks, max_padding):
        length = blocks[group[0]]
        gather, keep = [], []
        for slot_base, i in zip(range(0, len(group) * length, length), group, strict=True):
            n, start = blocks[i], starts[i]
            gather += list(range(start, start + n)) + [start] * (length - n)
            keep += range(slot_base, slot_base + n)
            kept_positions += range(start, start + n)
        if gather == list(range(gather[0], gather[0] + len(gather))):  # adjacent, in order, unpadded
            buckets.append(Bucket(len(group), length, None, None, span=(gather[0], gather[0] + len(gather))))
        else:
            buckets.append(Bucket(len(group), length, _indices(gather, device), _indices(keep, device)))
    if kept_positions == list(range(len(kept_positions))):
        return BucketPlan(tuple(buckets), None)
    order = sorted(range(len(kept_positions)), key=kept_positions.__getitem__)  # kept_positions: a permutation
    return BucketPlan(tuple(buckets), _indices(order, device))
