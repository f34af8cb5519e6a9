"""Sequence-level off-policy masking (learner.seq_filter, issue 37 item 2) on hand-built log-probs: each filter
fires on the sequence built to cross its threshold and names it; rejected sequences leave N, seq-mask-tis ones
stay in N with weight 0; with every filter off the loss is today's, bit for bit."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from learner import seq_filter
from learner.batch import Sample, token_inputs, trained_positions
from learner.config import LossConfig, TrainStepConfig
from learner.loss import TokenInputs, per_token_loss
from learner.packing import pack

SEQ_MASK_TIS: dict[str, Any] = dict(truncated_importance_sampling_type="seq-mask-tis",
                                    truncated_importance_sampling_ratio=1.002,
                                    truncated_importance_sampling_ratio_min=0.999)


def _t(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def test_a_sequence_over_the_logprob_error_threshold_is_rejected_with_its_reason():
    gen = _t([-1.0, -1.0, -1.0, -1.0])
    # mean exp(|d|) = (e^1 + 3) / 4 = 1.43 on one, (e^0.1 * 4) / 4 = 1.105 on the other
    over, under = gen + _t([1.0, 0.0, 0.0, 0.0]), gen + 0.1
    cfg = LossConfig()
    assert seq_filter.verdict(over, gen, 1.0, cfg, 1.4) == "logprob_error"
    assert seq_filter.verdict(under, gen, 1.0, cfg, 1.4) is None
    assert seq_filter.verdict(over, gen, 1.0, cfg, None) is None  # off


@pytest.mark.parametrize(("mean_d", "lo", "expected"), [
    (math.log(1.002), None, "geo_rs"),   # above the upper bound
    (math.log(1.0009), None, None),      # inside [1/1.001, 1.001]
    (-math.log(1.002), None, "geo_rs"),  # below 1/upper (verl's default lower bound)
    (-math.log(1.002), 0.99, None),      # inside an explicit lower bound
    (math.log(0.98), 0.99, "geo_rs"),
])
def test_geo_rs_rejects_a_geometric_mean_ratio_outside_its_bounds(mean_d, lo, expected):
    gen = _t([-2.0, -0.5, -1.0])
    prev = gen + _t([mean_d + 0.3, mean_d - 0.3, mean_d])  # per-token ratios differ, their geometric mean is e^mean_d
    cfg = LossConfig(geo_rs_ratio_max=1.001, geo_rs_ratio_min=lo)
    assert seq_filter.verdict(prev, gen, 1.0, cfg, None) == expected


def test_opsm_rejects_only_negative_advantages_past_delta():
    gen = _t([-1.0, -1.0])
    prev = gen - 0.01  # mean log(pi_gen / pi_prev) = 0.01
    cfg = LossConfig(opsm_delta=0.005)
    assert seq_filter.verdict(prev, gen, -1.0, cfg, None) == "opsm"
    assert seq_filter.verdict(prev, gen, 1.0, cfg, None) is None
    assert seq_filter.verdict(prev, gen, -1.0, LossConfig(opsm_delta=0.02), None) is None


def test_seq_mask_tis_masks_by_geometric_mean_and_keeps_raw_untruncated_weights():
    cfg = LossConfig(**SEQ_MASK_TIS)
    gen = _t([-1.0, -1.0])
    # token ratios e^0.5 and e^-0.5: far outside [0.999, 1.002] each, geometric mean exactly 1 -> kept
    kept = gen + _t([0.5, -0.5])
    assert seq_filter.verdict(kept, gen, 1.0, cfg, None) is None
    assert seq_filter.verdict(gen + 0.01, gen, 1.0, cfg, None) == "seq_mask_tis"
    x = TokenInputs(lp_prev=kept, lp_gen=gen, advantages=_t([1.0, 1.0]))
    _, parts = per_token_loss(kept.clone(), x, cfg)
    torch.testing.assert_close(parts["is_weight"], torch.exp(_t([0.5, -0.5])))  # not truncated at 1.002
    masked = TokenInputs(lp_prev=kept, lp_gen=gen, advantages=_t([1.0, 1.0]), is_weight_scale=_t([0.0, 0.0]))
    loss, parts = per_token_loss(kept.clone(), masked, cfg)
    assert torch.equal(loss, torch.zeros(2)) and torch.equal(parts["is_weight"], torch.zeros(2))


def _samples() -> list[Sample]:
    """Four 3-token responses after a 2-token prompt; advantages +1, -1, +1, -1."""
    out = []
    for i in range(4):
        toks = np.array([1, 2, 10 + i, 11 + i, 12 + i], dtype=np.int64)
        out.append(Sample(toks, 2, np.full(3, -1.0, np.float32), np.ones(3, bool), 1.0 if i % 2 == 0 else -1.0,
                          position=i))
    return out


def test_rejected_sequences_leave_the_loss_and_n_and_seq_mask_tis_ones_stay_with_weight_zero():
    samples = _samples()
    gen = torch.full((3,), -1.0)
    prev = {0: gen.clone(),                     # kept
            1: gen + 1.0,                       # mean exp|d| = e: over the threshold 2
            2: gen + math.log(1.01),            # geometric mean 1.01: outside seq-mask-tis' [0.999, 1.002] only
            3: gen + 0.0005}                    # kept
    cfg = LossConfig(use_importance_sampling_correction=True, **SEQ_MASK_TIS)
    stats = seq_filter.apply([samples], [prev], cfg, 2.0, True)
    assert stats.metrics() == {"seq_masked_logprob_error": 1.0, "seq_masked_geo_rs": 0.0, "seq_masked_opsm": 0.0,
                               "seq_masked_seq_mask_tis": 1.0, "seq_masked": 2.0, "seq_masked_share": 0.5}
    assert [s.num_trained for s in samples] == [3, 0, 3, 3]  # N = 9: the rejected one is out, seq-mask-tis in
    assert [s.is_weight_scale for s in samples] == [1.0, 1.0, 0.0, 1.0] and prev[1].numel() == 0

    # the loss the trainer builds: Σ loss_t / N over the packed micro-batch's trained tokens
    (mb,), _ = pack([s.tokens for s in samples], 64, True)
    order = [seg.index for seg in mb.segments]
    lp_prev = torch.cat([prev[i] for i in order])
    assert sum(p.numel() for p in trained_positions(mb, samples)) == 9 == lp_prev.numel()
    x = token_inputs(mb, samples, lp_prev, None, torch.device("cpu"))
    loss_t, _ = per_token_loss(lp_prev.clone(), x, cfg)
    n = sum(s.num_trained for s in samples)
    by_seq = dict(zip(order, loss_t.split([samples[i].num_trained for i in order]), strict=True))
    assert torch.equal(by_seq[2], torch.zeros(3))  # masked: weight 0, still 3 of the 9 tokens of N
    expected = (-torch.exp(prev[0] - gen) * 1.0).sum() + (-torch.exp(prev[3] - gen) * -1.0).sum()
    torch.testing.assert_close(loss_t.sum() / n, expected / 9)


def test_geo_rs_and_opsm_reject_and_count_their_reasons():
    samples = _samples()
    gen = torch.full((3,), -1.0)
    prev = {0: gen + 0.1, 1: gen - 0.1, 2: gen.clone(), 3: gen.clone()}
    stats = seq_filter.apply([samples], [prev], LossConfig(geo_rs_ratio_max=1.05, opsm_delta=0.05), None, True)
    # 0: geometric mean e^0.1 > 1.05; 1: also outside (e^-0.1 < 1/1.05): geo_rs comes first in the order
    assert stats.masked == {"logprob_error": 0, "geo_rs": 2, "opsm": 0, "seq_mask_tis": 0}
    samples = _samples()
    prev = {0: gen.clone(), 1: gen - 0.1, 2: gen.clone(), 3: gen.clone()}
    stats = seq_filter.apply([samples], [prev], LossConfig(opsm_delta=0.05), None, True)
    assert stats.masked["opsm"] == 1 and [s.num_trained for s in samples] == [3, 0, 3, 3]


def test_every_filter_off_is_todays_loss_bit_for_bit():
    cfg, samples = LossConfig(), _samples()
    assert not seq_filter.active(cfg, TrainStepConfig().seq_logprob_error_threshold)
    gen = torch.full((3,), -1.0)
    prev = {i: gen + 0.3 * i for i in range(4)}
    stats = seq_filter.apply([samples], [prev], cfg, None, False)
    assert stats.sequences == 0 and [s.num_trained for s in samples] == [3] * 4
    (mb,), _ = pack([s.tokens for s in samples], 64, True)
    lp_prev = torch.cat([prev[seg.index] for seg in mb.segments])
    x = token_inputs(mb, samples, lp_prev, None, torch.device("cpu"))
    assert x.is_weight_scale is None
    lp = lp_prev + 0.01
    loss, _ = per_token_loss(lp, x, cfg)
    ratio = torch.exp(lp - lp_prev)
    surrogate = torch.minimum(ratio * x.advantages, torch.clamp(ratio, 0.8, 1.28) * x.advantages)
    assert torch.equal(loss, -torch.clamp(torch.exp(lp_prev - x.lp_gen), min=0.0, max=2.0) * surrogate)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=1.002),
     "seq-mask-tis needs both bounds"),
    (dict(SEQ_MASK_TIS, use_importance_sampling_correction=False), "needs use_importance_sampling_correction"),
    (dict(geo_rs_ratio_min=0.99), "geo_rs_ratio_min (0.99) needs geo_rs_ratio_max"),
    (dict(geo_rs_ratio_max=0.9), "greater than or equal to 1"),
    (dict(geo_rs_ratio_max=1.01, geo_rs_ratio_min=1.5), "less than or equal to 1"),
    (dict(opsm_delta=-0.1), "greater than or equal to 0"),
])
def test_bad_bounds_are_refused_at_load(kwargs, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LossConfig(**kwargs)


def test_seq_logprob_error_threshold_below_one_is_refused():
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        TrainStepConfig(seq_logprob_error_threshold=0.5)
