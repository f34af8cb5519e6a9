"""Sequence-level off-policy filters: whole sequences whose engine-vs-learner mismatch is too large.

Decided once per rollout batch, before the training forwards, from each sequence's trained tokens: π_prev (the
learner's log-probs at the weights the batch starts from, one no-grad forward) against π_gen (the engine's), with
``d_t = lp_prev − lp_gen``. In the order checked (a sequence is counted once, under the first that fires):

- ``logprob_error`` (NeMo-RL ``grpo.seq_logprob_error_threshold``): rejected where ``mean_t exp(|d_t|) > threshold``.
- ``geo_rs`` (verl's geometric rejection sampling): rejected where ``exp(mean_t d_t) ∉ [geo_rs_ratio_min,
  geo_rs_ratio_max]``.
- ``opsm`` (slime/miles off-policy sequence masking, DeepSeek-V3.2): rejected where ``A < 0`` and
  ``mean_t(−d_t) > opsm_delta``.
- ``seq_mask_tis`` (NeMo-RL ``truncated_importance_sampling_type: seq-mask-tis``): masked where
  ``exp(mean_t d_t) ∉ [truncated_importance_sampling_ratio_min, truncated_importance_sampling_ratio]``.

A rejected sequence leaves the loss as NeMo-RL's ``sample_mask`` 0 does: no token in the loss, in N or in a token
metric; its reward stays in its group's baseline. A ``seq_mask_tis`` sequence keeps its tokens in N and the
metrics with importance weight 0 (NeMo-RL's ``ClippedPGLossFn``). A non-finite ``d`` fires nothing: the loss
turns non-finite and the step is skipped and reported. docs/learner.md, "Sequence-level masking".
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from learner.batch import Sample
from learner.config import LossConfig

REASONS = ("logprob_error", "geo_rs", "opsm", "seq_mask_tis")
REJECTING = frozenset(REASONS[:3])


def active(loss: LossConfig, seq_logprob_error_threshold: float | None) -> bool:
    """Whether any sequence-level filter is on (they need π_prev before the training forwards)."""
    return (seq_logprob_error_threshold is not None or loss.geo_rs_ratio_max is not None
            or loss.opsm_delta is not None or loss.truncated_importance_sampling_type == "seq-mask-tis")


def verdict(lp_prev: torch.Tensor, lp_gen: torch.Tensor, advantage: float, loss: LossConfig,
            seq_logprob_error_threshold: float | None) -> str | None:
    """The reason (one of :data:`REASONS`) the sequence with these per-token log-probs is filtered, or None."""
    if lp_prev.numel() == 0:
        return None
    d = lp_prev.double() - lp_gen.double().to(lp_prev.device)
    mean_d = float(d.mean())
    if seq_logprob_error_threshold is not None and float(torch.exp(d.abs()).mean()) > seq_logprob_error_threshold:
        return "logprob_error"
    geo = float(np.exp(mean_d))
    hi = loss.geo_rs_ratio_max
    if hi is not None:
        lo = loss.geo_rs_ratio_min if loss.geo_rs_ratio_min is not None else 1.0 / hi
        if geo < lo or geo > hi:
            return "geo_rs"
    if loss.opsm_delta is not None and advantage < 0 and -mean_d > loss.opsm_delta:
        return "opsm"
    if loss.truncated_importance_sampling_type == "seq-mask-tis":
        lo, hi = loss.truncated_importance_sampling_ratio_min, loss.truncated_importance_sampling_ratio
        if lo is not None and hi is not None and (geo < lo or geo > hi):
            return "seq_mask_tis"
    return None


@dataclass
class SeqFilterStats:
    """Sequences judged and filtered (by reason) in one step; all-reduced over data-parallel ranks."""

    sequences: int = 0
    masked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def all_reduce(self, group, device: torch.device | None = None) -> None:
        import torch.distributed as dist

        if dist.get_world_size(group) == 1:
            return
        t = torch.tensor([self.sequences] + [self.masked[r] for r in REASONS], dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        self.sequences = int(t[0])
        self.masked = {r: int(v) for r, v in zip(REASONS, t[1:].tolist(), strict=True)}

    def metrics(self) -> dict[str, float]:
        """``seq_masked_<reason>`` counts, ``seq_masked`` (their sum) and ``seq_masked_share`` of the sequences."""
        total = sum(self.masked.values())
        return {**{f"seq_masked_{r}": float(n) for r, n in self.masked.items()}, "seq_masked": float(total),
                "seq_masked_share": total / self.sequences if self.sequences else 0.0}


def apply(steps: list[list[Sample]], prev: list[dict[int, torch.Tensor] | None], loss: LossConfig,
          seq_logprob_error_threshold: float | None, on: bool) -> SeqFilterStats:
    """Judge every sequence of each optimizer step's ``prev`` (this rank's π_prev, by index into that step's
    samples) when ``on``: a rejected one gets an all-False loss mask (and an empty
    π_prev), a ``seq_mask_tis`` one ``is_weight_scale`` 0 (both replaced in the list); returns the counts."""
    stats = SeqFilterStats()
    for samples, lp_prev in zip(steps, prev, strict=True):
        if not on or lp_prev is None:
            continue
        for i, lp in list(lp_prev.items()):
            s = samples[i]
            reason = verdict(lp, torch.from_numpy(s.lp_gen[s.loss_mask]), s.advantage, loss,
                             seq_logprob_error_threshold)
            stats.sequences += 1
            if reason is None:
                continue
            stats.masked[reason] += 1
            if reason in REJECTING:
                samples[i] = replace(s, loss_mask=np.zeros_like(s.loss_mask))
                lp_prev[i] = lp[:0]
            else:
                samples[i] = replace(s, is_weight_scale=0.0)
    return stats
