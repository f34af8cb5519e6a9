"""Several optimizer steps per rollout batch on real Megatron-Core: one step is bit-identical to the
single-step path (pi_prev = the training forward, detached), two steps take pi_prev from a no-grad
forward of the whole batch so that the second step's ratio moves and the clip binds, and the loss
and clip fraction equal a hand computation from log-probs read between the steps."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner_batches import groups, make_learner

LR = 2e-2  # large: the first update moves the second step's ratios well outside [0.8, 1.28]


def _params(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.gpt.named_parameters()}


def _old_single_step(learner, batch) -> None:
    """The learner's step as it was before several optimizer steps per batch existed (EP = DP = 1)."""
    from learner.logprobs import response_slices, token_logprobs
    from learner.loss import per_token_loss

    samples = learner._collect(batch).samples
    mbs, _ = learner._pack([s.tokens for s in samples])
    lens = [s.prompt_len for s in samples]
    n = float(sum(sl.stop - sl.start for mb in mbs for sl in response_slices(mb, lens)))
    learner.model.train()
    learner.model.zero_grad_buffer()
    learner.optim.zero_grad()
    for mb in mbs:
        lp = token_logprobs(learner.model, mb)
        lp_resp = torch.cat([lp[s] for s in response_slices(mb, lens)])
        x = learner._token_inputs(mb, samples, lp_resp.detach(), None)
        loss_t, _ = per_token_loss(lp_resp, x, learner.loss_cfg)
        (loss_t.sum() / n).backward()
    learner.model.finish_grad_sync()
    applied, _ = learner.optim.step()
    assert applied


def test_one_optimizer_step_is_bit_identical_to_the_single_step_path(tiny_model_dir):
    from learner.config import TrainStepConfig

    new = make_learner(tiny_model_dir, lr=LR, step_config=TrainStepConfig(train_global_batch_size=8))
    old = make_learner(tiny_model_dir, lr=LR)
    try:
        batch = groups(new, num_groups=2, group_size=4)  # 8 trajectories: one optimizer step
        initial = _params(new)
        for _ in range(2):
            m = new.train_step(batch)
            _old_single_step(old, batch)
            assert m["optimizer_steps"] == 1 and m["prev_logprobs_s"] == 0
        a, b = _params(new), _params(old)
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert any(not torch.equal(a[k], v) for k, v in initial.items())
    finally:
        new.shutdown()
        old.shutdown()


def _hand_loss(lp_theta, lp_prev, lp_gen, adv, cfg):
    """Σ_t -w_t·min(ρA, clip(ρ)A) and the number of tokens where the clip binds, from numpy arrays."""
    rho = np.exp(lp_theta - lp_prev)
    w = np.minimum(np.exp(lp_prev - lp_gen), cfg.truncated_importance_sampling_ratio)
    clipped = np.clip(rho, 1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
    surrogate = np.minimum(rho * adv, clipped * adv)
    binds = ((adv > 0) & (rho > 1 + cfg.ratio_clip_max)) | ((adv < 0) & (rho < 1 - cfg.ratio_clip_min))
    return float((-w * surrogate).sum()), int(binds.sum())


def test_two_optimizer_steps_move_the_ratio_bind_the_clip_and_match_a_hand_computed_loss(tiny_model_dir):
    from learner.config import TrainStepConfig

    two = make_learner(tiny_model_dir, lr=LR, step_config=TrainStepConfig(train_global_batch_size=8))
    first_only = make_learner(tiny_model_dir, lr=LR)  # trains the first 8 trajectories alone
    try:
        batch = groups(two, num_groups=4, group_size=4, seed=5)  # 16 trajectories: 2 optimizer steps
        second = batch[2:]
        prompts = [g.prompt_ids for g in second for _ in g.trajectories]
        responses = [t.response_ids for g in second for t in g.trajectories]
        lp_prev = np.concatenate(two.logprobs(prompts, responses))  # the weights the batch starts from
        lp_prev1 = np.concatenate(two.logprobs([g.prompt_ids for g in batch[:2] for _ in g.trajectories],
                                               [t.response_ids for g in batch[:2] for t in g.trajectories]))
        first_only.train_step(batch[:2])
        lp_theta = np.concatenate(first_only.logprobs(prompts, responses))  # after the first update

        m = two.train_step(batch)
        assert m["optimizer_steps"] == 2 and m["skipped_optimizer_steps"] == 0 and m["step_skipped"] == 0
        assert two.policy_version == 1 and two.optim.scheduler.num_steps == 2  # +1 per batch, LR per step
        assert m["prev_logprobs_s"] > 0
        assert m["probs_ratio_max"] > 1.3 or m["probs_ratio_min"] < 0.7, m
        assert m["policy_kl_error"] > 1e-4 and m["clip_fraction"] > 0

        lp_gen = np.concatenate([t.logprobs for g in second for t in g.trajectories])
        samples = two._collect(batch).samples[8:]
        adv = np.concatenate([np.full(s.lp_gen.size, s.advantage) for s in samples])
        n2 = lp_gen.size
        n_total = m["num_valid_tokens"]
        loss2, binds2 = _hand_loss(lp_theta, lp_prev, lp_gen, adv, two.loss_cfg)
        # the first step runs on pi_prev's own weights: rho = 1, loss_t = -w·A
        first = batch[:2]
        lp_gen1 = np.concatenate([t.logprobs for g in first for t in g.trajectories])
        adv1 = np.concatenate([np.full(s.lp_gen.size, s.advantage) for s in two._collect(batch).samples[:8]])
        loss1, binds1 = _hand_loss(lp_prev1, lp_prev1, lp_gen1, adv1, two.loss_cfg)
        assert binds1 == 0
        assert n_total == n2 + adv1.size
        assert m["loss"] == pytest.approx((loss1 + loss2) / n_total, rel=2e-3, abs=1e-5)
        assert math.isclose(m["clip_fraction"] * n_total, binds2, abs_tol=2)  # only the second step can clip
        assert binds2 > 0
    finally:
        two.shutdown()
        first_only.shutdown()
