"""The NeMo-RL loss options against hand-computed values: dual clip (``ratio_clip_c``), the KL clamps and the
KL's score-function gradient, ``force_on_policy_ratio``, untruncated importance weights and
``truncated_importance_sampling_ratio_min``."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from learner.config import LossConfig
from learner.loss import LossStats, TokenInputs, importance_weights, per_token_loss


def _t(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


def _inputs(lp_prev, lp_gen, adv, lp_ref=None) -> TokenInputs:
    return TokenInputs(lp_prev=_t(lp_prev), lp_gen=_t(lp_gen), advantages=_t(adv),
                       lp_ref=None if lp_ref is None else _t(lp_ref))


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    cfg = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.2, ratio_clip_c=3.0, use_importance_sampling_correction=False)
    ratios = [5.0, 2.0, 5.0, 0.5]
    adv = [-1.0, -1.0, 1.0, -1.0]
    lp = torch.log(_t(ratios)).requires_grad_()
    loss, parts = per_token_loss(lp, _inputs([0.0] * 4, [0.0] * 4, adv), cfg)
    # token 0: min(-5, -1.2) = -5, dual max(-5, -3) = -3 -> loss 3; token 1: -2 above -3, unchanged -> 2;
    # token 2: A > 0, dual clip not applied: min(5, 1.2) -> -1.2; token 3: min(-0.5, -0.8) = -0.8 -> 0.8
    np.testing.assert_allclose(loss.detach().numpy(), [3.0, 2.0, -1.2, 0.8], rtol=1e-12)
    loss.sum().backward()
    assert lp.grad is not None
    # d(-rho·A)/d lp = -A·rho where the unclipped term is used, 0 where a clip (dual or not) binds
    np.testing.assert_allclose(lp.grad.numpy(), [0.0, 2.0, 0.0, 0.0], atol=1e-12)
    np.testing.assert_array_equal(parts["clipped"].numpy(), [1, 0, 1, 1])


def test_without_dual_clip_the_large_ratio_keeps_its_full_loss():
    cfg = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.2, use_importance_sampling_correction=False)
    loss, parts = per_token_loss(torch.log(_t([5.0])), _inputs([0.0], [0.0], [-1.0]), cfg)
    assert loss.item() == pytest.approx(5.0) and parts["clipped"].item() == 0


def _kl_only(lp_value: float, ref_value: float, **cfg_kw) -> tuple[float, float]:
    """Loss and its gradient of one token with A = 0 (only the KL term), penalty 0.1."""
    cfg = LossConfig(use_importance_sampling_correction=False, reference_policy_kl_penalty=0.1, **cfg_kw)
    lp = _t([lp_value]).requires_grad_()
    loss, _ = per_token_loss(lp, _inputs([lp_value], [lp_value], [0.0], [ref_value]), cfg)
    loss.sum().backward()
    assert lp.grad is not None
    return loss.item(), lp.grad.item()


def test_kl_gradient_carries_the_score_function_term():
    # d = lp_ref - lp = 2 (no clamp binds): value 0.1·(e^2 - 2 - 1); the gradient of s·k3 with s = exp(lp - sg(lp))
    # is k3 + dk3/dlp = (e^d - d - 1) + (1 - e^d) = -d, times 0.1
    value, grad = _kl_only(-3.0, -1.0)
    assert value == pytest.approx(0.1 * (math.exp(2) - 3))
    assert grad == pytest.approx(0.1 * -2.0)


def test_kl_output_clamp_caps_the_value_and_stops_the_gradient():
    value, grad = _kl_only(-4.0, -1.0)  # d = 3: e^3 - 4 = 16.09 > 10
    assert value == pytest.approx(0.1 * 10.0) and grad == 0.0
    value, grad = _kl_only(-4.0, -1.0, kl_output_clamp_value=None)
    assert value == pytest.approx(0.1 * (math.exp(3) - 4)) and grad == pytest.approx(0.1 * -3.0)


def test_kl_input_clamp_bounds_the_log_ratio_and_stops_the_gradient():
    value, grad = _kl_only(-30.0, -5.0, kl_output_clamp_value=None)  # d = 25 -> clamped to 20
    assert value == pytest.approx(0.1 * (math.exp(20) - 21)) and grad == 0.0
    value, grad = _kl_only(-30.0, -5.0, kl_input_clamp_value=None, kl_output_clamp_value=None)
    assert value == pytest.approx(0.1 * (math.exp(25) - 26)) and grad == pytest.approx(0.1 * -25.0)
    value, grad = _kl_only(-1.0, -26.0, kl_output_clamp_value=None)  # d = -25 -> -20: e^-20 + 20 - 1
    assert value == pytest.approx(0.1 * (math.exp(-20) + 19)) and grad == 0.0


def test_force_on_policy_ratio_uses_the_current_logprobs_as_prev():
    cfg = LossConfig(force_on_policy_ratio=True, truncated_importance_sampling_ratio=10.0)
    lp_values, lp_gen = [-1.0, -2.0], [-1.2, -2.5]
    lp = _t(lp_values).requires_grad_()
    x = _inputs([-1.5, -1.0], lp_gen, [1.0, -1.0])  # lp_prev is ignored
    loss, parts = per_token_loss(lp, x, cfg)
    w = [math.exp(0.2), math.exp(0.5)]  # pi_theta / pi_gen
    np.testing.assert_allclose(loss.detach().numpy(), [-w[0], w[1]], rtol=1e-12)
    loss.sum().backward()
    assert lp.grad is not None
    np.testing.assert_allclose(lp.grad.numpy(), [-w[0], w[1]], rtol=1e-12)  # d rho / d lp = rho = 1
    assert parts["ratio"].tolist() == [1.0, 1.0] and parts["policy_kl"].tolist() == [0.0, 0.0]
    np.testing.assert_allclose(parts["is_weight"].numpy(), w, rtol=1e-12)
    stats = LossStats()
    stats.add(parts, 0.0)
    assert stats.metrics()["gen_kl_error"] == pytest.approx(np.mean([math.exp(d) - d - 1 for d in (0.2, 0.5)]))


def test_untruncated_importance_weights():
    cfg = LossConfig(truncated_importance_sampling_ratio=None)
    lp_prev = _t([0.0, 0.0, 0.0])
    lp_gen = _t([math.log(0.1), 0.0, math.log(50.0)])  # ratios 10, 1, 0.02: none truncated
    np.testing.assert_allclose(importance_weights(lp_prev, lp_gen, cfg).numpy(), [10.0, 1.0, 0.02])
    truncated = LossConfig(truncated_importance_sampling_ratio=2.0)
    np.testing.assert_allclose(importance_weights(lp_prev, lp_gen, truncated).numpy(), [2.0, 1.0, 0.02])


def test_truncation_lower_bound_for_tis_and_icepop():
    ratios = [0.25, 0.5, 1.0, 2.0, 4.0]
    lp_prev = torch.zeros(5, dtype=torch.float64)
    lp_gen = -torch.log(_t(ratios))
    tis = LossConfig(truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=0.5)
    np.testing.assert_allclose(importance_weights(lp_prev, lp_gen, tis).numpy(), [0.5, 0.5, 1.0, 2.0, 2.0])
    icepop = LossConfig(truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=0.3,
                        truncated_importance_sampling_type="icepop")
    np.testing.assert_allclose(importance_weights(lp_prev, lp_gen, icepop).numpy(), [0.0, 0.5, 1.0, 2.0, 0.0])


@pytest.mark.parametrize(("kw", "match"), [
    ({"truncated_importance_sampling_ratio": 2.0, "truncated_importance_sampling_ratio_min": 3.0},
     r"truncated_importance_sampling_ratio_min \(3.0\) must be <= truncated_importance_sampling_ratio \(2.0\)"),
    ({"truncated_importance_sampling_ratio": None, "truncated_importance_sampling_ratio_min": 0.5},
     r"truncated_importance_sampling_ratio_min \(0.5\) needs truncated_importance_sampling_ratio"),
    ({"ratio_clip_c": 1.0}, r"(?s)ratio_clip_c.*greater than 1"),
    ({"kl_input_clamp_value": 0.0}, r"(?s)kl_input_clamp_value.*greater than 0"),
])
def test_bad_loss_options_are_refused(kw, match):
    with pytest.raises(ValidationError, match=match):
        LossConfig(**kw)
