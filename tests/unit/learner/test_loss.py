"""GRPO advantages, clipped surrogate, importance weights and metrics against hand-computed values."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.config import LossConfig
from learner.loss import LossStats, TokenInputs, group_advantages, importance_weights, k3, per_token_loss


def test_advantages_are_normalised_by_sample_std():
    adv, zero = group_advantages([1.0, 0.0, 0.0, 1.0], normalize=True)
    std = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    np.testing.assert_allclose(adv, np.array([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6), rtol=1e-6)
    assert not zero


def test_advantages_without_std_division():
    adv, _ = group_advantages([3.0, 1.0], normalize=False)
    np.testing.assert_allclose(adv, [1.0, -1.0])


@pytest.mark.parametrize("rewards", [[0.5, 0.5, 0.5], [1.0]])
def test_all_equal_rewards_give_zero_advantage(rewards):
    adv, zero = group_advantages(rewards, normalize=True)
    assert zero and np.all(adv == 0) and adv.size == len(rewards)


def _inputs(lp_prev, lp_gen, adv):
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return TokenInputs(lp_prev=t(lp_prev), lp_gen=t(lp_gen), advantages=t(adv))


def test_clipping_on_both_sides():
    cfg = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.28, use_importance_sampling_correction=False)
    ratios = [1.5, 1.5, 0.5, 0.5, 1.1]
    adv = [1.0, -1.0, 1.0, -1.0, 2.0]
    lp = torch.log(torch.tensor(ratios, dtype=torch.float64))
    loss, parts = per_token_loss(lp, _inputs([0.0] * 5, [0.0] * 5, adv), cfg)
    # A>0, rho>1+eh: clipped at 1.28; A<0, rho>1: unclipped 1.5 (min picks the worse);
    # A>0, rho<1-el: unclipped 0.5; A<0, rho<1-el: clipped 0.8; inside the range: rho.
    expected = [-1.28, 1.5, -0.5, 0.8, -2.2]
    np.testing.assert_allclose(loss.numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(parts["ratio"].numpy(), ratios, rtol=1e-12)


def test_clipped_tokens_have_no_gradient():
    cfg = LossConfig(use_importance_sampling_correction=False)
    lp = torch.log(torch.tensor([1.5, 1.1], dtype=torch.float64)).requires_grad_()
    loss, _ = per_token_loss(lp, _inputs([0.0, 0.0], [0.0, 0.0], [1.0, 1.0]), cfg)
    loss.sum().backward()
    assert lp.grad[0] == 0 and lp.grad[1] == pytest.approx(-1.1)


def test_tis_truncates_the_importance_weight():
    cfg = LossConfig(truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_type="tis")
    lp_prev = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    lp_gen = torch.log(torch.tensor([0.25, 1.0, 4.0], dtype=torch.float64))  # ratios 4, 1, 0.25
    np.testing.assert_allclose(importance_weights(lp_prev, lp_gen, cfg).numpy(), [2.0, 1.0, 0.25])


def test_icepop_zeroes_weights_outside_the_band():
    cfg = LossConfig(truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_type="icepop")
    lp_prev = torch.zeros(4, dtype=torch.float64)
    lp_gen = torch.log(torch.tensor([0.25, 0.6, 1.9, 4.0], dtype=torch.float64))  # ratios 4, 1.67, 0.53, 0.25
    np.testing.assert_allclose(importance_weights(lp_prev, lp_gen, cfg).numpy(), [0.0, 1 / 0.6, 1 / 1.9, 0.0])


def test_importance_weight_multiplies_the_surrogate_and_is_constant():
    cfg = LossConfig(truncated_importance_sampling_ratio=5.0)
    lp = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    x = _inputs([0.0], [math.log(0.5)], [1.0])  # w = 2
    loss, parts = per_token_loss(lp, x, cfg)
    assert loss.item() == pytest.approx(-2.0)
    loss.sum().backward()
    assert lp.grad.item() == pytest.approx(-2.0)  # d/dlp of -w*exp(lp)*A, w constant
    assert parts["is_weight"].item() == pytest.approx(2.0)


def test_reference_kl_is_k3_of_policy_to_reference():
    cfg = LossConfig(use_importance_sampling_correction=False, reference_policy_kl_penalty=0.1)
    lp = torch.tensor([-1.0], dtype=torch.float64)
    x = TokenInputs(lp_prev=lp.clone(), lp_gen=lp.clone(), advantages=torch.zeros(1, dtype=torch.float64),
                    lp_ref=torch.tensor([-1.5], dtype=torch.float64))
    loss, _ = per_token_loss(lp, x, cfg)
    d = -0.5
    assert loss.item() == pytest.approx(0.1 * (math.exp(d) - d - 1))


def test_reference_kl_without_reference_logprobs_is_an_error():
    cfg = LossConfig(reference_policy_kl_penalty=0.1)
    with pytest.raises(ValueError, match="lp_ref"):
        per_token_loss(torch.zeros(1), _inputs([0.0], [0.0], [1.0]), cfg)


def test_on_policy_metrics_are_neutral():
    cfg = LossConfig()
    lp = torch.tensor([-0.3, -2.0, -1.1], dtype=torch.float64)
    _, parts = per_token_loss(lp, _inputs(lp.tolist(), lp.tolist(), [1.0, -1.0, 0.5]), cfg)
    stats = LossStats()
    stats.add(parts, 0.0)
    m = stats.metrics()
    assert m["gen_kl_error"] == 0 and m["policy_kl_error"] == 0
    assert m["probs_ratio_mean"] == 1 and m["probs_ratio_min"] == 1 and m["probs_ratio_max"] == 1
    assert m["token_mult_prob_error"] == 1 and m["is_weight_mean"] == 1
    assert m["num_valid_tokens"] == 3


def test_metric_definitions_off_policy():
    cfg = LossConfig(truncated_importance_sampling_ratio=10.0)
    lp_prev, lp_gen = [-1.0, -2.0], [-1.5, -1.0]
    _, parts = per_token_loss(torch.tensor(lp_prev, dtype=torch.float64), _inputs(lp_prev, lp_gen, [1.0, 1.0]), cfg)
    stats = LossStats()
    stats.add(parts, 0.0)
    m = stats.metrics()
    gen_kl = np.mean([k3(torch.tensor(g), torch.tensor(p)).item() for p, g in zip(lp_prev, lp_gen)])
    assert m["gen_kl_error"] == pytest.approx(gen_kl)
    assert m["gen_kl_error"] == pytest.approx(np.mean([math.exp(0.5) - 0.5 - 1, math.exp(-1) + 1 - 1]))
    assert m["token_mult_prob_error"] == pytest.approx(np.mean([math.exp(0.5), math.exp(1.0)]))
    assert m["is_weight_max"] == pytest.approx(math.exp(0.5))


def test_global_token_normalisation_is_not_a_mean_of_micro_batch_means():
    """Two micro-batches of 1 and 3 tokens: the step loss is the mean over all 4 tokens."""
    cfg = LossConfig(use_importance_sampling_correction=False)
    a = _inputs([0.0], [0.0], [4.0])
    b = _inputs([0.0] * 3, [0.0] * 3, [0.0, 0.0, 0.0])
    n_global = 4
    stats = LossStats()
    for x in (a, b):
        loss, parts = per_token_loss(torch.zeros(len(x.advantages), dtype=torch.float64), x, cfg)
        stats.add(parts, float(loss.sum() / n_global))
    assert stats.metrics()["loss"] == pytest.approx(-1.0)  # mean of micro-batch means would be -2
    assert stats.metrics()["num_valid_tokens"] == 4


def test_leave_one_out_advantages_against_a_hand_computation():
    r = [1.0, 0.0, 0.0, 2.0]
    adv, zero = group_advantages(r, normalize=False, leave_one_out=True)
    # baseline_i = mean of the other three rewards
    np.testing.assert_allclose(adv, [1 - 2 / 3, 0 - 1.0, 0 - 1.0, 2 - 1 / 3], rtol=1e-6)
    assert not zero
    adv_n, _ = group_advantages(r, normalize=True, leave_one_out=True)
    others = [[0.0, 0.0, 2.0], [1.0, 0.0, 2.0], [1.0, 0.0, 2.0], [1.0, 0.0, 0.0]]
    # the others' sample std (Bessel; NeMo-RL's num_valid / (num_valid - 1) since its #1423)
    expected = [(ri - np.mean(o)) / (np.std(o, ddof=1) + 1e-6) for ri, o in zip(r, others, strict=True)]
    np.testing.assert_allclose(adv_n, expected, rtol=1e-6)
    # by hand for sample 0: others [0, 0, 2], mean 2/3, sample variance ((4/9)·2 + 16/9) / 2 = 4/3
    assert adv_n[0] == pytest.approx((1 - 2 / 3) / (math.sqrt(4 / 3) + 1e-6), rel=1e-6)


def test_leave_one_out_with_equal_others_is_not_divided_and_equal_groups_stay_zero():
    adv, _ = group_advantages([1.0, 0.0, 0.0], normalize=True, leave_one_out=True)
    # sample 0's others are [0, 0] (std 0): its advantage stays 1 - 0; the others see [1, 0] (sample std √½)
    s = math.sqrt(0.5)
    np.testing.assert_allclose(adv, [1.0, -0.5 / (s + 1e-6), -0.5 / (s + 1e-6)], rtol=1e-6)
    adv, _ = group_advantages([1.0, 0.0], normalize=True, leave_one_out=True)
    np.testing.assert_allclose(adv, [1.0, -1.0])  # n = 2: one other sample, no std, not divided
    adv, zero = group_advantages([0.7, 0.7, 0.7], normalize=True, leave_one_out=True)
    assert zero and np.all(adv == 0)


def test_clip_fraction_counts_the_tokens_where_the_clip_binds():
    cfg = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.28, use_importance_sampling_correction=False)
    ratios = [1.5, 1.5, 0.5, 0.5, 1.1, 1.5]
    adv = [1.0, -1.0, 1.0, -1.0, 2.0, 0.0]
    lp = torch.log(torch.tensor(ratios, dtype=torch.float64))
    _, parts = per_token_loss(lp, _inputs([0.0] * 6, [0.0] * 6, adv), cfg)
    # binds: A>0 & rho>1.28 (token 0), A<0 & rho<0.8 (token 3); not where min picks the unclipped term or A=0
    np.testing.assert_array_equal(parts["clipped"].numpy(), [1, 0, 0, 1, 0, 0])
    stats = LossStats()
    stats.add(parts, 0.0)
    assert stats.metrics()["clip_fraction"] == pytest.approx(2 / 6)


def test_clipped_surrogate_with_weights_and_global_normalisation_by_hand():
    """Two micro-batches of 2 and 1 tokens, off-policy, tis c = 1.5: loss = Σ_t -w_t·min(ρA, clip(ρ)A) / 3."""
    cfg = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.2, truncated_importance_sampling_ratio=1.5)
    lp_theta = [[-1.0, -0.5], [-2.0]]
    lp_prev = [[-1.2, -0.2], [-2.0]]
    lp_gen = [[-1.0, -1.0], [-2.5]]
    adv = [[1.0, -2.0], [0.5]]
    expected = 0.0
    for mb in range(2):
        for th, pr, ge, a in zip(lp_theta[mb], lp_prev[mb], lp_gen[mb], adv[mb]):
            rho, w = math.exp(th - pr), min(math.exp(pr - ge), 1.5)
            expected += -w * min(rho * a, min(max(rho, 0.8), 1.2) * a) / 3
    stats = LossStats()
    for mb in range(2):
        x = _inputs(lp_prev[mb], lp_gen[mb], adv[mb])
        loss, parts = per_token_loss(torch.tensor(lp_theta[mb], dtype=torch.float64), x, cfg)
        stats.add(parts, float(loss.sum() / 3))
    # token 0: rho = e^0.2 = 1.22 > 1.2 with A > 0 -> clipped at 1.2; token 1: rho = e^-0.3 = 0.74 with A < 0
    assert stats.metrics()["loss"] == pytest.approx(expected, rel=1e-12)
    # w: e^-0.2, min(e^0.8, 1.5) = 1.5, min(e^0.5, 1.5) = 1.5
    assert expected == pytest.approx((-math.exp(-0.2) * 1.2 * 1.0 - 1.5 * 0.8 * -2.0 - 1.5 * 1.0 * 0.5) / 3)
    assert stats.metrics()["clip_fraction"] == pytest.approx(2 / 3)
