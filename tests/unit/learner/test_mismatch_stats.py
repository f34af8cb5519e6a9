"""Per-sequence engine-vs-learner mismatch (learner.mismatch_stats, issue 37 item 3) on hand-built log-prob gaps:
known gaps give known max / mean / share over the threshold / histogram buckets, in total, per engine and per
policy-version age, the same whether measured before the filters or in the training forwards."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.batch import Sample, collect
from learner.config import TrainStepConfig
from learner.mismatch_stats import BUCKETS, DEFAULT_THRESHOLD, MismatchStats
from learner.packing import pack
from protocol.messages import Trajectory, TrajectoryGroup

VERSION = 5
P = "logprob_mismatch"
# per trained sequence (3 response tokens each): d = lp_prev - lp_gen, and its oldest token version
GAPS = {0: [0.0, 0.0, 0.0], 1: [0.3, -0.3, 0.0], 3: [2.0, 0.0, -1.0], 4: [0.002, -0.002, 0.002]}


def _traj(versions: list[int], failed: bool = False) -> Trajectory:
    return Trajectory(np.array([7, 8, 9]), np.full(3, -1.0), np.array(versions), None if failed else 1.0,
                      "error" if failed else "stop", "failed" if failed else "")


def _batch() -> tuple[list[TrajectoryGroup], list[Sample]]:
    """Engine e0: ages 0 and 1 and a failed sample; engine e1: ages 0 and 2."""
    g0 = TrajectoryGroup("g0", "p0", np.array([1, 2]), [_traj([5, 5, 5]), _traj([4, 5, 5]), _traj([5, 5, 5], True)],
                         3, 64, engine_id="e0")
    g1 = TrajectoryGroup("g1", "p1", np.array([1, 2]), [_traj([5, 5, 5]), _traj([3, 4, 5])], 2, 64, engine_id="e1")
    groups = [g0, g1]
    return groups, collect(groups, 64, True, TrainStepConfig()).samples


def _prev(s: Sample) -> torch.Tensor:
    return torch.from_numpy(s.lp_gen[s.loss_mask]).double() + torch.tensor(GAPS[s.position], dtype=torch.float64)


def _judged(threshold: float | None = None) -> dict[str, float]:
    groups, samples = _batch()
    stats = MismatchStats.of(groups, VERSION, threshold, [samples], [{i: _prev(s) for i, s in enumerate(samples)}])
    assert stats.judged
    return stats.metrics()


def test_known_gaps_give_known_statistics_in_total():
    m = _judged()
    assert [s.position for s in _batch()[1]] == [0, 1, 3, 4]  # the failed sample is not measured
    assert m[f"{P}_sequences"] == 4
    assert m[f"{P}_mean"] == pytest.approx((0 + 0.2 + 1.0 + 0.002) / 4, rel=1e-6)
    assert m[f"{P}_max"] == pytest.approx(1.0, rel=1e-6)
    assert m[f"{P}_token_max"] == pytest.approx(2.0, rel=1e-6)
    # mean exp|d|: 1, 1.23, 3.70, 1.002 -> one over the default threshold 2
    assert m[f"{P}_threshold"] == DEFAULT_THRESHOLD
    assert m[f"{P}_over_threshold_share"] == 0.25


def test_the_recipe_threshold_is_used_when_set():
    m = _judged(threshold=1.2)
    assert m[f"{P}_threshold"] == 1.2
    assert m[f"{P}_over_threshold_share"] == 0.5  # (2 e^0.3 + 1) / 3 = 1.233 is over 1.2 now


def test_per_engine_and_per_age():
    m = _judged()
    assert m[f"{P}_sequences_engine_e0"] == 2 and m[f"{P}_sequences_engine_e1"] == 2
    assert m[f"{P}_mean_engine_e0"] == pytest.approx(0.1, rel=1e-6)
    assert m[f"{P}_max_engine_e0"] == pytest.approx(0.2, rel=1e-6)
    assert m[f"{P}_token_max_engine_e0"] == pytest.approx(0.3, rel=1e-6)
    assert m[f"{P}_over_threshold_share_engine_e0"] == 0.0
    assert m[f"{P}_mean_engine_e1"] == pytest.approx(0.501, rel=1e-6)
    assert m[f"{P}_over_threshold_share_engine_e1"] == 0.5
    # ages: learner version 5 - oldest token version of the sequence
    assert {k: m[k] for k in m if k.startswith(f"{P}_sequences_age_")} == {
        f"{P}_sequences_age_0": 2, f"{P}_sequences_age_1": 1, f"{P}_sequences_age_2": 1}
    assert m[f"{P}_mean_age_0"] == pytest.approx(0.5, rel=1e-6)
    assert m[f"{P}_max_age_1"] == pytest.approx(0.2, rel=1e-6)
    assert m[f"{P}_max_age_2"] == pytest.approx(0.002, rel=1e-3)


def test_histogram_buckets_are_per_bucket_counts():
    m = _judged()
    hist = {b: m[f"{P}_hist_le_{b:g}"] for b in BUCKETS}
    # 0 -> <= 1e-5; 0.002 -> (1e-3, 1e-2]; 0.2 and 1.0 -> (0.1, 1]
    assert hist == {1e-5: 1, 1e-4: 0, 1e-3: 0, 1e-2: 1, 1e-1: 0, 1.0: 2, math.inf: 0}
    assert sum(hist.values()) == m[f"{P}_sequences"]


def test_training_forward_path_equals_the_judged_one():
    groups, samples = _batch()
    stats = MismatchStats.of(groups, VERSION, None, [samples], [None])
    assert not stats.judged
    for mb in pack([s.tokens for s in samples], 16, True)[0]:
        stats.add_trained(mb, samples, torch.cat([_prev(samples[seg.index]) for seg in mb.segments]))
    judged = _judged()
    assert stats.metrics() == pytest.approx(judged, rel=1e-9)


def test_a_judged_batch_ignores_the_training_forwards():
    groups, samples = _batch()
    stats = MismatchStats.of(groups, VERSION, None, [samples], [{0: _prev(samples[0])}])
    mb = pack([s.tokens for s in samples], 64, True)[0][0]
    stats.add_trained(mb, samples, torch.cat([_prev(samples[seg.index]) for seg in mb.segments]))
    assert stats.metrics()[f"{P}_sequences"] == 1


def test_a_non_finite_gap_is_the_worst_bucket_and_over_the_threshold():
    groups, samples = _batch()
    stats = MismatchStats.of(groups, VERSION, None)
    stats.add(0, torch.tensor([float("nan"), 0.0]), torch.zeros(2))
    m = stats.metrics()
    assert m[f"{P}_hist_le_inf"] == 1 and m[f"{P}_over_threshold_share"] == 1.0
    assert m[f"{P}_max"] == math.inf


def test_an_engine_without_id_is_unknown_and_an_empty_batch_reports_zeros():
    g = TrajectoryGroup("g", "p", np.array([1]), [_traj([5, 5, 5])], 1, 64)
    m = MismatchStats.of([g], VERSION, None).metrics()
    assert m[f"{P}_sequences"] == 0 and m[f"{P}_mean"] == 0.0 and m[f"{P}_max"] == 0.0
    assert not any("_engine_" in k or "_age_" in k for k in m)  # only cells with sequences
    stats = MismatchStats.of([g], VERSION, None)
    stats.add(0, torch.tensor([-1.0]), torch.tensor([-1.5]))
    assert stats.metrics()[f"{P}_sequences_engine_unknown"] == 1
