"""NeMo-RL's ``grpo.*`` / ``loss_fn.*`` keys (services/recipe/nemo_rl/table_algorithm.py) on NeMo-RL's own recipes: every
leaf has a rule or is an Inflight key of the same meaning, the translated sections validate as Inflight's
models, derived values by hand, and the refusals name key, value and what was expected."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from learner.config import LossConfig
from services.recipe.config import is_recipe_key
from services.recipe.grpo import GrpoConfig
from services.recipe.nemo_rl.rules import TranslationError, find_rule, leaves, translate
from services.recipe.nemo_rl.table_algorithm import ALGORITHM_RULES, SAME_MEANING
from services.recipe.files import read_recipe

DATA = Path(__file__).resolve().parents[2] / "data" / "nemo_rl"
FIXTURES = sorted(p.relative_to(DATA).as_posix() for p in DATA.rglob("*.yaml"))
SECTIONS = ("grpo", "loss_fn")


is_inflight_key = is_recipe_key


def algorithm_part(name: str) -> dict:
    data = read_recipe(DATA / name)
    return {k: copy.deepcopy(data[k]) for k in SECTIONS if k in data}


def translated(part: dict) -> tuple[dict, Any]:
    out, report = translate(part, ALGORITHM_RULES, is_inflight_key)
    return out, report


def test_the_fixtures_are_all_there():
    assert len(FIXTURES) >= 8 and "recipes/llm/dapo-qwen2.5-7b.v2.yaml" in FIXTURES


@pytest.mark.parametrize("name", FIXTURES)
def test_every_algorithm_key_has_a_rule_or_is_the_same_inflight_key(name):
    part = algorithm_part(name)
    for path, _ in leaves(part):
        if find_rule(ALGORITHM_RULES, path) is None:
            assert path in SAME_MEANING, f"{name}: {path} has no rule and is not listed as the same key"
            assert is_inflight_key(path), f"{name}: {path} is listed as the same key but Inflight has no such key"
    _, report = translated(part)
    assert report.unknown == [], f"{name}: keys neither ruled nor Inflight's: {report.unknown}"
    assert report.leaves == len(report.kept) + len({m.source for m in report.mapped}) + len(report.ignored)
    assert all(item.why for item in report.ignored)


@pytest.mark.parametrize("name", FIXTURES)
def test_the_translated_sections_validate(name):
    out, _ = translated(algorithm_part(name))
    GrpoConfig.model_validate(out["grpo"])
    LossConfig.model_validate(out["loss_fn"])


def test_same_meaning_keys_are_inflight_keys_without_rules():
    for path in SAME_MEANING:
        assert is_inflight_key(path), path
        assert find_rule(ALGORITHM_RULES, path) is None, path


def test_grpo_math_1b_maps_to_inflight_values():
    out, report = translated(algorithm_part("grpo_math_1B.yaml"))
    g, loss = GrpoConfig.model_validate(out["grpo"]), LossConfig.model_validate(out["loss_fn"])
    assert g.val_num_generations == 1 and g.use_leave_one_out_baseline and g.normalize_rewards
    assert g.dynamic_sampling_max_gen_batches == 10                    # no dynamic sampling: as written
    assert (loss.reference_policy_kl_penalty, loss.kl_input_clamp_value, loss.kl_output_clamp_value) == (0.01, 20, 10)
    assert loss.ratio_clip_c is None and loss.truncated_importance_sampling_ratio is None
    assert not loss.use_importance_sampling_correction and not loss.force_on_policy_ratio
    ignored = {i.source for i in report.ignored}
    assert g.max_rollout_turns == 1 and "grpo.max_rollout_turns" not in ignored   # the same key, as written
    assert {"grpo.adv_estimator.name", "loss_fn.token_level_loss",
            "loss_fn.truncated_importance_sampling_type", "grpo.batch_multiplier"} <= ignored


def test_dapo_recipe_maps_scaling_shaping_dual_clip_and_the_dynamic_sampling_budget():
    out, _ = translated(algorithm_part("recipes/llm/dapo-qwen2.5-7b.v2.yaml"))
    g, loss = GrpoConfig.model_validate(out["grpo"]), LossConfig.model_validate(out["loss_fn"])
    assert g.use_dynamic_sampling and not g.use_leave_one_out_baseline
    # NeMo-RL draws up to 10 batches of int(512 x 3) prompts: 15360 = 30 x num_prompts_per_step
    assert g.dynamic_sampling_max_gen_batches == 30
    assert g.reward_scaling.enabled and (g.reward_scaling.target_min, g.reward_scaling.target_max) == (-1.0, 1.0)
    s = g.reward_shaping
    assert s.enabled and (s.overlong_buffer_length, s.overlong_buffer_penalty) == (2048, 1.0)
    assert s.max_response_length == 14336
    assert s.stop_properly_penalty_coef is None
    assert (loss.ratio_clip_min, loss.ratio_clip_max, loss.ratio_clip_c) == (0.2, 0.28, 10.0)
    assert loss.reference_policy_kl_penalty == 0.0


def test_async_recipe_keeps_force_on_policy_and_untruncated_weights():
    out, _ = translated(algorithm_part("recipes/llm/performance/grpo-llama3.1-8b-instruct-2n4g-async-1off.yaml"))
    g, loss = GrpoConfig.model_validate(out["grpo"]), LossConfig.model_validate(out["loss_fn"])
    assert g.async_grpo.enabled and g.async_grpo.in_flight_weight_updates and g.async_grpo.max_trajectory_age_steps == 1
    assert loss.use_importance_sampling_correction and loss.force_on_policy_ratio
    assert loss.truncated_importance_sampling_ratio is None  # NeMo-RL's null: not truncated


def _refusal(name: str, changes: dict[str, Any]) -> TranslationError:
    part = algorithm_part(name)
    for path, value in changes.items():
        node = part
        *parents, leaf = path.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    with pytest.raises(TranslationError) as info:
        translated(part)
    return info.value


@pytest.mark.parametrize(("changes", "path", "message"), [
    ({"grpo.adv_estimator.name": "reinforce_plus_plus"}, "grpo.adv_estimator.name",
     "'reinforce_plus_plus' is not supported (only the GRPO group baseline is implemented (gdpo, reinforce_plus_plus, "
     "opd are not)); expected 'grpo'"),
    ({"loss_fn.reference_policy_kl_type": "k1"}, "loss_fn.reference_policy_kl_type", "'k1' is not supported"),
    ({"loss_fn.use_cispo": True}, "loss_fn.use_cispo", "True is not supported (CISPO"),
    ({"loss_fn.token_level_loss": False}, "loss_fn.token_level_loss", "False is not supported"),
    ({"grpo.advantage_clip_high": 5.0}, "grpo.advantage_clip_high", "5.0 is not supported"),
    ({"grpo.adv_estimator.normalize_rewards": False}, "grpo.adv_estimator.normalize_rewards",
     "False differs from grpo.normalize_rewards (True)"),
    ({"loss_fn.truncated_importance_sampling_type": "gspo", "loss_fn.truncated_importance_sampling_ratio": 2.0},
     "loss_fn.truncated_importance_sampling_type", "'gspo' is not supported"),
    ({"loss_fn.truncated_importance_sampling_ratio": 2.0}, "loss_fn.truncated_importance_sampling_type",
     "null with truncated_importance_sampling_ratio 2.0"),
    ({"grpo.batch_multiplier": 2}, "grpo.batch_multiplier", "2 without grpo.use_dynamic_sampling"),
    ({"grpo.val_start_at": 25}, "grpo.val_start_at", "25 delays validation past step grpo.val_period (10)"),
])
def test_refusals_name_the_key_the_value_and_what_is_expected(changes, path, message):
    err = _refusal("grpo_math_1B.yaml", changes)
    assert err.path == path and message in err.reason, err


def test_neutral_and_no_effect_values_are_accepted():
    part = algorithm_part("grpo_math_1B.yaml")
    part["grpo"]["val_start_at"] = 10                                  # = val_period: the first validation anyway
    part["loss_fn"]["truncated_importance_sampling_type"] = "icepop"
    part["loss_fn"]["truncated_importance_sampling_ratio"] = 5.0
    part["loss_fn"]["truncated_importance_sampling_ratio_min"] = 0.5
    out, _ = translated(part)
    loss = LossConfig.model_validate(out["loss_fn"])
    assert (loss.truncated_importance_sampling_type, loss.truncated_importance_sampling_ratio,
            loss.truncated_importance_sampling_ratio_min) == ("icepop", 5.0, 0.5)


def test_seq_mask_tis_and_the_seq_logprob_error_threshold_translate_with_their_meaning():
    """Issue 37 item 2: NeMo-RL's sequence-level masking keys (refused before) keep their names and values."""
    part = algorithm_part("grpo_math_1B.yaml")
    part["grpo"]["seq_logprob_error_threshold"] = 2.0
    part["loss_fn"].update(truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=1.002,
                           truncated_importance_sampling_ratio_min=0.999, use_importance_sampling_correction=True)
    out, _ = translated(part)
    loss = LossConfig.model_validate(out["loss_fn"])
    assert (loss.truncated_importance_sampling_type, loss.truncated_importance_sampling_ratio_min,
            loss.truncated_importance_sampling_ratio) == ("seq-mask-tis", 0.999, 1.002)
    assert out["grpo"]["seq_logprob_error_threshold"] == 2.0


def test_an_inflight_recipe_keeps_its_dynamic_sampling_bound():
    part = {"grpo": {"use_dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 7, "num_prompts_per_step": 4}}
    out, report = translated(part)
    assert out["grpo"]["dynamic_sampling_max_gen_batches"] == 7 and not report.mapped and not report.ignored
