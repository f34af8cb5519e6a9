"""Multi-turn samples in the learner without a model: environment tokens (loss mask 0) stay in the packed
sequence as context but get no loss, no IS weight, no gradient and no place in N or a token metric.

The loss of a packed micro-batch through :func:`learner.batch.trained_positions` / :func:`token_inputs` /
:func:`per_token_loss` is checked against a numpy computation over the sampled tokens alone.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner.batch import collect, token_inputs, trained_positions
from learner.config import LossConfig, TrainStepConfig
from learner.logprobs import response_slices
from learner.loss import LossStats, per_token_loss
from learner.packing import pack
from protocol import Trajectory, TrajectoryGroup, masked_fill

MASK = np.array([1, 1, 0, 0, 0, 1, 1, 0, 1], np.uint8)  # turn 1, environment turn, turn 2, env, turn 3
CFG = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.28, truncated_importance_sampling_ratio=2.0)


def _multi_turn(reward: float, gen: np.ndarray, mask=MASK, reason="stop") -> Trajectory:
    n = mask.size
    lps, vers = masked_fill(mask, gen[:n], np.array([1, 1, 1, 1, 1, 2, 2, 2, 2])[:n])
    return Trajectory(np.arange(20, 20 + n), lps, vers, reward, reason, "", {}, mask)


def _batch(max_len: int = 64, cfg: TrainStepConfig | None = None):
    rng = np.random.default_rng(3)
    gen = -rng.uniform(0.1, 2.0, 9).astype(np.float32)
    trajs = [_multi_turn(1.0, gen), Trajectory(np.arange(30, 34), -np.full(4, 0.5), np.zeros(4), 0.0),
             _multi_turn(0.0, gen[::-1].copy())]
    g = TrajectoryGroup("g", "p", np.array([1, 2, 3]), trajs, 3, 64)
    return collect([g], max_len, False, cfg or TrainStepConfig())


def test_collect_keeps_the_mask_and_counts_environment_tokens():
    batch = _batch()
    assert [s.loss_mask.tolist() for s in batch.samples] == [MASK.astype(bool).tolist(), [True] * 4,
                                                             MASK.astype(bool).tolist()]
    assert [s.num_trained for s in batch.samples] == [5, 4, 5]
    assert batch.env_tokens == 8 and batch.response_lengths == [9, 4, 9]  # lengths: the whole response


def test_truncation_cuts_the_mask_and_a_sample_cut_before_its_first_sampled_token_is_dropped():
    mask = np.array([1, 1, 1, 0, 0, 0, 1], np.uint8)
    lead = np.array([0, 0, 0, 0, 0, 0, 1], np.uint8)  # environment tokens first, cut before its sampled token
    g = TrajectoryGroup("g", "p", np.array([1, 2, 3]), [
        _multi_turn(1.0, -np.ones(9), mask, "length"), _multi_turn(0.0, -np.ones(9), lead)], 2, 64)
    batch = collect([g], 3 + 5, False, TrainStepConfig())  # room for 5 response tokens
    assert batch.truncated_samples == 2 and len(batch.samples) == 1 and batch.samples[0].position == 0
    assert batch.samples[0].loss_mask.tolist() == [True, True, True, False, False]
    assert batch.samples[0].lp_gen.size == 5 and batch.env_tokens == 2


def test_trained_positions_are_the_response_slices_with_an_all_ones_mask_and_skip_environment_tokens():
    batch = _batch()
    (mb,), _ = pack([s.tokens for s in batch.samples], 64)
    slices = response_slices(mb, [s.prompt_len for s in batch.samples])
    for seg, sl, at in zip(mb.segments, slices, trained_positions(mb, batch.samples), strict=True):
        expect = np.arange(sl.start, sl.stop)[batch.samples[seg.index].loss_mask]
        assert at.tolist() == expect.tolist()
        if batch.samples[seg.index].loss_mask.all():
            assert at.tolist() == list(range(sl.start, sl.stop))


def _hand_loss(lp, lp_prev, lp_gen, adv, cfg: LossConfig) -> np.ndarray:
    rho = np.exp(lp - lp_prev)
    w = np.minimum(np.exp(lp_prev - lp_gen), cfg.truncated_importance_sampling_ratio)
    return -w * np.minimum(rho * adv, np.clip(rho, 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max) * adv)


def _micro_batch_loss(batch, lp_all: torch.Tensor, lp_prev_all: torch.Tensor):
    (mb,), _ = pack([s.tokens for s in batch.samples], 64)
    at = torch.cat(trained_positions(mb, batch.samples))
    x = token_inputs(mb, batch.samples, lp_prev_all[at], None, torch.device("cpu"))
    return mb, at, x, per_token_loss(lp_all[at], x, CFG)


def test_the_loss_of_a_packed_micro_batch_is_the_loss_over_the_sampled_tokens_only():
    batch = _batch()
    rng = np.random.default_rng(0)
    total = sum(s.tokens.size for s in batch.samples)
    lp_np = -rng.uniform(0.1, 2.0, total)
    prev_np = lp_np + rng.normal(0, 0.2, total)  # pi_prev != pi_theta: the ratio and the clip matter
    lp_all = torch.tensor(lp_np, dtype=torch.float64, requires_grad=True)
    mb, at, x, (loss_t, parts) = _micro_batch_loss(batch, lp_all, torch.tensor(prev_np))

    n = sum(s.num_trained for s in batch.samples)
    assert loss_t.numel() == n == 14 and parts["is_weight"].numel() == n
    expect = []
    for seg, sl in zip(mb.segments, response_slices(mb, [s.prompt_len for s in batch.samples]), strict=True):
        smp = batch.samples[seg.index]
        keep = smp.loss_mask  # by hand: the response's positions, its sampled tokens only
        pos = np.arange(sl.start, sl.stop)[keep]
        expect.append(_hand_loss(lp_np[pos], prev_np[pos], smp.lp_gen[keep].astype(np.float64), smp.advantage, CFG))
    np.testing.assert_allclose(loss_t.detach().numpy(), np.concatenate(expect), rtol=1e-12)

    (loss_t.sum() / n).backward()
    grad = lp_all.grad
    assert grad is not None
    trained = torch.zeros(total, dtype=torch.bool)
    trained[at] = True
    assert torch.all(grad[~trained] == 0)  # environment tokens (and prompts) get no gradient
    assert torch.count_nonzero(grad[trained]) > 0

    stats = LossStats()
    stats.add(parts, float(loss_t.detach().sum() / n))
    assert stats.metrics()["num_valid_tokens"] == n


def test_what_environment_tokens_carry_changes_nothing_and_unmasking_them_does():
    batch = _batch()
    rng = np.random.default_rng(1)
    total = sum(s.tokens.size for s in batch.samples)
    lp_all = torch.tensor(-rng.uniform(0.1, 2.0, total))
    prev = lp_all + 0.1
    _, _, _, (base, _) = _micro_batch_loss(batch, lp_all, prev)
    for smp in batch.samples:  # junk log-probs at the environment tokens
        smp.lp_gen = np.where(smp.loss_mask, smp.lp_gen, np.float32(-7.5)).astype(np.float32)
    _, _, _, (junk, _) = _micro_batch_loss(batch, lp_all, prev)
    assert torch.equal(base, junk)
    for smp in batch.samples:  # train them after all: a different loss
        smp.loss_mask = np.ones_like(smp.loss_mask)
    _, _, _, (unmasked, _) = _micro_batch_loss(batch, lp_all, prev)
    assert unmasked.numel() == base.numel() + batch.env_tokens
    assert not torch.allclose(unmasked.sum(), base.sum())


@pytest.mark.parametrize("overlong", [False, True])
def test_overlong_filtering_judges_the_whole_sample(overlong):
    mask = np.array([1, 1, 0, 0, 1], np.uint8)
    g = TrajectoryGroup("g", "p", np.array([1, 2]), [
        _multi_turn(1.0, -np.ones(9), mask, "length"), _multi_turn(0.0, -np.ones(9), mask)], 2, 64)
    batch = collect([g], 64, False, TrainStepConfig(overlong_filtering=overlong))
    assert batch.length_finished == 1 and batch.overlong_filtered == int(overlong)
    assert len(batch.samples) == 2 - int(overlong) and batch.env_tokens == 2 * (2 - int(overlong))


def test_a_mask_of_another_length_is_refused_by_name():
    t = Trajectory(np.arange(20, 25), -np.ones(5), np.zeros(5), 1.0, loss_mask=np.ones(4, np.uint8))
    g = TrajectoryGroup("g7", "p", np.array([1, 2]), [t, Trajectory([4], [-1.0], [0], 0.0)], 2, 64)
    with pytest.raises(ValueError, match="group g7: trajectory 0 has 5 response ids, 5 log-probs and 4 loss-mask"):
        collect([g], 64, False, TrainStepConfig())
