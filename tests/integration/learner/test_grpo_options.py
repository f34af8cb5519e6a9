"""GRPO options and batch statistics of a learner step on real Megatron-Core: the leave-one-out
baseline, overlong filtering (truncated samples keep their reward in the baseline, add no token),
the policy's token entropy against transformers, and the reward / response-length statistics; NeMo-RL's
reward scaling and shaping, ``force_on_policy_ratio``, the dual clip and the KL clamps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner_batches import groups, load_hf, make_learner
from protocol.messages import Trajectory


def test_leave_one_out_advantages_reach_the_samples(tiny_model_dir):
    from learner.config import TrainStepConfig

    learner = make_learner(tiny_model_dir, step_config=TrainStepConfig(use_leave_one_out_baseline=True),
                           normalize_rewards=False)
    try:
        batch = groups(learner, num_groups=1, group_size=4)
        for t, r in zip(batch[0].trajectories, [1.0, 0.0, 0.0, 3.0]):
            t.reward = r
        advantages = [s.advantage for s in learner._collect(batch).samples]
        np.testing.assert_allclose(advantages, [1 - 1.0, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3], rtol=1e-6)
        assert learner.train_step(batch)["step_skipped"] == 0
    finally:
        learner.shutdown()


def _with_reason(t: Trajectory, reason: str) -> Trajectory:
    return Trajectory(t.response_ids, t.logprobs, t.versions, t.reward, reason)


def test_overlong_filtering_removes_exactly_the_truncated_samples_tokens(tiny_model_dir):
    from learner.config import TrainStepConfig

    learner = make_learner(tiny_model_dir, step_config=TrainStepConfig(overlong_filtering=True))
    plain = make_learner(tiny_model_dir)
    try:
        batch = groups(learner, num_groups=2, group_size=4)
        for g, i in ((0, 1), (1, 0), (1, 3)):
            batch[g].trajectories[i] = _with_reason(batch[g].trajectories[i], "length")
        kept = [t for g in batch for t in g.trajectories if t.finish_reason != "length"]
        m = learner.train_step(batch)
        assert m["overlong_filtered_samples"] == 3 and m["truncation_rate"] == pytest.approx(3 / 8)
        assert m["num_valid_tokens"] == sum(t.response_ids.size for t in kept)
        # the filtered samples' rewards stay in their group's baseline: same advantages as without filtering
        unfiltered = {s.position: s.advantage for s in plain._collect(batch).samples}
        filtered = learner._collect(batch).samples
        assert sorted(s.position for s in filtered) == [0, 2, 3, 5, 6]
        assert all(s.advantage == unfiltered[s.position] for s in filtered)
        m_plain = plain.train_step(batch)
        assert m_plain["overlong_filtered_samples"] == 0 and m_plain["truncation_rate"] == pytest.approx(3 / 8)
        assert m_plain["num_valid_tokens"] == sum(t.response_ids.size for g in batch for t in g.trajectories)
    finally:
        learner.shutdown()
        plain.shutdown()


def test_token_entropy_and_batch_statistics(tiny_model_dir):
    learner = make_learner(tiny_model_dir)
    try:
        batch = groups(learner, num_groups=2, group_size=4, seed=2)
        for t, r in zip(batch[1].trajectories, [0.25, 0.5, 2.0, 0.0]):
            t.reward = r
        hf = load_hf(tiny_model_dir)
        entropies = []
        with torch.no_grad():
            for g in batch:
                for t in g.trajectories:
                    ids = torch.tensor(np.concatenate([g.prompt_ids, t.response_ids]), dtype=torch.long)[None]
                    logp = hf(ids).logits.float().log_softmax(-1)[0, len(g.prompt_ids) - 1:-1]
                    entropies.append(-(logp.exp() * logp).sum(-1).numpy())
        m = learner.train_step(batch)  # the entropy is that of the step's forward, before the update
        assert m["token_entropy_mean"] == pytest.approx(float(np.concatenate(entropies).mean()), rel=1e-4)
        rewards = np.array([t.reward for g in batch for t in g.trajectories])
        lengths = np.array([t.response_ids.size for g in batch for t in g.trajectories], dtype=float)
        assert (m["reward_min"], m["reward_max"]) == (0.0, 2.0)
        assert m["reward_std"] == pytest.approx(rewards.std()) and m["reward_mean"] == pytest.approx(rewards.mean())
        assert m["response_length_mean"] == pytest.approx(lengths.mean())
        assert m["response_length_std"] == pytest.approx(lengths.std())
        assert (m["response_length_min"], m["response_length_max"]) == (lengths.min(), lengths.max())
        assert m["truncation_rate"] == 0 and m["optimizer_steps"] == 1
    finally:
        learner.shutdown()


# ---------------------------------------------------------------- NeMo-RL's reward and loss options

LR = 2e-2  # large: the first update moves the second optimizer step's ratios well away from 1


def _params(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.gpt.named_parameters()}


def test_reward_scaling_and_shaping_reach_the_advantages_and_the_metrics(tiny_model_dir):
    from learner.config import RewardScalingConfig, RewardShapingConfig, TrainStepConfig

    step = TrainStepConfig(reward_scaling=RewardScalingConfig(enabled=True, target_min=-1.0),
                           reward_shaping=RewardShapingConfig(enabled=True, overlong_buffer_length=4,
                                                              overlong_buffer_penalty=1.0, max_response_length=12))
    learner = make_learner(tiny_model_dir, step_config=step)
    try:
        batch = groups(learner, num_groups=1, group_size=4)
        for t, r in zip(batch[0].trajectories, [1.0, 1.0, 0.0, 0.0], strict=True):
            t.reward = r
        lengths = np.array([t.response_ids.size for t in batch[0].trajectories], dtype=float)
        assert (lengths > 8).any() and (lengths <= 8).any()  # the penalty starts past 12 - 4 tokens
        shaped = np.array([1.0, 1.0, -1.0, -1.0]) + np.minimum(0.0, -(lengths - 8) / 4)
        expected = (shaped - shaped.mean()) / (shaped.std(ddof=1) + 1e-6)
        np.testing.assert_allclose([s.advantage for s in learner._collect(batch).samples], expected, rtol=1e-6)
        m = learner.train_step(batch)
        assert m["reward_mean"] == pytest.approx(0.5) and m["reward_min"] == 0.0  # raw
        assert m["shaped_reward_mean"] == pytest.approx(shaped.mean()) and m["shaped_reward_min"] == shaped.min()
        assert m["step_skipped"] == 0
    finally:
        learner.shutdown()


def test_force_on_policy_ratio_is_the_single_step_update_and_refuses_two_steps(tiny_model_dir):
    from learner.config import LossConfig, TrainStepConfig

    forced = make_learner(tiny_model_dir, loss=LossConfig(force_on_policy_ratio=True,
                                                          truncated_importance_sampling_ratio=None))
    plain = make_learner(tiny_model_dir, loss=LossConfig(truncated_importance_sampling_ratio=None))
    try:
        batch = groups(plain, num_groups=2, group_size=4, seed=3)
        rng = np.random.default_rng(0)
        for g in batch:  # off-policy: the engine's log-probs differ, so the weights are not 1
            for t in g.trajectories:
                t.logprobs = (t.logprobs + rng.normal(0.0, 0.2, t.logprobs.size)).astype(np.float32)
        m_forced, m_plain = forced.train_step(batch), plain.train_step(batch)
        for key in ("loss", "is_weight_mean", "is_weight_max", "gen_kl_error", "grad_norm"):
            assert m_forced[key] == m_plain[key], key
        assert m_forced["is_weight_max"] > 1.2 and m_forced["probs_ratio_min"] == m_forced["probs_ratio_max"] == 1.0
        a, b = _params(forced), _params(plain)
        assert all(torch.equal(a[k], b[k]) for k in a)
        forced.step_cfg = TrainStepConfig(train_global_batch_size=4)
        with pytest.raises(ValueError, match=r"force_on_policy_ratio needs one optimizer step per rollout batch, "
                                             r"got 2 \(policy.train_global_batch_size=4\)"):
            forced.train_step(batch)
        assert all(torch.equal(v, b[k]) for k, v in _params(forced).items())  # refused before any update
    finally:
        forced.shutdown()
        plain.shutdown()


def _dual_clip_loss(lp_theta, lp_prev, lp_gen, adv, cfg) -> tuple[float, int]:
    """Σ_t -w_t·surrogate_t with the dual clip, and the tokens where the dual clip binds, from numpy arrays."""
    rho = np.exp(lp_theta - lp_prev)
    w = np.minimum(np.exp(lp_prev - lp_gen), cfg.truncated_importance_sampling_ratio)
    surrogate = np.minimum(rho * adv, np.clip(rho, 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max) * adv)
    surrogate = np.where(adv < 0, np.maximum(surrogate, cfg.ratio_clip_c * adv), surrogate)
    return float((-w * surrogate).sum()), int(((adv < 0) & (rho > cfg.ratio_clip_c)).sum())


def test_dual_clip_binds_on_the_second_optimizer_step_as_computed_by_hand(tiny_model_dir):
    from learner.config import LossConfig, TrainStepConfig

    cfg = LossConfig(ratio_clip_c=1.05)
    two = make_learner(tiny_model_dir, lr=LR, loss=cfg, step_config=TrainStepConfig(train_global_batch_size=8))
    first_only = make_learner(tiny_model_dir, lr=LR, loss=cfg)
    try:
        batch = groups(two, num_groups=4, group_size=4, seed=5)  # 16 trajectories: 2 optimizer steps
        first, second = batch[:2], batch[2:]

        def lps(learner, part):
            return np.concatenate(learner.logprobs([g.prompt_ids for g in part for _ in g.trajectories],
                                                   [t.response_ids for g in part for t in g.trajectories]))

        lp_prev1, lp_prev2 = lps(two, first), lps(two, second)
        first_only.train_step(first)
        lp_theta2 = lps(first_only, second)  # the weights the second optimizer step trains
        m = two.train_step(batch)
        assert m["optimizer_steps"] == 2

        samples = two._collect(batch).samples
        adv = [np.concatenate([np.full(s.lp_gen.size, s.advantage) for s in part])
               for part in (samples[:8], samples[8:])]
        lp_gen = [np.concatenate([t.logprobs for g in part for t in g.trajectories]) for part in (first, second)]
        loss1, dual1 = _dual_clip_loss(lp_prev1, lp_prev1, lp_gen[0], adv[0], cfg)
        loss2, dual2 = _dual_clip_loss(lp_theta2, lp_prev2, lp_gen[1], adv[1], cfg)
        assert dual1 == 0 and dual2 > 0  # the ratio is 1 at the first step; the dual clip binds at the second
        assert m["loss"] == pytest.approx((loss1 + loss2) / m["num_valid_tokens"], rel=2e-3, abs=1e-5)
    finally:
        two.shutdown()
        first_only.shutdown()


def test_a_binding_kl_clamp_leaves_no_kl_gradient(tiny_model_dir):
    from learner.config import LossConfig, TrainStepConfig

    step = TrainStepConfig(train_global_batch_size=8)
    none = make_learner(tiny_model_dir, lr=LR, step_config=step)
    clamped = make_learner(tiny_model_dir, lr=LR, step_config=step,
                           loss=LossConfig(reference_policy_kl_penalty=0.5, kl_output_clamp_value=1e-12))
    free = make_learner(tiny_model_dir, lr=LR, step_config=step,
                        loss=LossConfig(reference_policy_kl_penalty=0.5, kl_output_clamp_value=None))
    try:
        batch = groups(none, num_groups=4, group_size=4, seed=5)  # 2 optimizer steps: the KL is > 0 at the second
        for learner in (none, clamped, free):
            assert learner.train_step(batch)["optimizer_steps"] == 2
        p_none, p_clamped, p_free = _params(none), _params(clamped), _params(free)
        for k, v in p_none.items():
            torch.testing.assert_close(p_clamped[k], v, rtol=1e-5, atol=1e-7)
        assert max(float((p_free[k] - v).abs().max()) for k, v in p_none.items()) > 1e-5
    finally:
        for learner in (none, clamped, free):
            learner.shutdown()


def test_a_sequence_over_the_logprob_error_threshold_is_masked_counted_and_out_of_n(tiny_model_dir):
    """Issue 37 item 2: ``grpo.seq_logprob_error_threshold`` on real Megatron-Core. One sequence whose engine
    log-probs are 1 nat off (mean exp|d| = e > 1.5) is rejected with its reason; the step equals one where that
    sample is kept out of the loss by overlong filtering (its reward in the baseline, its tokens out of N)."""
    from learner.config import TrainStepConfig

    masking = make_learner(tiny_model_dir, lr=LR, step_config=TrainStepConfig(seq_logprob_error_threshold=1.5))
    reference = make_learner(tiny_model_dir, lr=LR, step_config=TrainStepConfig(overlong_filtering=True))
    try:
        batch = groups(masking, num_groups=2, group_size=4, seed=7)
        bad = batch[1].trajectories[2]
        bad.logprobs = (bad.logprobs - 1.0).astype(np.float32)
        batch[0].engine_id, batch[1].engine_id = "e0", "e1"
        m = masking.train_step(batch)
        assert (m["seq_masked_logprob_error"], m["seq_masked"], m["seq_masked_geo_rs"]) == (1.0, 1.0, 0.0)
        assert m["seq_masked_share"] == pytest.approx(1 / 8) and m["step_skipped"] == 0
        total = sum(t.response_ids.size for g in batch for t in g.trajectories)
        assert m["num_valid_tokens"] == total - bad.response_ids.size
        batch[1].trajectories[2] = _with_reason(bad, "length")
        m_ref = reference.train_step(batch)
        assert m_ref["num_valid_tokens"] == m["num_valid_tokens"]
        # equal up to float32 rounding: the rejected sequence still sits in a packed row here (context of nothing),
        # the reference packs without it, and pi_prev comes from a separate no-grad forward (weights are not
        # compared: Adam's first update, lr·g/|g|, turns rounding in near-zero gradients into full steps)
        for key in ("loss", "gen_kl_error", "token_mult_prob_error", "grad_norm"):
            assert m[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-7), key
        _check_mismatch_stats(m, m_ref)
    finally:
        masking.shutdown()
        reference.shutdown()


def _check_mismatch_stats(m: dict, m_ref: dict) -> None:
    """Issue 37 item 3 on the same steps: the masking learner measures all 8 sequences before its filter (the
    rejected one, 1 nat off, included; groups came from engines ``e0`` / ``e1``, all at age 0), the reference
    measures its 7 trained ones in the training forward (all on-policy)."""
    p, hist = "logprob_mismatch", [k for k in m if k.startswith("logprob_mismatch_hist_le_")]
    assert (m[f"{p}_sequences"], m[f"{p}_threshold"], m[f"{p}_sequences_age_0"]) == (8, 1.5, 8)
    assert m[f"{p}_over_threshold_share"] == pytest.approx(1 / 8)
    assert m[f"{p}_over_threshold_share_engine_e1"] == pytest.approx(1 / 4)
    assert m[f"{p}_over_threshold_share_engine_e0"] == 0 and m[f"{p}_sequences_engine_e0"] == 4
    assert m[f"{p}_max"] == pytest.approx(1.0, abs=1e-4) and m[f"{p}_token_max"] == pytest.approx(1.0, abs=1e-4)
    assert m[f"{p}_mean"] == pytest.approx(1 / 8, abs=1e-4)
    assert m[f"{p}_hist_le_1"] + m[f"{p}_hist_le_inf"] == 1  # 1 nat off, give or take float32 rounding
    assert len(hist) == 7 and sum(m[k] for k in hist) == 8
    assert (m_ref[f"{p}_sequences"], m_ref[f"{p}_over_threshold_share"], m_ref[f"{p}_threshold"]) == (7, 0.0, 2.0)
    assert m_ref[f"{p}_max"] < 1e-4 and m_ref[f"{p}_hist_le_1e-05"] + m_ref[f"{p}_hist_le_0.0001"] == 7
    # consistent with token_mult_prob_error = mean_t exp|d_t|: on-policy tokens give exp(~0) = 1
    assert m_ref["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-4)
