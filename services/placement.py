"""How many GPUs each actor asks Ray for, and where it goes.

Separate pools (async): every engine takes ``k = tensor x pipeline`` whole GPUs
of one node (vLLM's own worker processes inside the actor) and every learner
rank one GPU. CPU runs ask for no GPU.

Colocated (the sync baseline on one set of GPUs): every cluster GPU holds one
engine worker and one learner rank, each asking for half of it (vLLM's
``gpu_memory_utilization`` leaves room for Megatron, and the engines sleep
while the learner trains). Half-GPU requests alone do not say *which* halves
go together: Ray packs fractional requests, so two engines would share GPU 0
and two learner ranks GPU 1 -- and NCCL refuses two ranks of one group on one
GPU. A colocated pool on GPUs therefore reserves one whole-GPU bundle per
cluster GPU in a named, detached placement group (:func:`colocation_group`,
made by the pool and handed to the learner job that attaches to it). Its
bundles ordered node by node are the cluster's GPU *slots* (:func:`gpu_slots`):
learner rank ``j`` takes half of slot ``j``; engine ``i`` owns slots
``k*i .. k*i+k-1``, all on one node (:func:`engine_options`,
:func:`learner_options`). With ``k = 1`` the engine actor takes half of its
slot and runs vLLM in process. With ``k > 1`` the actor asks for no GPU and is
placed on its first slot; vLLM, finding itself in a placement group, picks its
Ray executor and starts its ``k`` TP/PP workers on exactly the engine's slots,
half a GPU each (``VLLM_RAY_BUNDLE_INDICES``, ``VLLM_RAY_PER_WORKER_GPUS`` in
the actor's environment). Ray restarts a dead engine in its own bundles.
"""
from __future__ import annotations

from collections.abc import Mapping

COLOCATED_SHARE = 0.5
GROUP_READY_TIMEOUT_S = 120.0
"""How long the pool waits for the cluster to grant the colocation group's GPUs."""
BUNDLE_INDICES_ENV = "VLLM_RAY_BUNDLE_INDICES"
"""vLLM's Ray executor puts worker ``r`` on the ``r``-th bundle named here (of the actor's placement group)."""
PER_WORKER_GPUS_ENV = "VLLM_RAY_PER_WORKER_GPUS"
"""GPUs each of vLLM's Ray workers asks for (default 1)."""


class PlacementError(ValueError):
    """The recipe's GPU layout cannot be placed on this cluster."""


def _colocated_on_gpus(recipe) -> bool:
    return bool(recipe.cluster.gpus_per_node) and recipe.policy.generation.colocated.enabled


def engine_gpus(recipe) -> float:
    """GPUs the engine *actor* asks for: 0 on CPU, ``k`` whole ones apart from the learner, half of its one
    slot colocated with ``k = 1``, none colocated with ``k > 1`` (its vLLM workers hold the GPU shares)."""
    if not recipe.cluster.gpus_per_node:
        return 0
    if recipe.policy.generation.colocated.enabled:
        return COLOCATED_SHARE if recipe.gpus_per_engine == 1 else 0
    return recipe.gpus_per_engine


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
    return recipe.cluster.num_nodes * recipe.cluster.gpus_per_node if _colocated_on_gpus(recipe) else 0


def colocation_group_name(pool_name: str) -> str:
    return f"{pool_name}-colocated"


def colocation_group(recipe, pool_name: str, timeout_s: float = GROUP_READY_TIMEOUT_S):
    """The pool's colocation placement group, made if it does not exist yet (a restarted pool replica finds
    its own); None when the recipe needs none. Raises :class:`PlacementError` at once when the cluster has
    fewer GPUs in all, after ``timeout_s`` when they are not granted, and when an engine's slots were granted
    on more than one node (a group made here is removed again)."""
    import ray
    from ray.util import placement_group, remove_placement_group

    n = colocation_bundles(recipe)
    if not n:
        return None
    name = colocation_group_name(pool_name)
    try:
        group, made = ray.util.get_placement_group(name), False
    except ValueError:
        have = ray.cluster_resources().get("GPU", 0)
        if have < n:
            raise PlacementError(f"colocation placement group {name!r} needs {n} whole GPUs (cluster.num_nodes x "
                                 f"cluster.gpus_per_node = {recipe.cluster.num_nodes} x "
                                 f"{recipe.cluster.gpus_per_node}); the Ray cluster has {have:g} in all") from None
        group, made = placement_group([{"GPU": 1.0}] * n, strategy="PACK", name=name, lifetime="detached"), True
    try:
        if len(group.bundle_specs) != n:
            raise PlacementError(f"colocation placement group {name!r} has {len(group.bundle_specs)} GPU bundles; "
                                 f"this recipe needs {n} (cluster.num_nodes x cluster.gpus_per_node)")
        if not group.wait(timeout_s):
            raise PlacementError(f"the cluster did not grant colocation placement group {name!r} ({n} whole GPUs) "
                                 f"within {timeout_s:g} s; free GPUs: {ray.available_resources().get('GPU', 0):g}")
        check_engine_slots(recipe, bundle_nodes(group))
    except PlacementError:
        if made:
            remove_placement_group(group)
        raise
    return group


def bundle_nodes(group) -> dict[int, str]:
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


def check_engine_slots(recipe, nodes: Mapping[int, str]) -> None:
    """Every engine's ``k`` slots must lie on one node (vLLM's TP/PP workers of one engine talk over NVLink)."""
    k, slots = recipe.gpus_per_engine, slots_by_node(nodes)
    for i in range(recipe.rollout_pool.num_engines):
        mine = slots[k * i:k * i + k]
        if len(mine) < k:
            raise PlacementError(f"engine {i} needs colocation slots {k * i}..{k * i + k - 1}; the group has "
                                 f"{len(slots)} (rollout_pool.num_engines x GPUs per engine > cluster GPUs)")
        if len({nodes[b] for b in mine}) > 1:
            per_node: dict[str, int] = {}
            for n in nodes.values():
                per_node[n] = per_node.get(n, 0) + 1
            raise PlacementError(f"engine {i}'s {k} GPUs (colocation bundles {mine}) were granted on "
                                 f"{len({nodes[b] for b in mine})} nodes; the group holds "
                                 f"{sorted(per_node.values(), reverse=True)} GPUs per node, and each node must "
                                 f"hold a multiple of {k} (give the pool whole nodes of cluster.gpus_per_node)")


def gpu_slots(group) -> list[int]:
    """The colocation group's bundle indices in slot order (see :func:`slots_by_node`)."""
    return slots_by_node(bundle_nodes(group))


def _in_bundle(group, bundle: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)


def engine_bundles(recipe, index: int, group) -> list[int]:
    """Bundles of the colocation group engine ``index`` owns: slots ``k*index .. k*index+k-1``."""
    k, slots = recipe.gpus_per_engine, gpu_slots(group)
    mine = slots[k * index:k * index + k]
    if len(mine) != k:
        raise PlacementError(f"engine {index} needs colocation slots {k * index}..{k * index + k - 1}; the "
                             f"group has {len(slots)}")
    return mine


def engine_options(recipe, index: int, group, env: Mapping[str, str] | None = None) -> dict:
    """Ray actor options of engine ``index``: its GPUs, colocated its first bundle and (``k > 1``) the
    environment that puts its vLLM workers on its other bundles; ``env`` is merged into ``runtime_env``."""
    env_vars = dict(env or {})
    options: dict = {"num_gpus": engine_gpus(recipe)}
    if group is None and recipe.cluster.engine_resources:
        options["resources"] = dict(recipe.cluster.engine_resources)
    if group is not None:
        mine = engine_bundles(recipe, index, group)
        options["scheduling_strategy"] = _in_bundle(group, mine[0])
        if len(mine) > 1:
            env_vars.update({BUNDLE_INDICES_ENV: ",".join(map(str, mine)), PER_WORKER_GPUS_ENV: str(COLOCATED_SHARE)})
    if env_vars:
        options["runtime_env"] = {"env_vars": env_vars}
    return options


def learner_options(recipe, rank: int, group) -> dict:
    """Ray actor options of learner rank ``rank``: its GPUs and, colocated, its slot's bundle."""
    options: dict = {"num_gpus": learner_gpus_per_rank(recipe)}
    if group is None and recipe.cluster.learner_resources:
        options["resources"] = dict(recipe.cluster.learner_resources)
    if group is not None:
        slots = gpu_slots(group)
        if rank >= len(slots):
            raise PlacementError(f"learner rank {rank} has no colocation slot (the group has {len(slots)})")
        options["scheduling_strategy"] = _in_bundle(group, slots[rank])
    return options
