"""The recipe's per-step GRPO keys reach the learner's constructor through LearnerSpec."""
from __future__ import annotations

from services.recipe.config import load_recipe
from services.job.learner_actor import LearnerSpec


def test_learner_spec_carries_the_step_options():
    recipe = load_recipe(None, ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                                "policy.train_global_batch_size=8", "grpo.use_leave_one_out_baseline=true",
                                "grpo.overlong_filtering=true"])
    step = LearnerSpec.of(recipe, "model-dir").step_config
    assert (step.train_global_batch_size, step.use_leave_one_out_baseline, step.overlong_filtering) == (8, True, True)
    default = LearnerSpec.of(load_recipe(None, []), "model-dir").step_config
    assert (default.train_global_batch_size, default.use_leave_one_out_baseline, default.overlong_filtering) == \
        (None, False, False)
