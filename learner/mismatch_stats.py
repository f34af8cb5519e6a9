"""Per-sequence mismatch between the engine's log-probs and the learner's, as step metrics.

For each trained sequence, over its trained (sampled) tokens, ``d_t = lp_prev − lp_gen``: π_prev is the learner's
log-prob at the weights the step starts from, π_gen the one the engine reported with the token. A sequence gives
its mean ``|d_t|``, its largest ``|d_t|`` and its ``token_mult_prob_error`` ``mean_t exp|d_t|``, which is over
the threshold when it exceeds ``grpo.seq_logprob_error_threshold`` (NeMo-RL's sequence filter), or
:data:`DEFAULT_THRESHOLD` when the recipe sets none. The step reports, over all its sequences and again per
engine that generated them and per policy-version age (learner version − the sequence's oldest token version):

- ``logprob_mismatch_mean`` / ``_max``: mean and max over sequences of the sequence's mean ``|d_t|``;
- ``logprob_mismatch_token_max``: the largest ``|d_t|`` of any token;
- ``logprob_mismatch_over_threshold_share``: share of the sequences over the threshold;
- ``logprob_mismatch_sequences``: how many sequences were measured;

(per engine ``..._engine_<id>``, per age ``..._age_<k>``), ``logprob_mismatch_threshold``, and a histogram of the
sequences' mean ``|d_t|`` (``logprob_mismatch_hist_le_<bound>``: sequences in (previous bound, bound], not
cumulative; :data:`BUCKETS`). With a sequence-level filter on, every sequence is measured before the filter
(rejected ones included); else in the training forward. docs/learner.md, "Seeing the mismatch".
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from learner.batch import Sample
from learner.packing import MicroBatch
from protocol.messages import TrajectoryGroup

DEFAULT_THRESHOLD = 2.0
"""The threshold on ``mean_t exp|d_t|`` when ``grpo.seq_logprob_error_threshold`` is not set: NeMo-RL's value in
its Nemotron-3 recipes (the share is then the sequences that setting would reject)."""
BUCKETS = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, math.inf)
"""Upper bounds of the histogram of the sequences' mean ``|d_t|`` (nats)."""
PREFIX = "logprob_mismatch"
STATS = ("mean", "max", "token_max", "over_threshold_share", "sequences")
"""The statistics of a set of sequences, as key suffixes (``logprob_mismatch_<stat>[_engine_<id>|_age_<k>]``)."""


@dataclass(frozen=True)
class Origin:
    """Where a trajectory came from: the engine that generated it and its age in policy versions."""

    engine: str
    age: int


@dataclass
class Cell:
    """Running statistics of one set of sequences (all, one engine, one age)."""

    sequences: int = 0
    over: int = 0
    sum_mean: float = 0.0
    max_mean: float = -math.inf
    token_max: float = -math.inf

    def add(self, mean_abs: float, max_abs: float, over: bool) -> None:
        self.sequences += 1
        self.over += int(over)
        self.sum_mean += mean_abs
        self.max_mean = max(self.max_mean, mean_abs)
        self.token_max = max(self.token_max, max_abs)

    def summary(self) -> dict[str, float]:
        """The :data:`STATS` of the cell (zeros when it has no sequence)."""
        n = self.sequences
        return {"mean": self.sum_mean / n if n else 0.0, "max": self.max_mean if n else 0.0,
                "token_max": self.token_max if n else 0.0, "over_threshold_share": self.over / n if n else 0.0,
                "sequences": float(n)}


@dataclass
class MismatchStats:
    """The step's per-sequence mismatch, accumulated on each rank and reduced over ranks in :meth:`metrics`."""

    origins: list[Origin]
    """By the sample's ``position`` (every trajectory of the batch, groups in order)."""
    threshold: float = DEFAULT_THRESHOLD
    judged: bool = False
    """Measured from the no-grad π_prev before the sequence filters (the training forwards then add nothing)."""
    total: Cell = field(default_factory=Cell)
    engines: dict[str, Cell] = field(default_factory=dict)
    ages: dict[int, Cell] = field(default_factory=dict)
    hist: list[int] = field(default_factory=lambda: [0] * len(BUCKETS))

    def __post_init__(self):
        for o in self.origins:  # every rank knows every key: the reduction sees the same cells everywhere
            self.engines.setdefault(o.engine, Cell())
            self.ages.setdefault(o.age, Cell())

    @classmethod
    def of(cls, groups: Sequence[TrajectoryGroup], version: int, threshold: float | None,
           steps: Sequence[Sequence[Sample]] = (), prev: Sequence[dict[int, torch.Tensor] | None] = ()
           ) -> MismatchStats:
        """Statistics for the batch ``groups`` trained at learner ``version``; each optimizer step's ``prev`` that is
        not None (π_prev of ``steps``' samples by index, before the filters) is measured now."""
        origins = [Origin(g.engine_id or "unknown",
                          version - int(t.sampled_versions.min()) if t.ok and t.sampled_versions.size else 0)
                   for g in groups for t in g.trajectories]
        stats = cls(origins, DEFAULT_THRESHOLD if threshold is None else threshold)
        for samples, lp_prev in zip(steps, prev, strict=True):
            if lp_prev is not None:
                stats.judged = True
                for i, lp in lp_prev.items():
                    s = samples[i]
                    stats.add(s.position, lp, torch.from_numpy(s.lp_gen[s.loss_mask]))
        return stats

    def add(self, position: int, lp_prev: torch.Tensor, lp_gen: torch.Tensor) -> None:
        """One sequence's trained tokens: the learner's and the engine's log-probs (1-D, equal length)."""
        if lp_prev.numel() == 0:
            return
        d = (lp_prev.detach().double().cpu() - lp_gen.double().cpu()).abs()
        d = torch.nan_to_num(d, nan=math.inf)  # a non-finite d counts as the worst (the step is skipped anyway)
        mean_abs, max_abs = float(d.mean()), float(d.max())
        over = float(torch.exp(d).mean()) > self.threshold
        o = self.origins[position]
        for cell in (self.total, self.engines[o.engine], self.ages[o.age]):
            cell.add(mean_abs, max_abs, over)
        self.hist[int(np.searchsorted(BUCKETS, mean_abs))] += 1  # (previous bound, bound]

    def add_trained(self, mb: MicroBatch, samples: Sequence[Sample], lp_prev: torch.Tensor) -> None:
        """The training forward's π_prev of ``mb``'s trained tokens (segments in order), unless :attr:`judged`."""
        if self.judged:
            return
        sizes = [samples[seg.index].num_trained for seg in mb.segments]
        for seg, lp in zip(mb.segments, torch.split(lp_prev, sizes), strict=True):
            s = samples[seg.index]
            self.add(s.position, lp, torch.from_numpy(s.lp_gen[s.loss_mask]))

    def _cells(self) -> list[Cell]:
        return [self.total, *(self.engines[k] for k in sorted(self.engines)),
                *(self.ages[k] for k in sorted(self.ages))]

    def reduce(self, groups: Sequence, device: torch.device | None = None) -> None:
        """Combine the ranks of each group in turn. Every field is reduced by MAX over the first group (the pipeline
        stages: the last one measured, or all measured the same), by SUM (counts) and MAX over the others."""
        import torch.distributed as dist

        cells = self._cells()
        for j, group in enumerate(groups):
            if dist.get_world_size(group) == 1:
                continue
            flat = [v for c in cells for v in (c.sequences, c.over, c.sum_mean)] + self.hist
            counts = torch.tensor(flat, dtype=torch.float64, device=device)
            maxes = torch.tensor([[c.max_mean, c.token_max] for c in cells], dtype=torch.float64, device=device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX if j == 0 else dist.ReduceOp.SUM, group=group)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
            values = counts.tolist()
            for i, c in enumerate(cells):
                c.sequences, c.over, c.sum_mean = int(values[3 * i]), int(values[3 * i + 1]), values[3 * i + 2]
                c.max_mean, c.token_max = (float(v) for v in maxes[i].tolist())
            self.hist = [int(v) for v in values[3 * len(cells):]]

    def metrics(self) -> dict[str, float]:
        """The step's keys (module docstring; after :meth:`reduce` on several ranks). Engines and ages without a
        measured sequence are left out."""
        out = {f"{PREFIX}_{k}": v for k, v in self.total.summary().items()}
        out[f"{PREFIX}_threshold"] = self.threshold
        out.update({f"{PREFIX}_hist_le_{b:g}": float(n) for b, n in zip(BUCKETS, self.hist, strict=True)})
        for kind, cells in (("engine", self.engines), ("age", self.ages)):
            for key, cell in sorted(cells.items()):
                if cell.sequences:
                    out.update({f"{PREFIX}_{k}_{kind}_{key}": v for k, v in cell.summary().items()})
        return out
