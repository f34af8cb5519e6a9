"""The recipe's GPU layout rules: what :mod:`services.placement` can place, checked at load.

Called by :class:`services.config.Recipe`'s validator; every message starts with
the key path to change. CPU recipes (``cluster.gpus_per_node: 0``) have no layout.
"""
from __future__ import annotations


def check_gpu_layout(recipe) -> None:
    """Raise ``ValueError`` naming the key when the recipe's engines and learner cannot be placed on
    ``cluster.num_nodes x cluster.gpus_per_node`` GPUs."""
    c, pool_cfg = recipe.cluster, recipe.rollout_pool
    total = c.num_nodes * c.gpus_per_node
    if total == 0:
        return
    v, m = recipe.policy.generation.vllm_cfg, recipe.policy.megatron_cfg
    k, n = recipe.gpus_per_engine, pool_cfg.num_engines
    if v.expert_parallel_size > k:
        raise ValueError(f"policy.generation.vllm_cfg.expert_parallel_size ({v.expert_parallel_size}) must be "
                         f"<= GPUs per engine ({k})")
    if k > c.gpus_per_node:
        raise ValueError(f"policy.generation.vllm_cfg: an engine takes tensor_parallel_size x pipeline_parallel_size "
                         f"= {k} GPUs, more than cluster.gpus_per_node ({c.gpus_per_node}); an engine's GPUs must "
                         f"be on one node")
    pool = n * k
    if recipe.policy.generation.colocated.enabled:
        learner = _check_colocated(recipe, k, pool, total)
    else:
        learner = pool_cfg.learner_gpus if pool_cfg.learner_gpus is not None else total - pool
        if learner + pool != total:
            raise ValueError(f"cluster: learner GPUs ({learner}) + rollout GPUs ({pool} = {n} engines x {k}) must "
                             f"equal num_nodes x gpus_per_node ({total})")
        if learner <= 0:
            raise ValueError(f"cluster: no GPUs left for the learner ({total} total, {pool} for the pool)")
    fit = c.num_nodes * (c.gpus_per_node // k)
    if n > fit:
        raise ValueError(f"rollout_pool.num_engines ({n}): engines of {k} GPUs each on one node fit {fit} times "
                         f"on cluster.num_nodes x cluster.gpus_per_node = {c.num_nodes} x {c.gpus_per_node}")
    mp = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    if learner % mp:
        raise ValueError(f"policy.megatron_cfg: learner GPUs ({learner}) not divisible by TP x PP ({mp})")
    dp = learner // mp
    if (dp * m.tensor_model_parallel_size) % m.expert_model_parallel_size:
        raise ValueError(f"policy.megatron_cfg.expert_model_parallel_size ({m.expert_model_parallel_size}) must "
                         f"divide DP x TP ({dp * m.tensor_model_parallel_size}) of the learner")


def _check_colocated(recipe, k: int, pool: int, total: int) -> int:
    """Colocated, every cluster GPU holds one engine worker and one learner rank; returns the learner's GPUs."""
    c, pool_cfg = recipe.cluster, recipe.rollout_pool
    if c.gpus_per_node % k:
        raise ValueError(f"policy.generation.vllm_cfg: colocated engines of tensor_parallel_size x "
                         f"pipeline_parallel_size = {k} GPUs must divide cluster.gpus_per_node ({c.gpus_per_node}) "
                         f"so that every GPU of a node holds one engine worker")
    if pool != total:
        raise ValueError(f"rollout_pool.num_engines: colocated, every GPU holds an engine worker and a learner rank, "
                         f"so num_engines x {k} GPUs per engine ({pool_cfg.num_engines} x {k} = {pool}) must equal "
                         f"the learner's ranks, cluster.num_nodes x cluster.gpus_per_node ({total})")
    if pool_cfg.learner_gpus is not None and pool_cfg.learner_gpus != total:
        raise ValueError(f"rollout_pool.learner_gpus ({pool_cfg.learner_gpus}): colocated, the learner has one rank "
                         f"per cluster GPU ({total}); leave it unset")
    return total
