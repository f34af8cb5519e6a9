"""Training steps on real Megatron-Core: the loss goes down, a non-finite step is skipped untouched,
on-policy metrics are neutral, failed samples are excluded."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from learner_batches import groups, make_learner
from protocol.messages import Trajectory


def _params(learner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.gpt.named_parameters()}


@pytest.fixture
def learner(tiny_model_dir):
    lrn = make_learner(tiny_model_dir, lr=3e-3)
    yield lrn
    lrn.shutdown()


def test_on_policy_step_metrics_and_loss_goes_down(learner):
    batch = groups(learner, num_groups=3, group_size=4)
    first = learner.train_step(batch)
    assert first["step_skipped"] == 0 and learner.policy_version == 1 and learner.step == 1
    assert first["gen_kl_error"] < 1e-6 and first["policy_kl_error"] == 0
    assert first["probs_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
    assert first["num_valid_tokens"] == sum(t.response_ids.size for g in batch for t in g.trajectories)
    assert first["reward_mean"] == pytest.approx(0.5) and first["zero_advantage_groups"] == 0
    assert 0 < first["fill_ratio"] <= 1 and first["tokens_per_s"] > 0 and first["grad_norm"] > 0
    losses = [first["loss"]] + [learner.train_step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 1e-3, losses
    assert learner.policy_version == 5


def test_positive_advantage_responses_become_more_likely(learner):
    batch = groups(learner, num_groups=2, group_size=4, seed=3)
    pos = [(g.prompt_ids, t.response_ids) for g in batch for t in g.trajectories if t.reward == 1.0]
    before = [lp.sum() for lp in learner.logprobs(*zip(*pos))]
    for _ in range(3):
        learner.train_step(batch)
    after = [lp.sum() for lp in learner.logprobs(*zip(*pos))]
    assert np.mean(after) > np.mean(before)


def test_non_finite_step_is_skipped_and_leaves_everything_untouched(learner):
    batch = groups(learner, num_groups=2, group_size=4)
    learner.train_step(batch)  # give the optimizer a state to protect
    before, opt_before = _params(learner), learner.optim.inner_state()
    poisoned = groups(learner, num_groups=2, group_size=4)
    poisoned[0].trajectories[1].logprobs[2] = np.nan  # poisons w, the loss and every gradient
    m = learner.train_step(poisoned)
    assert m["step_skipped"] == 1 and m["nonfinite_loss"] == 1
    assert "non-finite" in learner.last_skip_reason
    assert learner.policy_version == 1 and learner.step == 2
    after, opt_after = _params(learner), learner.optim.inner_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for o_before, o_after in zip(opt_before["optimizers"], opt_after["optimizers"]):
        assert all(torch.equal(a, b) for a, b in zip(o_before["params"], o_after["params"]))
        for pid, st in o_before["torch_state"]["state"].items():
            for key, val in st.items():
                assert torch.equal(val, o_after["torch_state"]["state"][pid][key])
    assert learner.train_step(batch)["step_skipped"] == 0 and learner.policy_version == 2


def test_failed_samples_are_excluded_and_equal_reward_groups_counted(learner):
    batch = groups(learner, num_groups=2, group_size=4)
    bad = batch[0].trajectories[0]
    batch[0].trajectories[0] = Trajectory(bad.response_ids, bad.logprobs, bad.versions, None, "error", "reward failed")
    for t in batch[1].trajectories:
        t.reward = 0.25
    m = learner.train_step(batch)
    assert m["failed_samples"] == 1 and m["zero_advantage_groups"] == 1
    valid = [t for g in batch for t in g.trajectories if t.ok]
    assert m["num_valid_tokens"] == sum(t.response_ids.size for t in valid)
    assert m["reward_mean"] == pytest.approx(np.mean([t.reward for t in valid]))
