"""How an engine picks its reward environment: ``env.<data.env_name>`` when set, else the single ``env.reward_fn``."""
from __future__ import annotations

import pytest

from services.recipe.config import load_recipe
from services.pool.engine_actor import EngineSpec, RewardEnvSpec


def test_a_named_env_section_is_the_engines_reward_environment():
    recipe = load_recipe(None, ["env.math.reward_functions=[{name: math_verify, weight: 0.8}, {name: format, "
                                "weight: 0.2}]", "env.math.num_workers=3", "env.math.timeout_s=4"])
    assert recipe.data.env_name == "math"  # filled in: the only named section
    spec = EngineSpec.from_recipe(recipe, "e0", "/m")
    assert spec.reward_env == RewardEnvSpec("math", (("math_verify", 0.8), ("format", 0.2)), 3, 4.0)
    assert spec.reward_env is not None
    env = spec.reward_env.build()
    try:
        assert [(f.name, f.weight) for f in env.functions] == [("math_verify", 0.8), ("format", 0.2)]
        assert env.workers.num_workers == 3 and env.timeout_s == 4.0
    finally:
        env.close()


def test_without_a_named_section_the_legacy_reward_fn_is_used():
    recipe = load_recipe(None, ["env.reward_fn=math_exact", "env.reward_timeout_s=7"])
    spec = EngineSpec.from_recipe(recipe, "e0", "/m")
    assert spec.reward_env is None and spec.reward_fn == "math_exact" and spec.reward_timeout_s == 7.0


def test_an_env_name_without_its_section_is_a_clear_error():
    recipe = load_recipe(None, ["env.reward_fn=math_exact"])
    recipe.data.env_name = "gsm"
    with pytest.raises(ValueError, match=r"data.env_name \('gsm'\): no section env.gsm"):
        RewardEnvSpec.from_recipe(recipe)


def test_an_unknown_reward_function_name_is_a_recipe_error():
    with pytest.raises(ValueError, match=r"env.math.reward_functions.0: name: expected one of \['dapo_math_verify', "
                                         r"'exact_alnum', 'format', 'math_exact', 'math_verify', 'repeat_letter', "
                                         r"'tag_format'\].*got 'mathverify'"):
        load_recipe(None, ["env.math.reward_functions=[{name: mathverify, weight: 1.0}]"])
