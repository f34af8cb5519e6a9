"""Each recipe key's counterpart in NeMo-RL's GRPO recipes (``examples/configs/grpo_math_1B*.yaml``), shown in
docs/configuration.md. A key not listed has the same path in NeMo-RL; ``None`` means NeMo-RL has no such key."""
from __future__ import annotations

SAME = "same"
NEMO_RL_NAMES: dict[str, str | None] = {
    "grpo.max_consecutive_skipped_steps": None,
    "grpo.val_num_generations": None,
    "grpo.val_temperature": None,
    "policy.refit_bucket_mb": None,
    "policy.refit_transport": None,
    "policy.refit_timeout_s": None,
    "policy.generation.request_timeout_s": None,
    "policy.generation.max_retries": None,
    "policy.generation.vllm_cfg.max_num_seqs": None,
    "policy.generation.vllm_cfg.cpu_kvcache_space_gib": None,
    "policy.generation.vllm_cfg.moe_backend": None,
    "policy.generation.vllm_cfg.all2all_backend": None,
    "policy.generation.vllm_cfg.enable_prefix_caching": None,
    "policy.generation.vllm_cfg.seed": None,
    "policy.generation.vllm_cfg.direct_weight_load": None,
    "policy.megatron_cfg.precision": "policy.precision",
    "policy.megatron_cfg.optimizer.lr_warmup_steps": "policy.megatron_cfg.scheduler.lr_warmup_iters",
    "policy.megatron_cfg.optimizer.lr_decay_style": "policy.megatron_cfg.scheduler.lr_decay_style",
    "policy.megatron_cfg.optimizer.lr_decay_steps": "policy.megatron_cfg.scheduler.lr_decay_iters",
    "loss_fn.truncated_importance_sampling_type": None,
    "data.env_name": "env_name of NeMo-RL's task spec",
    "data.num_prompts": None,
    "data.val_data_path": SAME,
    "data.input_key": SAME,
    "data.output_key": SAME,
    "data.messages_key": None,
    "data.skip_invalid_rows": None,
    "env.reward_fn": None,
    "env.reward_timeout_s": None,
    "env.<name>.timeout_s": None,
    "checkpointing.save_hf": "checkpointing.save_consolidated",
    "cluster.engine_resources": None,
    "cluster.learner_resources": None,
    "logger.parity_probe_sequences": None,
    "logger.parity_max_gen_kl": None,
    "logger.parity_max_gen_kl_ratio": None,
}


def nemo_rl_name(key: str) -> str:
    """The NeMo-RL counterpart of ``key`` for the reference table: its path, or "—" (none)."""
    if key.startswith("rollout_pool."):
        return "—"
    name = NEMO_RL_NAMES.get(key, SAME)
    if name is None:
        return "—"
    return "same" if name in (SAME, key) else f"`{name}`"
