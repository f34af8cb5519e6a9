"""What NeMo-RL's ``grpo.*`` and ``loss_fn.*`` keys mean here (read against NeMo-RL's ``nemo_rl/algorithms/grpo.py``,
``loss/loss_functions.py``, ``advantage_estimator.py``, ``reward_functions.py`` and ``utils.py``).

Most keys are Inflight keys of the same name and meaning and need no rule: :data:`SAME_MEANING` lists them, each
with what was checked. The rules below cover the rest: a renamed key, a key with no effect here (ignored, with
why), an algorithm feature Inflight does not implement (accepted only at its "off" value), and keys whose value
depends on others (derived). Inflight recipes go through this table too; the only rule on an Inflight key
(``grpo.dynamic_sampling_max_gen_batches``) applies only when the NeMo-RL key it depends on is present.
"""
from __future__ import annotations

import math
from typing import Any

from services.recipe.nemo_rl.rules import (
    Derive,
    Ignore,
    NeutralOnly,
    Path,
    Rename,
    Source,
    Table,
    TranslationError,
    When,
)

SAME_MEANING: dict[Path, str] = {
    "grpo.max_rollout_turns": "sampled turns per episode of a multi-turn environment",
    "grpo.num_prompts_per_step": "groups per step",
    "grpo.num_generations_per_prompt": "group size G",
    "grpo.max_num_epochs": "passes over the training data; the run ends at it or max_num_steps",
    "grpo.max_num_steps": "training steps",
    "grpo.normalize_rewards": "divide by the group's sample std (+1e-6) where it is > 0",
    "grpo.use_leave_one_out_baseline": "RLOO baseline and the others' sample std, as calculate_baseline_and_std_"
                                       "per_prompt (NeMo-RL's dynamic sampling then judges each sample on its own "
                                       "others' std; Inflight judges whole groups)",
    "grpo.val_period": "validate when step % val_period == 0; 0 never",
    "grpo.val_at_start": "validate before the first step",
    "grpo.overlong_filtering": "truncated samples stay in the baseline, out of the loss",
    "grpo.seq_logprob_error_threshold": "a sequence whose mean exp(|lp_prev - lp_gen|) exceeds it stays in the "
                                        "baseline, out of the loss and N (compute_and_apply_seq_logprob_error_masking)",
    "grpo.max_val_samples": "validation prompts",
    "grpo.val_batch_size": "validation prompts per batch",
    "grpo.seed": "seed",
    "grpo.use_dynamic_sampling": "drop groups whose scaled, unshaped rewards are all equal; draw replacements",
    "grpo.reward_scaling.enabled": "NeMo-RL's scale_rewards: clamp to [source_min, source_max], map linearly",
    "grpo.reward_scaling.source_min": "as scale_rewards",
    "grpo.reward_scaling.source_max": "as scale_rewards",
    "grpo.reward_scaling.target_min": "as scale_rewards",
    "grpo.reward_scaling.target_max": "as scale_rewards",
    "grpo.reward_shaping.enabled": "NeMo-RL's apply_reward_shaping, after scaling, before advantages",
    "grpo.reward_shaping.overlong_buffer_length": "as apply_reward_shaping",
    "grpo.reward_shaping.overlong_buffer_penalty": "as apply_reward_shaping",
    "grpo.reward_shaping.max_response_length": "as apply_reward_shaping (response tokens as generated)",
    "grpo.reward_shaping.stop_properly_penalty_coef": "as apply_reward_shaping: replaces the overlong penalty",
    "grpo.async_grpo.enabled": "lag-1 asynchronous GRPO",
    "grpo.async_grpo.max_trajectory_age_steps": "older groups are not trained on",
    "grpo.async_grpo.in_flight_weight_updates": "push weights without waiting for running requests",
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": "recompute running requests' KV after a push",
    "loss_fn.reference_policy_kl_penalty": "beta of the k3 KL term, with its score-function gradient",
    "loss_fn.kl_input_clamp_value": "clamp of log(pi_ref / pi_theta) in calculate_kl",
    "loss_fn.kl_output_clamp_value": "clamp of the per-token KL in calculate_kl",
    "loss_fn.ratio_clip_min": "epsilon_low",
    "loss_fn.ratio_clip_max": "epsilon_high",
    "loss_fn.ratio_clip_c": "dual clip for negative advantages; null off",
    "loss_fn.use_importance_sampling_correction": "multiply by pi_prev / pi_gen (truncated as set)",
    "loss_fn.truncated_importance_sampling_ratio": "upper bound of the weight; null: not truncated",
    "loss_fn.truncated_importance_sampling_ratio_min": "tis lower clamp (null 0); icepop / seq-mask-tis lower bound",
    "loss_fn.force_on_policy_ratio": "ratio fixed at 1; one optimizer step per rollout batch (checked at load)",
}
"""NeMo-RL keys that are Inflight keys of the same meaning (no rule), with what their meaning is."""


def _val_start_at(value: Any, src: Source) -> list[tuple[Path, Any]]:
    """NeMo-RL validates at step s when ``s >= val_start_at and s % val_period == 0``; any value up to
    ``val_period`` changes nothing (the first multiple is ``val_period`` itself)."""
    period = int(src.get("grpo.val_period", 0) or 0)
    if period > 0 and value is not None and value > period:
        raise TranslationError("grpo.val_start_at", f"{value!r} delays validation past step grpo.val_period "
                                                    f"({period}), which is not supported; expected -1 or <= {period}")
    return []


def _batch_multiplier(value: Any, src: Source) -> list[tuple[Path, Any]]:
    if not src.get("grpo.use_dynamic_sampling", False) and value != 1:
        raise TranslationError("grpo.batch_multiplier", f"{value!r} without grpo.use_dynamic_sampling (NeMo-RL "
                                                        f"refuses it too); expected 1")
    return []


def _max_gen_batches(value: Any, src: Source) -> list[tuple[Path, Any]]:
    """The prompts NeMo-RL may generate for one step, ``max_gen_batches x int(num_prompts x batch_multiplier)``,
    in Inflight's unit of ``num_prompts_per_step`` prompts (rounded up)."""
    if not src.get("grpo.use_dynamic_sampling", False):
        return [("grpo.dynamic_sampling_max_gen_batches", value)]
    n = int(src.get("grpo.num_prompts_per_step", 64))
    per_batch = int(n * float(src.get("grpo.batch_multiplier", 1)))
    return [("grpo.dynamic_sampling_max_gen_batches", math.ceil(value * per_batch / n))]


def _same_as(top: Path) -> Derive:
    """``grpo.adv_estimator.<key>``: NeMo-RL's advantages read this copy (an interpolation of ``top`` in its recipes);
    Inflight has one key, so the two must agree."""
    def fn(value: Any, src: Source) -> list[tuple[Path, Any]]:
        other = src.get(top)
        if other is not None and value != other:
            key = "grpo.adv_estimator." + top.rsplit(".", 1)[1]
            raise TranslationError(key, f"{value!r} differs from {top} ({other!r}): NeMo-RL computes advantages with "
                                        f"this one, Inflight has only {top}; expected {other!r}")
        return []
    return Derive(fn, f"the advantage estimator's copy of {top} (equal to it)")


def _tis_type(value: Any, src: Source) -> list[tuple[Path, Any]]:
    key = "loss_fn.truncated_importance_sampling_type"
    ratio = src.get("loss_fn.truncated_importance_sampling_ratio")
    if value is None:
        if ratio is not None:
            raise TranslationError(key, f"null with truncated_importance_sampling_ratio {ratio!r} (NeMo-RL fails on "
                                        f"it too); expected 'tis', 'icepop' or 'seq-mask-tis'")
        return []
    if value not in ("tis", "icepop", "seq-mask-tis"):
        raise TranslationError(key, f"{value!r} is not supported; expected 'tis', 'icepop', 'seq-mask-tis' or null")
    return [(key, value)]


def _skip_reference(value: Any, src: Source) -> list[tuple[Path, Any]]:
    penalty = src.get("loss_fn.reference_policy_kl_penalty", 0)
    if value is True and penalty:
        raise TranslationError("grpo.skip_reference_policy_logprobs_calculation",
                               f"true with loss_fn.reference_policy_kl_penalty {penalty!r} (NeMo-RL refuses it too); "
                               f"expected false, or a penalty of 0")
    return []


NOT_CLIPPED = "advantages are not clipped after normalisation"
NO_EARLY_STOP = "no early stop on a validation metric: the run ends at grpo.max_num_steps or grpo.max_num_epochs"

ALGORITHM_RULES: Table = {
    "grpo.val_start_at": Derive(_val_start_at, "no delay: periodic validation starts at step grpo.val_period"),
    "grpo.val_at_end": NeutralOnly((False,), "no validation after the last step: it runs at grpo.val_at_start and "
                                             "every grpo.val_period steps"),
    "grpo.val_num_generations_per_prompt": Rename("grpo.val_num_generations"),
    "grpo.advantage_clip_low": NeutralOnly((None,), NOT_CLIPPED),
    "grpo.advantage_clip_high": NeutralOnly((None,), NOT_CLIPPED),
    "grpo.stop_at_validation_metric": NeutralOnly((None,), NO_EARLY_STOP),
    "grpo.stop_at_validation_threshold": NeutralOnly((None,), NO_EARLY_STOP),
    "grpo.batch_multiplier": Derive(_batch_multiplier, "dynamic sampling draws a replacement for each zero-advantage "
                                    "group as it arrives, not rounds of batch_multiplier x num_prompts_per_step; "
                                    "the prompt budget it implies is in grpo.dynamic_sampling_max_gen_batches"),
    "grpo.dynamic_sampling_max_gen_batches": When(
        lambda src: src.get("grpo.batch_multiplier") is not None,
        Derive(_max_gen_batches, "with dynamic sampling: NeMo-RL's budget of max_gen_batches x int(num_prompts_per_"
                                 "step x batch_multiplier) prompts, in units of num_prompts_per_step (NeMo-RL stops "
                                 "the run past it; Inflight trains the step on what it has and counts it)"),
        None, "when the recipe has NeMo-RL's grpo.batch_multiplier"),
    "grpo.adv_estimator.name": NeutralOnly(("grpo",), "only the GRPO group baseline is implemented (gdpo, "
                                                      "reinforce_plus_plus, opd are not)"),
    "grpo.adv_estimator.normalize_rewards": _same_as("grpo.normalize_rewards"),
    "grpo.adv_estimator.use_leave_one_out_baseline": _same_as("grpo.use_leave_one_out_baseline"),
    "grpo.adv_estimator.minus_baseline": Ignore("read only by the reinforce_plus_plus estimator, which "
                                                "grpo.adv_estimator.name refuses"),
    "grpo.adv_estimator.reward_weights": NeutralOnly((None,), "per-reward weights of the gdpo estimator, which is not "
                                                              "implemented"),
    "grpo.invalid_tool_call_advantage": NeutralOnly((None,), "a malformed tool call is answered with an error "
                                                             "message and trained like any turn; no advantage "
                                                             "override"),
    "grpo.malformed_thinking_advantage": NeutralOnly((None,), "no token is flagged for malformed <think> tags "
                                                              "(NeMo-Gym's rollout flags); rewards come from the env's "
                                                              "reward functions"),
    "grpo.async_grpo.max_generation_failures": Ignore("a failed generation never stops the run: it is retried "
                                                      "(policy.generation.max_retries), then its prompt is dropped "
                                                      "with a reason and replaced; a step that cannot be filled fails "
                                                      "at policy.generation.group_deadline_s"),
    "grpo.deduplicate_multimodal_data": Ignore("NeMo-RL's switch to send a group's images once, not once per sample: "
                                               "Inflight always does (a prompt's image is prepared once by the image "
                                               "workers and its pixels travel once with the prompt, shared by its "
                                               "group's samples: docs/multimodal.md); not what is trained"),
    "grpo.debug_payload_metrics": Ignore("NeMo-RL's debug telemetry of its Ray payload sizes"),
    "grpo.calculate_advantages_on_gpu": Ignore("where NeMo-RL computes the advantages; here the learner computes them "
                                               "per group, same values"),
    "grpo.skip_reference_policy_logprobs_calculation": Derive(
        _skip_reference, "the reference model and its log-probs exist only when loss_fn.reference_policy_kl_penalty "
                         "> 0"),
    "loss_fn.reference_policy_kl_type": NeutralOnly(("k3",), "the KL penalty and the gen/policy KL metrics use the k3 "
                                                             "estimator"),
    "loss_fn.use_on_policy_kl_approximation": NeutralOnly((False,), "the KL term is not reweighted by pi_theta / "
                                                                    "pi_gen"),
    "loss_fn.truncated_importance_sampling_type": Derive(
        _tis_type, "null: the importance weight is not truncated (with truncated_importance_sampling_ratio null)"),
    "loss_fn.sequence_level_importance_ratios": NeutralOnly((False,), "importance ratios are per token (GSPO's "
                                                                      "sequence-level ratios are not implemented)"),
    "loss_fn.token_level_loss": NeutralOnly((True,), "the loss is a masked mean over all valid tokens of the optimizer "
                                                     "step; per-sequence averaging is not implemented"),
    "loss_fn.use_kl_in_reward": NeutralOnly((False,), "the KL penalty is a loss term (Reinforce++'s KL in the reward "
                                                      "is not implemented)"),
    "loss_fn.use_cispo": NeutralOnly((False,), "CISPO's clipped-weight surrogate is not implemented"),
    "loss_fn.disable_ppo_ratio": NeutralOnly((False,), "the REINFORCE surrogate without the ratio is not implemented"),
    "loss_fn.positive_example_nll_weight": NeutralOnly((0.0,), "VAPO's NLL term on correct samples is not "
                                                               "implemented"),
}
"""Rules for NeMo-RL's ``grpo.*`` and ``loss_fn.*`` keys that are not in :data:`SAME_MEANING`."""
