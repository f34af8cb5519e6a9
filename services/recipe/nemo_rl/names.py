"""Each recipe key's counterpart in NeMo-RL's GRPO recipes (``examples/configs/grpo_math_1B*.yaml``), shown in
docs/configuration.md. A key that a :class:`~services.recipe.nemo_rl.rules.Rename` rule of
:data:`services.recipe.nemo_rl.table.TABLE` targets gets that rule's NeMo-RL key (the table is the one source of
truth); :data:`NEMO_RL_NAMES` names the others (keys a ``Derive`` sets, keys NeMo-RL lacks: ``None``). A key in
neither has the same path in NeMo-RL."""
from __future__ import annotations

from functools import cache

SAME = "same"
NEMO_RL_NAMES: dict[str, str | None] = {
    "grpo.max_consecutive_skipped_steps": None,
    "policy.freeze_vision_tower": None,
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
    "policy.megatron_cfg.gpu_memory_fraction": None,
    "policy.megatron_cfg.optimizer.lr_warmup_steps": "policy.megatron_cfg.scheduler.lr_warmup_iters",
    "policy.megatron_cfg.optimizer.lr_decay_style": "policy.megatron_cfg.scheduler.lr_decay_style",
    "policy.megatron_cfg.optimizer.lr_decay_steps": "policy.megatron_cfg.scheduler.lr_decay_iters",
    "rollout_pool.num_engines": "policy.generation.colocated.resources",
    "data.env_name": "data.default.env_name",
    "data.num_prompts": None,
    "data.dataset_name": None,
    "data.train_data_path": "data.train.data_path",
    "data.train_split": "data.train.split",
    "data.val_data_path": "data.validation.data_path",
    "data.val_split": "data.validation.split",
    "data.split_validation_size": "data.train.split_validation_size",
    "data.split_validation_seed": "data.train.seed",
    "data.input_key": "data.default.input_key",
    "data.output_key": "data.default.output_key",
    "data.task_columns": None,
    "data.prompt_file": "data.default.prompt_file",
    "data.system_prompt_file": "data.default.system_prompt_file",
    "data.messages_key": None,
    "data.skip_invalid_rows": None,
    "env.reward_fn": None,
    "env.reward_timeout_s": None,
    "env.<name>.timeout_s": None,
    "cluster.engine_resources": None,
    "cluster.learner_resources": None,
    "logger.parity_probe_sequences": None,
    "logger.parity_max_gen_kl": None,
    "logger.parity_max_gen_kl_ratio": None,
}


@cache
def renamed() -> dict[str, str]:
    """Inflight key -> the NeMo-RL key a ``Rename`` rule maps onto it, read as for a Megatron recipe (a ``When``
    takes its Megatron branch); a key that is itself a NeMo-RL key of the same meaning keeps its own name."""
    from services.recipe.nemo_rl.rules import Rename, Source, pick_rule
    from services.recipe.nemo_rl.table import TABLE

    megatron = Source({"policy": {"megatron_cfg": {"enabled": True}, "dtensor_cfg": {"enabled": False}}})
    out: dict[str, str] = {}
    for path, rule in TABLE.items():
        picked = pick_rule(rule, megatron)
        if "*" in path or not isinstance(picked, Rename) or picked.target == path:
            continue
        if picked.target in TABLE and pick_rule(TABLE[picked.target], megatron) is None:
            continue  # kept under its own name, e.g. optimizer.weight_decay (scheduler.end_weight_decay equals it)
        out.setdefault(picked.target, path)
    return out


def nemo_rl_name(key: str) -> str:
    """The NeMo-RL counterpart of ``key`` for the reference table: its path, or "—" (none)."""
    name = renamed().get(key) or NEMO_RL_NAMES.get(key, "—" if key.startswith("rollout_pool.") else SAME)
    if name is None or name == "—":
        return "—"
    return "same" if name in (SAME, key) else f"`{name}`"
