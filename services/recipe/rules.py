"""Cross-field rules of a recipe (each names the keys it relates); the GPU layout rules are in
:mod:`services.recipe.gpu_layout`. Called by :class:`services.recipe.config.Recipe`'s validator."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.recipe.config import Recipe


def check_recipe(recipe: Recipe) -> None:
    """Raise ``ValueError`` naming the keys of the first contradiction; fill ``lr_decay_steps``' default."""
    p, g = recipe.policy, recipe.policy.generation
    if g.max_new_tokens > p.max_total_sequence_length:
        raise ValueError(f"policy.generation.max_new_tokens ({g.max_new_tokens}) must be <= "
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
    if p.megatron_cfg.moe_enable_routing_replay and not g.vllm_cfg.enable_return_routed_experts:
        raise ValueError("policy.megatron_cfg.moe_enable_routing_replay requires policy.generation.vllm_cfg."
                         "enable_return_routed_experts=true (the engines return the experts the learner replays)")
    if g.vllm_cfg.max_model_len is not None and g.vllm_cfg.max_model_len < p.max_total_sequence_length:
        raise ValueError(f"policy.generation.vllm_cfg.max_model_len ({g.vllm_cfg.max_model_len}) must be >= "
                         f"policy.max_total_sequence_length ({p.max_total_sequence_length})")
    ahead = a.max_trajectory_age_steps * recipe.grpo.num_prompts_per_step
    if a.enabled and recipe.rollout_pool.max_inflight_groups < ahead:
        raise ValueError(f"rollout_pool.max_inflight_groups ({recipe.rollout_pool.max_inflight_groups}) must be >= "
                         f"grpo.async_grpo.max_trajectory_age_steps x grpo.num_prompts_per_step ({ahead}): "
                         f"the groups generated ahead wait in the learner's channel while it trains")
    _check_data(recipe)
    _resolve_lr_decay_steps(recipe)


def _check_data(recipe: Recipe) -> None:
    """``data``, ``env.<name>``, validation and the optimizer-step size agree; fills ``data.dataset_name`` and
    ``data.max_input_seq_length``'s defaults."""
    d, g, p = recipe.data, recipe.grpo, recipe.policy
    batch = g.num_prompts_per_step * g.num_generations_per_prompt
    if p.train_global_batch_size is not None and batch % p.train_global_batch_size:
        raise ValueError(f"policy.train_global_batch_size ({p.train_global_batch_size}) must divide the rollout batch "
                         f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt ({batch})")
    if recipe.loss_fn.force_on_policy_ratio and p.train_global_batch_size not in (None, batch):
        raise ValueError(f"loss_fn.force_on_policy_ratio needs one optimizer step per rollout batch: "
                         f"policy.train_global_batch_size ({p.train_global_batch_size}) must be None or "
                         f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt ({batch})")
    if d.train_data_path is not None and d.dataset_name is not None:
        raise ValueError(f"data.train_data_path ({d.train_data_path!r}) and data.dataset_name ({d.dataset_name!r}): "
                         f"give one of them")
    if d.train_data_path is None and d.dataset_name is None:
        d.dataset_name = "repeat_letter"
    if d.val_data_path is not None and d.train_data_path is None:
        raise ValueError("data.val_data_path needs data.train_data_path (a built-in data set validates on its own "
                         "prompts drawn with another seed)")
    if d.split_validation_size > 0 and d.train_data_path is None:
        raise ValueError(f"data.split_validation_size ({d.split_validation_size:g}) holds out rows of "
                         f"data.train_data_path, which is not set")
    if d.split_validation_size > 0 and d.val_data_path is not None:
        raise ValueError(f"data.split_validation_size ({d.split_validation_size:g}) and data.val_data_path "
                         f"({d.val_data_path!r}): give one validation set")
    room = p.max_total_sequence_length - p.generation.max_new_tokens
    if d.max_input_seq_length is None:
        d.max_input_seq_length = room if room > 0 else p.max_total_sequence_length - 1
    elif d.max_input_seq_length >= p.max_total_sequence_length:
        raise ValueError(f"data.max_input_seq_length ({d.max_input_seq_length}) must be < "
                         f"policy.max_total_sequence_length ({p.max_total_sequence_length}): a prompt must leave "
                         f"room for at least one answer token")
    named = recipe.env.named
    if d.env_name is not None and d.env_name not in named:
        raise ValueError(f"data.env_name ({d.env_name!r}): no section env.{d.env_name} "
                         f"(named sections: {sorted(named) or 'none'})")
    if d.env_name is None and len(named) > 1:
        raise ValueError(f"data.env_name: several env sections ({sorted(named)}), name the one that scores the data")
    if d.env_name is None and named:
        d.env_name = next(iter(named))
    unused = sorted(set(named) - {d.env_name})
    if unused:
        raise ValueError(f"env.{unused[0]}: a section no data.env_name names")
    section = named[d.env_name] if d.env_name is not None else None
    if g.max_rollout_turns > 1 and not (section is not None and (section.episodic or section.agent)):
        raise ValueError(f"grpo.max_rollout_turns ({g.max_rollout_turns}) > 1 needs an environment that plays "
                         f"episodes: env.<name>.environment or env.<name>.url (data.env_name names the section)")
    if section is not None and section.agent and not p.generation.vllm_cfg.expose_http_server:
        raise ValueError(f"env.{d.env_name}.agent: the agent calls the pool's OpenAI endpoint; set "
                         f"policy.generation.vllm_cfg.expose_http_server: true")
    metric = recipe.checkpointing.metric_name
    validates = g.val_period > 0 or g.val_at_start
    if validates and d.train_data_path is not None and d.val_data_path is None and not d.split_validation_size:
        raise ValueError("grpo.val_period / grpo.val_at_start: validation of data.train_data_path needs "
                         "data.val_data_path or data.split_validation_size")
    if metric is not None and metric.startswith("val_") and not validates:
        raise ValueError(f"checkpointing.metric_name ({metric!r}) is a validation metric: set grpo.val_period > 0")


def _resolve_lr_decay_steps(recipe: Recipe) -> None:
    """``lr_decay_steps`` (optimizer steps) defaults to ``grpo.max_num_steps`` x the optimizer steps per rollout
    batch; a decaying schedule must outlast its warm-up."""
    o = recipe.policy.megatron_cfg.optimizer
    if o.lr_decay_steps is None:
        g, size = recipe.grpo, recipe.policy.train_global_batch_size
        batch = g.num_prompts_per_step * g.num_generations_per_prompt
        o.lr_decay_steps = g.max_num_steps * (max(1, batch // size) if size is not None else 1)
    if o.lr_decay_style != "constant" and o.lr_warmup_steps >= o.lr_decay_steps:
        raise ValueError(f"policy.megatron_cfg.optimizer.lr_warmup_steps ({o.lr_warmup_steps}) must be < "
                         f"lr_decay_steps ({o.lr_decay_steps}; default grpo.max_num_steps) for "
                         f"lr_decay_style={o.lr_decay_style!r}")
