"""Sequence packing: first-fit-decreasing into token-budgeted micro-batches.

:func:`pack` lays sequences (prompt + response ids, longest first) end to end
into rows of at most ``train_mb_tokens``, position ids restarting per sequence
and the row's block lengths, from which the core attention
(:mod:`learner.attention`) keeps each sequence to itself, which gives the
log-probs of running each sequence alone; it also returns the fill ratio.

:func:`deal` hands micro-batches to data-parallel ranks round-robin (rank d
trains d, d+DP, …); with ``equal_shapes`` (expert parallelism) it pads every
round to equal counts and widths with ``PAD_TOKEN`` blocks that change no
log-prob and add no loss. The attention paths, and the padding's cost:
docs/learner.md, "Packing".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_TOKEN = 0

@dataclass(frozen=True)
class Segment:
    """Where sequence ``index`` (of the packer's input) lies inside its micro-batch row."""

    index: int
    start: int
    length: int


@dataclass
class MicroBatch:
    """One packed row: ``tokens``, ``position_ids`` and ``targets`` are ``[1, T]`` int64;
    ``blocks`` are the lengths of the row's blocks in order (each sequence, then any padding
    block), which attend only within themselves. ``targets[t]`` is the
    next token of the same sequence (0 at a sequence's last position, never used)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    blocks: tuple[int, ...]
    segments: list[Segment]
    routing: torch.Tensor | None = None
    """The engine's experts per position ``[T, MoE layers, top_k]`` (-1: none) for routing replay
    (:mod:`learner.router_replay`); None: the routers choose every token themselves."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(self.tokens.to(device), self.position_ids.to(device), self.targets.to(device),
                          self.blocks, self.segments, self.routing.to(device) if self.routing is not None else None)


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins whose total length is at most ``budget``.

    Bins are returned in creation order; inside a bin, longest first."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sequence {i} has {n} tokens, more than the micro-batch budget "
                         f"train_mb_tokens={budget}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def build_micro_batch(sequences: list[np.ndarray], indices: list[int]) -> MicroBatch:
    """Lay ``sequences[indices]`` end to end into one :class:`MicroBatch`."""
    tokens, positions, targets, segments = [], [], [], []
    start = 0
    for i in indices:
        seq = torch.as_tensor(np.asarray(sequences[i]), dtype=torch.int64)
        n = int(seq.numel())
        tokens.append(seq)
        positions.append(torch.arange(n))
        targets.append(torch.cat([seq[1:], seq.new_zeros(1)]))
        segments.append(Segment(i, start, n))
        start += n
    return MicroBatch(torch.cat(tokens)[None], torch.cat(positions)[None], torch.cat(targets)[None],
                      tuple(s.length for s in segments), segments)


def pack(sequences: list[np.ndarray], budget: int, enabled: bool = True) -> tuple[list[MicroBatch], float]:
    """Pack ``sequences`` into micro-batches; returns them and the fill ratio.

    With ``enabled=False`` every sequence gets a micro-batch of its own (the
    fill ratio is then measured against the longest sequence)."""
    lengths = [int(np.asarray(s).size) for s in sequences]
    if any(n < 2 for n in lengths):
        raise ValueError(f"every sequence needs at least 2 tokens (prompt + response), got lengths {lengths}")
    if not lengths:
        return [], 0.0
    if enabled:
        bins = first_fit_decreasing(lengths, budget)
        capacity = len(bins) * budget
    else:
        bins = [[i] for i in range(len(lengths))]
        capacity = len(bins) * max(lengths)
    return [build_micro_batch(sequences, b) for b in bins], sum(lengths) / capacity


def pad_micro_batch(mb: MicroBatch | None, width: int) -> MicroBatch:
    """``mb`` (``None``: no sequences) followed by a block of pad tokens up to ``width`` tokens.

    The pad block is a block of its own (it attends only to itself) and in no segment."""
    real = mb.num_tokens if mb is not None else 0
    pad = width - real
    if pad < 0:
        raise ValueError(f"cannot pad a micro-batch of {real} tokens to {width}")
    if mb is not None and pad == 0:
        return mb
    segments = mb.segments if mb is not None else []
    fill = torch.full((1, pad), PAD_TOKEN, dtype=torch.int64)
    empty = torch.zeros(1, 0, dtype=torch.int64)
    tokens, positions, targets = (mb.tokens, mb.position_ids, mb.targets) if mb is not None else (empty,) * 3
    return MicroBatch(torch.cat([tokens, fill], 1), torch.cat([positions, torch.arange(pad)[None]], 1),
                      torch.cat([targets, fill], 1), (mb.blocks if mb is not None else ()) + (pad,), segments)


def deal(micro_batches: list[MicroBatch], rank: int, ranks: int,
         equal_shapes: bool = False) -> tuple[list[MicroBatch], int]:
    """Data-parallel rank ``rank``'s share of ``micro_batches`` (``rank``, ``rank + ranks``, …) and the
    number of pad tokens added over all ranks.

    With ``equal_shapes`` every rank gets the same number of micro-batches and, in each round, micro-batches
    of the same token count (see the module docstring); without it nothing is padded."""
    if not equal_shapes:
        return micro_batches[rank::ranks], 0
    mine, pad_tokens = [], 0
    for start in range(0, len(micro_batches), ranks):
        round_ = micro_batches[start:start + ranks]
        width = max(mb.num_tokens for mb in round_)
        pad_tokens += width * ranks - sum(mb.num_tokens for mb in round_)
        mine.append(pad_micro_batch(round_[rank] if rank < len(round_) else None, width))
    return mine, pad_tokens
