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


EVERY_STEP_KEY_SET = ["grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
                      "policy.train_global_batch_size=8", "grpo.use_leave_one_out_baseline=true",
                      "grpo.overlong_filtering=true", "grpo.seq_logprob_error_threshold=2.5",
                      "grpo.reward_scaling.enabled=true", "grpo.reward_scaling.target_min=-1.0",
                      "grpo.reward_shaping.enabled=true", "grpo.reward_shaping.stop_properly_penalty_coef=0.5"]


def test_every_step_key_travels_whole_from_the_recipe_to_the_learner():
    """Each key of GrpoStepKeys and PolicyStepKeys, set away from its default, arrives in the step config."""
    from learner.config import GrpoStepKeys, PolicyStepKeys, TrainStepConfig

    recipe = load_recipe(None, EVERY_STEP_KEY_SET)
    step = LearnerSpec.of(recipe, "model-dir").step_config
    default = TrainStepConfig()
    for keys, section in ((GrpoStepKeys, recipe.grpo), (PolicyStepKeys, recipe.policy)):
        for name in keys.model_fields:
            assert getattr(step, name) == getattr(section, name), name
            assert getattr(step, name) != getattr(default, name), f"{name} is not set away from its default here"


def test_each_step_key_is_declared_once_in_the_learner_and_inherited_by_the_recipe():
    """The recipe's sections do not redeclare a key the learner declares (one declaration, one docstring)."""
    from learner.config import GrpoStepKeys, PolicyStepKeys
    from services.recipe.config import PolicyConfig
    from services.recipe.grpo import GrpoConfig

    for section, keys in ((GrpoConfig, GrpoStepKeys), (PolicyConfig, PolicyStepKeys)):
        assert issubclass(section, keys)
        for name in keys.model_fields:
            declared_in = [c.__name__ for c in section.__mro__ if name in vars(c).get("__annotations__", {})]
            assert declared_in == [keys.__name__], (name, declared_in)
