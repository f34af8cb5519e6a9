"""Cross-field rules of a recipe (each names the keys it relates); the GPU layout rules are in
:mod:`services.gpu_layout`. Called by :class:`services.config.Recipe`'s validator."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.config import Recipe


def check_recipe(recipe: Recipe) -> None:
    """Raise ``ValueError`` naming the keys of the first contradiction; fill ``lr_decay_steps``' default."""
    p, g = recipe.policy, recipe.policy.generation
    if g.max_new_tokens >= p.max_total_sequence_length:
        raise ValueError(f"policy.generation.max_new_tokens ({g.max_new_tokens}) must be < "
                         f"policy.max_total_sequence_length ({p.max_total_sequence_length})")
    if p.sequence_packing.enabled and p.sequence_packing.train_mb_tokens < p.max_total_sequence_length:
        raise ValueError(f"policy.sequence_packing.train_mb_tokens ({p.sequence_packing.train_mb_tokens}) must "
                         f"be >= policy.max_total_sequence_length ({p.max_total_sequence_length})")
    if recipe.rollout_pool.channel_send_timeout_s >= g.request_timeout_s:
        raise ValueError(f"rollout_pool.channel_send_timeout_s ({recipe.rollout_pool.channel_send_timeout_s:g}) must "
                         f"be < policy.generation.request_timeout_s ({g.request_timeout_s:g}): an engine must "
                         f"not wait on a learner that stopped reading longer than on a sample")
    a = recipe.grpo.async_grpo
    if a.enabled and g.colocated.enabled:
        raise ValueError("grpo.async_grpo.enabled requires policy.generation.colocated.enabled=false "
                         "(the learner and the pool need their own devices)")
    if p.refit_transport == "collective" and g.colocated.enabled:
        raise ValueError("policy.refit_transport='collective' requires policy.generation.colocated.enabled="
                         "false (a colocated engine shares the learner's GPU; use 'object_store')")
    if a.enabled and not recipe.loss_fn.use_importance_sampling_correction:
        raise ValueError("grpo.async_grpo.enabled requires loss_fn.use_importance_sampling_correction=true "
                         "(lag-1 samples come from an older policy)")
    if g.vllm_cfg.max_model_len is not None and g.vllm_cfg.max_model_len < p.max_total_sequence_length:
        raise ValueError(f"policy.generation.vllm_cfg.max_model_len ({g.vllm_cfg.max_model_len}) must be >= "
                         f"policy.max_total_sequence_length ({p.max_total_sequence_length})")
    ahead = a.max_trajectory_age_steps * recipe.grpo.num_prompts_per_step
    if a.enabled and recipe.rollout_pool.max_inflight_groups < ahead:
        raise ValueError(f"rollout_pool.max_inflight_groups ({recipe.rollout_pool.max_inflight_groups}) must be >= "
                         f"grpo.async_grpo.max_trajectory_age_steps x grpo.num_prompts_per_step ({ahead}): "
                         f"the groups generated ahead wait in the learner's channel while it trains")
    _resolve_lr_decay_steps(recipe)


def _resolve_lr_decay_steps(recipe: Recipe) -> None:
    """``lr_decay_steps`` defaults to ``grpo.max_num_steps``; a decaying schedule must outlast its warm-up."""
    o = recipe.policy.megatron_cfg.optimizer
    if o.lr_decay_steps is None:
        o.lr_decay_steps = recipe.grpo.max_num_steps
    if o.lr_decay_style != "constant" and o.lr_warmup_steps >= o.lr_decay_steps:
        raise ValueError(f"policy.megatron_cfg.optimizer.lr_warmup_steps ({o.lr_warmup_steps}) must be < "
                         f"lr_decay_steps ({o.lr_decay_steps}; default grpo.max_num_steps) for "
                         f"lr_decay_style={o.lr_decay_style!r}")
