"""The learning-rate schedule of a recipe on real Megatron-Core: a decaying schedule without
``lr_decay_steps`` decays over ``grpo.max_num_steps`` (it used to stop the learner at start), times the
optimizer steps per rollout batch with ``policy.train_global_batch_size``."""
from __future__ import annotations

import pytest

from learner_batches import groups
from services.recipe.config import load_recipe


def test_linear_decay_without_decay_steps_reaches_min_lr_at_the_last_step(tiny_model_dir):
    from learner.config import LossConfig, SequencePackingConfig
    from learner.trainer import Learner

    recipe = load_recipe(None, ["grpo.max_num_steps=4", "policy.megatron_cfg.optimizer.lr_decay_style=linear",
                                "policy.megatron_cfg.optimizer.lr=1e-3", "policy.megatron_cfg.optimizer.min_lr=1e-4"])
    learner = Learner(tiny_model_dir, recipe.policy.megatron_cfg, LossConfig(),
                      SequencePackingConfig(train_mb_tokens=256),
                      max_total_sequence_length=128)
    try:
        batch = groups(learner, num_groups=2, group_size=4)
        lrs = [learner.train_step(batch)["lr"] for _ in range(4)]
    finally:
        learner.shutdown()
    assert lrs == pytest.approx([7.75e-4, 5.5e-4, 3.25e-4, 1e-4])  # 1e-3 -> 1e-4 linearly over 4 steps


def test_with_two_optimizer_steps_per_batch_the_default_decay_still_ends_at_the_last_batch(tiny_model_dir):
    from learner.config import LossConfig, SequencePackingConfig, TrainStepConfig
    from learner.trainer import Learner

    recipe = load_recipe(None, ["grpo.max_num_steps=2", "grpo.num_prompts_per_step=2",
                                "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=4",
                                "policy.megatron_cfg.optimizer.lr_decay_style=linear",
                                "policy.megatron_cfg.optimizer.lr=1e-3", "policy.megatron_cfg.optimizer.min_lr=1e-4"])
    assert recipe.policy.megatron_cfg.optimizer.lr_decay_steps == 4  # 2 batches x 2 optimizer steps
    learner = Learner(tiny_model_dir, recipe.policy.megatron_cfg, LossConfig(),
                      SequencePackingConfig(train_mb_tokens=256),
                      max_total_sequence_length=128, step_config=TrainStepConfig(train_global_batch_size=4))
    try:
        batch = groups(learner, num_groups=2, group_size=4)
        metrics = [learner.train_step(batch) for _ in range(2)]
    finally:
        learner.shutdown()
    assert [m["optimizer_steps"] for m in metrics] == [2, 2]
    assert [m["lr"] for m in metrics] == pytest.approx([5.5e-4, 1e-4])  # after optimizer steps 2 and 4 of 4
