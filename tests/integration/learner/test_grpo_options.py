"""GRPO options and batch statistics of a learner step on real Megatron-Core: the leave-one-out
baseline, overlong filtering (truncated samples keep their reward in the baseline, add no token),
the policy's token entropy against transformers, and the reward / response-length statistics."""
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
