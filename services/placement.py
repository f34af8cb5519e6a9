"""How many GPUs each actor asks Ray for.

Separate pools (async): every engine takes ``tensor x pipeline`` whole GPUs
and every learner rank one GPU. Colocated (the sync baseline on one set of
GPUs): an engine and a learner rank share a GPU, so each asks for half of it
(vLLM's ``gpu_memory_utilization`` leaves room for Megatron, and the engines
sleep while the learner trains). Colocation of multi-GPU engines is not
supported (a clear error says so). CPU runs ask for no GPU.
"""
from __future__ import annotations

COLOCATED_SHARE = 0.5


class PlacementError(ValueError):
    """The recipe's GPU layout cannot be placed on this cluster."""


def engine_gpus(recipe) -> float:
    if not recipe.cluster.gpus_per_node:
        return 0
    v = recipe.policy.generation.vllm_cfg
    per_engine = recipe.rollout_pool.gpus_per_engine or v.tensor_parallel_size * v.pipeline_parallel_size
    if recipe.policy.generation.colocated.enabled:
        if per_engine != 1:
            raise PlacementError(f"colocated generation with {per_engine} GPUs per engine is not supported; "
                                 f"use policy.generation.colocated.enabled=false or one GPU per engine")
        return COLOCATED_SHARE
    return per_engine


def learner_gpus_per_rank(recipe) -> float:
    if not recipe.cluster.gpus_per_node:
        return 0
    return COLOCATED_SHARE if recipe.policy.generation.colocated.enabled else 1


def check_learner_fits(recipe, cluster_gpus: float) -> None:
    """Fail fast (instead of an actor waiting forever for GPUs) when the learner cannot be placed."""
    need = max(1, recipe.learner_gpus) * learner_gpus_per_rank(recipe)
    if need > cluster_gpus:
        raise PlacementError(f"the learner needs {need:g} GPUs ({max(1, recipe.learner_gpus)} ranks) but the Ray "
                             f"cluster has {cluster_gpus:g}; check cluster.gpus_per_node and rollout_pool.learner_gpus")
