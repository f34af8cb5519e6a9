"""The GRPO options NeMo-RL recipes set, as Inflight recipe keys: reward scaling / shaping reach the learner's
step config, ``loss_fn.force_on_policy_ratio`` needs one optimizer step per rollout batch."""
from __future__ import annotations

import pytest

from services.recipe.config import RecipeError, load_recipe
from services.job.learner_actor import LearnerSpec

DAPO = ["grpo.reward_scaling.enabled=true", "grpo.reward_scaling.target_min=-1.0", "grpo.reward_shaping.enabled=true",
        "grpo.reward_shaping.overlong_buffer_length=16", "grpo.reward_shaping.overlong_buffer_penalty=1",
        "grpo.reward_shaping.max_response_length=64", "loss_fn.ratio_clip_c=10"]


def test_reward_options_reach_the_learner_step_config():
    recipe = load_recipe(None, DAPO)
    step = LearnerSpec.of(recipe, "model-dir").step_config
    assert step.reward_scaling.enabled and step.reward_scaling.target_min == -1.0
    assert step.reward_shaping.overlong_buffer_length == 16 and step.reward_shaping.max_response_length == 64
    assert recipe.loss_fn.ratio_clip_c == 10.0


def test_incomplete_reward_shaping_names_its_key():
    with pytest.raises(RecipeError, match=r"grpo.reward_shaping: .*needs overlong_buffer_length"):
        load_recipe(None, ["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_penalty=1",
                           "grpo.reward_shaping.max_response_length=64"])


def test_force_on_policy_ratio_needs_one_optimizer_step_per_rollout_batch():
    base = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "loss_fn.force_on_policy_ratio=true"]
    assert load_recipe(None, base).loss_fn.force_on_policy_ratio
    assert load_recipe(None, base + ["policy.train_global_batch_size=16"]).loss_fn.force_on_policy_ratio
    with pytest.raises(RecipeError, match=r"force_on_policy_ratio.*train_global_batch_size \(8\) must be None or "
                                          r"grpo.num_prompts_per_step x grpo.num_generations_per_prompt \(16\)"):
        load_recipe(None, base + ["policy.train_global_batch_size=8"])
