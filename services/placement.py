"""How many GPUs each actor asks Ray for.

Separate pools (async): every engine takes ``tensor x pipeline`` whole GPUs
and every learner rank one GPU. Colocated (the sync baseline on one set of
GPUs): an engine and a learner rank share a GPU, so each asks for half of it
(vLLM's ``gpu_memory_utilization`` leaves room for Megatron, and the engines
sleep while the learner trains). Colocation of multi-GPU engines is not
supported (a clear error says so). CPU runs ask for no GPU.

Half-GPU requests alone do not say *which* halves go together: Ray packs
fractional requests, so two engines would share GPU 0 and two learner ranks
GPU 1 -- and NCCL refuses two ranks of one group on one GPU. A colocated pool
on GPUs therefore reserves one whole-GPU bundle per cluster GPU in a named,
detached placement group (:func:`colocation_group`, made by the pool and
handed to the learner job that attaches to it); engine ``i`` and learner rank
``i`` both ask for half of bundle ``i`` (:func:`engine_options`,
:func:`learner_options`). Ray restarts a dead engine in its own bundle.
"""
from __future__ import annotations

COLOCATED_SHARE = 0.5
GROUP_READY_TIMEOUT_S = 120.0
"""How long the pool waits for the cluster to grant the colocation group's GPUs."""


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


def colocation_bundles(recipe) -> int:
    """Whole-GPU bundles a colocated pool reserves (every cluster GPU); 0 when not colocated on GPUs."""
    if not recipe.cluster.gpus_per_node or not recipe.policy.generation.colocated.enabled:
        return 0
    return recipe.cluster.num_nodes * recipe.cluster.gpus_per_node


def colocation_group_name(pool_name: str) -> str:
    return f"{pool_name}-colocated"


def colocation_group(recipe, pool_name: str, timeout_s: float = GROUP_READY_TIMEOUT_S):
    """The pool's colocation placement group, made if it does not exist yet (a restarted pool replica finds
    its own); None when the recipe needs none. Waits until the cluster grants its GPUs, else raises
    :class:`PlacementError` after ``timeout_s`` (a group made here is removed again)."""
    import ray
    from ray.util import placement_group, remove_placement_group

    n = colocation_bundles(recipe)
    if not n:
        return None
    name = colocation_group_name(pool_name)
    made = False
    try:
        group = ray.util.get_placement_group(name)
    except ValueError:
        group, made = placement_group([{"GPU": 1.0}] * n, strategy="PACK", name=name, lifetime="detached"), True
    if len(group.bundle_specs) != n:
        raise PlacementError(f"colocation placement group {name!r} has {len(group.bundle_specs)} GPU bundles; "
                             f"this recipe needs {n} (cluster.num_nodes x cluster.gpus_per_node)")
    if not group.wait(timeout_s):
        if made:
            remove_placement_group(group)
        raise PlacementError(f"the cluster did not grant colocation placement group {name!r} ({n} whole GPUs) "
                             f"within {timeout_s:g} s; free GPUs: {ray.available_resources().get('GPU', 0):g}")
    return group


def _options(gpus: float, group, index: int) -> dict:
    if group is None:
        return {"num_gpus": gpus}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_gpus": gpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)}


def engine_options(recipe, index: int, group) -> dict:
    """Ray actor options (GPUs and, colocated, the bundle) of engine ``index``."""
    return _options(engine_gpus(recipe), group, index)


def learner_options(recipe, rank: int, group) -> dict:
    """Ray actor options (GPUs and, colocated, the bundle) of learner rank ``rank``."""
    return _options(learner_gpus_per_rank(recipe), group, rank)
