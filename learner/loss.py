"""The GRPO loss, its advantages and its metrics.

:func:`group_advantages`: group-relative advantages (sample std, or the mean
difference alone; or the leave-one-out baseline of RLOO); an all-equal group
has exactly zero advantages and is counted. :func:`per_token_loss`: the clipped surrogate (optionally
dual-clipped) with the ``tis`` / ``icepop`` importance weight (no gradient) and the clamped k3 KL penalty,
per response token; the step's loss is ``Σ_t loss_t / N`` over the trained response tokens of
the **global** batch, so micro-batch gradients add up to one masked mean. Trained = sampled by the engine
(``Trajectory.loss_mask`` 1): a multi-turn sample's environment tokens are selected out before the loss
(:func:`learner.batch.trained_positions`), so they get no loss, no IS weight and no place in N or a metric.
:class:`LossStats` accumulates the metrics (``gen_kl_error``,
``policy_kl_error``, ``token_mult_prob_error``, ratios, IS weights) and
all-reduces them over data-parallel ranks.

The formulas and the metric table: docs/learner.md, "The loss" and "Metrics".
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from learner.config import LossConfig

ADVANTAGE_EPS = 1e-6
PART_KEYS = ("ratio", "is_weight", "gen_kl", "policy_kl", "mult_prob_error", "clipped", "entropy")


def group_advantages(rewards: Sequence[float] | np.ndarray, normalize: bool,
                     leave_one_out: bool = False) -> tuple[np.ndarray, bool]:
    """Advantages of one group's valid samples, and whether the group has no signal (all zero)."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size < 2 or np.all(r == r[0]):
        return np.zeros(r.size, dtype=np.float32), True
    if leave_one_out:
        return leave_one_out_advantages(r, normalize).astype(np.float32), False
    centred = r - r.mean()
    if normalize:
        centred = centred / (r.std(ddof=1) + ADVANTAGE_EPS)
    return centred.astype(np.float32), False


def leave_one_out_advantages(r: np.ndarray, normalize: bool) -> np.ndarray:
    """RLOO (NeMo-RL ``calculate_baseline_and_std_per_prompt(leave_one_out_baseline=True)``): the baseline of
    sample i is the mean of the other n-1 rewards, its std the sample std (Bessel, n-2 in the denominator) of
    those n-1 rewards, 0 when n = 2; with ``normalize`` the difference is divided by ``std + 1e-6`` where that
    std is > 0 (else left as it is)."""
    n = r.size
    baseline = (r.sum() - r) / (n - 1)
    sq = ((r * r).sum() - r * r) / (n - 1)
    var = np.clip(sq - baseline * baseline, 0.0, None) * ((n - 1) / (n - 2)) if n > 2 else np.zeros(n)
    std = np.sqrt(var)
    adv = r - baseline
    if normalize:
        adv = np.where(std > 0, adv / (std + ADVANTAGE_EPS), adv)
    return adv


def k3(lp_sampler: torch.Tensor, lp_other: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler‖other) at tokens drawn from the sampler."""
    d = lp_other - lp_sampler
    return torch.exp(d) - d - 1.0


def reference_kl(lp: torch.Tensor, lp_ref: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """The per-token KL penalty term (NeMo-RL ``calculate_kl``, k3): ``d = clamp(lp_ref - lp, ±in)``,
    ``kl = clamp(s·(e^d - d - 1), ±out)`` with ``s = exp(lp - sg(lp))``, which is 1 but carries the
    score-function gradient ``kl·∇lp`` of sampling from π_θ (NeMo-RL #2506; none where the input clamp binds)."""
    d = lp_ref - lp
    score = torch.exp(lp - lp.detach())
    if cfg.kl_input_clamp_value is not None:
        v = cfg.kl_input_clamp_value
        clamped = d.clamp(-v, v)
        score = torch.where(d == clamped, score, score.detach())
        d = clamped
    kl = score * (torch.exp(d) - d - 1.0)
    if cfg.kl_output_clamp_value is not None:
        kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl


def importance_weights(lp_prev: torch.Tensor, lp_gen: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """w = π_prev/π_gen, clamped to [ratio_min or 0, c] ("tis") or zeroed outside [ratio_min or 1/c, c]
    ("icepop"); untruncated when c is None or with "seq-mask-tis" (whose masking is per sequence,
    :mod:`learner.seq_filter`); 1 when off. A non-finite weight stays non-finite, so that the step
    is skipped and reported (NeMo-RL's ``nan_to_num`` would train on it as 0)."""
    if not cfg.use_importance_sampling_correction:
        return torch.ones_like(lp_prev)
    ratio = torch.exp(lp_prev - lp_gen)
    c, low = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
    if c is None or cfg.truncated_importance_sampling_type == "seq-mask-tis":
        return ratio
    if cfg.truncated_importance_sampling_type == "tis":
        return torch.clamp(ratio, min=0.0 if low is None else low, max=c)
    inside = (ratio >= (1.0 / c if low is None else low)) & (ratio <= c)
    return torch.where(inside, ratio, torch.zeros_like(ratio))


@dataclass
class TokenInputs:
    """Per-token inputs of the loss for one micro-batch's trained response tokens (1-D, equal length)."""

    lp_prev: torch.Tensor
    lp_gen: torch.Tensor
    advantages: torch.Tensor
    lp_ref: torch.Tensor | None = None
    is_weight_scale: torch.Tensor | None = None
    """Per-token factor of the importance weight (0 in a ``seq-mask-tis`` masked sequence); None: 1."""


def per_token_loss(lp: torch.Tensor, x: TokenInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss_t for every token (differentiable in ``lp``) and the per-token quantities the metrics need.
    With ``force_on_policy_ratio`` π_prev is ``lp`` itself, detached (ratio exactly 1), as in NeMo-RL."""
    lp_prev = lp.detach() if cfg.force_on_policy_ratio else x.lp_prev
    adv = x.advantages
    ratio = torch.exp(lp - lp_prev)
    clipped = torch.clamp(ratio, 1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    c = cfg.ratio_clip_c
    if c is not None:  # dual clip: for A < 0 the surrogate never falls below c·A
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, c * adv), surrogate)
    w = importance_weights(lp_prev, x.lp_gen, cfg).detach()
    if x.is_weight_scale is not None:
        w = torch.where(x.is_weight_scale > 0, w * x.is_weight_scale, torch.zeros_like(w))  # 0, even for w = inf
    loss = -w * surrogate
    if cfg.reference_policy_kl_penalty > 0:
        if x.lp_ref is None:
            raise ValueError("reference_policy_kl_penalty > 0 needs the reference policy's log-probs (lp_ref)")
        loss = loss + cfg.reference_policy_kl_penalty * reference_kl(lp, x.lp_ref, cfg)
    with torch.no_grad():
        binds = ((adv > 0) & (ratio > 1.0 + cfg.ratio_clip_max)) | ((adv < 0) & (ratio < 1.0 - cfg.ratio_clip_min))
        if c is not None:
            binds = binds | ((adv < 0) & (ratio > c))
        parts = {"ratio": ratio.detach(), "is_weight": w, "clipped": binds.to(ratio.dtype),
                 "gen_kl": k3(x.lp_gen, lp_prev), "policy_kl": k3(lp_prev, lp.detach()),
                 "mult_prob_error": torch.exp(torch.abs(lp_prev - x.lp_gen))}
    return loss, parts


@dataclass
class LossStats:
    """Accumulates the per-token metric quantities of a step over micro-batches (and ranks); ``tokens`` counts
    the trained tokens (the ``num_valid_tokens`` metric, N)."""

    sums: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    loss: float = 0.0

    def add(self, parts: dict[str, torch.Tensor], mb_loss: float) -> None:
        self.loss += mb_loss
        n = 0
        for k, v in parts.items():
            n = int(v.numel())
            if n == 0:
                continue
            self.sums[k] = self.sums.get(k, 0.0) + float(v.double().sum())
            self.mins[k] = min(self.mins.get(k, float("inf")), float(v.min()))
            self.maxs[k] = max(self.maxs.get(k, float("-inf")), float(v.max()))
        self.tokens += n

    def all_reduce(self, group, device: torch.device | None = None) -> None:
        """Combine the statistics of every rank of ``group`` (sums add, min/max reduce); the reduced tensors
        live on ``device`` (the model's: a NCCL group reduces GPU tensors only)."""
        import torch.distributed as dist

        if dist.get_world_size(group) == 1:
            return
        keys = sorted(PART_KEYS)
        sums = torch.tensor([self.sums.get(k, 0.0) for k in keys] + [self.tokens, self.loss], dtype=torch.float64,
                            device=device)
        mins = torch.tensor([self.mins.get(k, float("inf")) for k in keys], dtype=torch.float64, device=device)
        maxs = torch.tensor([self.maxs.get(k, float("-inf")) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
        self.tokens, self.loss = int(sums[-2]), float(sums[-1])
        self.sums = {k: float(v) for k, v in zip(keys, sums[:-2], strict=True)}
        self.mins = {k: float(v) for k, v in zip(keys, mins, strict=True) if v != float("inf")}
        self.maxs = {k: float(v) for k, v in zip(keys, maxs, strict=True) if v != float("-inf")}

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        mean = {k: s / n for k, s in self.sums.items()}
        return {
            "loss": self.loss,
            "gen_kl_error": mean.get("gen_kl", 0.0),
            "policy_kl_error": mean.get("policy_kl", 0.0),
            "token_mult_prob_error": mean.get("mult_prob_error", 1.0),
            "probs_ratio_mean": mean.get("ratio", 1.0),
            "probs_ratio_min": self.mins.get("ratio", 1.0),
            "probs_ratio_max": self.maxs.get("ratio", 1.0),
            "is_weight_mean": mean.get("is_weight", 1.0),
            "is_weight_max": self.maxs.get("is_weight", 1.0),
            "clip_fraction": mean.get("clipped", 0.0),
            "token_entropy_mean": mean.get("entropy", 0.0),
            "num_valid_tokens": float(self.tokens),
        }
