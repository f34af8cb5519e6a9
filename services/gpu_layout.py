"""The recipe's GPU layout: what can be placed (checked at load) and the placement both wings share.

:func:`check_gpu_layout` is called by :class:`services.config.Recipe`'s validator;
every message starts with the key path to change. CPU recipes
(``cluster.gpus_per_node: 0``) have no layout. The rest is what the pool
(:mod:`services.pool.placement`) and the learner job both need: GPU shares per
learner rank, the colocation group's size, its GPU *slots* (bundles node by
node) and a learner rank's Ray options. How colocation works:
docs/architecture.md, "Placement".
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.config import Recipe

COLOCATED_SHARE = 0.5
"""The share of a GPU a colocated engine worker and a colocated learner rank each ask for."""


class PlacementError(ValueError):
    """The recipe's GPU layout cannot be placed on this cluster."""


def colocated_on_gpus(recipe: Recipe) -> bool:
    return bool(recipe.cluster.gpus_per_node) and recipe.policy.generation.colocated.enabled


def learner_gpus_per_rank(recipe: Recipe) -> float:
    if not recipe.cluster.gpus_per_node:
        return 0
    return COLOCATED_SHARE if recipe.policy.generation.colocated.enabled else 1


def check_learner_fits(recipe: Recipe, cluster_gpus: float) -> None:
    """Fail fast (instead of an actor waiting forever for GPUs) when the learner cannot be placed."""
    need = max(1, recipe.learner_gpus) * learner_gpus_per_rank(recipe)
    if need > cluster_gpus:
        raise PlacementError(f"the learner needs {need:g} GPUs ({max(1, recipe.learner_gpus)} ranks) but the Ray "
                             f"cluster has {cluster_gpus:g}; check cluster.gpus_per_node and rollout_pool.learner_gpus")


def colocation_bundles(recipe: Recipe) -> int:
    """Whole-GPU bundles a colocated pool reserves (every cluster GPU); 0 when not colocated on GPUs."""
    return recipe.cluster.num_nodes * recipe.cluster.gpus_per_node if colocated_on_gpus(recipe) else 0


def bundle_nodes(group: Any) -> dict[int, str]:
    """Node id of each bundle of a granted placement group."""
    import ray

    nodes = ray.util.placement_group_table(group).get("bundles_to_node_id") or {}
    if len(nodes) != len(group.bundle_specs):
        raise PlacementError(f"placement group {group.id.hex()} is not granted yet ({len(nodes)} of "
                             f"{len(group.bundle_specs)} bundles placed)")
    return {int(b): n for b, n in nodes.items()}


def slots_by_node(nodes: Mapping[int, str]) -> list[int]:
    """Bundle indices node by node (nodes in the order of their lowest bundle, bundles ascending within one):
    slot ``s`` of the colocation group is bundle ``slots_by_node(...)[s]``."""
    first: dict[str, int] = {}
    for b in sorted(nodes):
        first.setdefault(nodes[b], b)
    return sorted(nodes, key=lambda b: (first[nodes[b]], b))


def gpu_slots(group: Any) -> list[int]:
    """The colocation group's bundle indices in slot order (see :func:`slots_by_node`)."""
    return slots_by_node(bundle_nodes(group))


def in_bundle(group: Any, bundle: int) -> Any:
    """The scheduling strategy that puts an actor on ``bundle`` of ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)


def learner_options(recipe: Recipe, rank: int, group: Any) -> dict:
    """Ray actor options of learner rank ``rank``: its GPUs and, colocated, its slot's bundle."""
    options: dict = {"num_gpus": learner_gpus_per_rank(recipe)}
    if group is None and recipe.cluster.learner_resources:
        options["resources"] = dict(recipe.cluster.learner_resources)
    if group is not None:
        slots = gpu_slots(group)
        if rank >= len(slots):
            raise PlacementError(f"learner rank {rank} has no colocation slot (the group has {len(slots)})")
        options["scheduling_strategy"] = in_bundle(group, slots[rank])
    return options


def check_gpu_layout(recipe: Recipe) -> None:
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


def _check_colocated(recipe: Recipe, k: int, pool: int, total: int) -> int:
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
