"""Where the pool's engines go: their GPU requests and, colocated, the colocation group the pool makes.

Separate pools: an engine takes ``k = tensor x pipeline`` whole GPUs of one
node (with ``rollout_pool.share_gpu``, half of the cluster's one GPU).
Colocated on GPUs: the pool reserves one whole-GPU bundle per cluster GPU
in a named, detached placement group (:func:`colocation_group`) that the
learner job attaching to it places its ranks in too; engine ``i`` owns slots
``k*i .. k*i+k-1`` (:func:`engine_options`). The slot math and the learner's
side are in :mod:`services.recipe.gpu_layout`; the whole picture is in
docs/architecture.md, "Placement".
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from services.recipe.gpu_layout import (
    COLOCATED_SHARE,
    PlacementError,
    bundle_nodes,
    colocation_bundles,
    gpu_slots,
    in_bundle,
    pool_gpus_per_engine,
    slots_by_node,
)

if TYPE_CHECKING:
    from services.recipe.config import Recipe

GROUP_READY_TIMEOUT_S = 120.0
"""How long the pool waits for the cluster to grant the colocation group's GPUs."""
FREE_GRACE_S = 10.0
"""How long a new colocation group waits for GPUs being released (a pool just removed) before it fails."""
BUNDLE_INDICES_ENV = "VLLM_RAY_BUNDLE_INDICES"
"""vLLM's Ray executor puts worker ``r`` on the ``r``-th bundle named here (of the actor's placement group)."""
PER_WORKER_GPUS_ENV = "VLLM_RAY_PER_WORKER_GPUS"
"""GPUs each of vLLM's Ray workers asks for (default 1)."""


def engine_gpus(recipe: Recipe) -> float:
    """GPUs the engine *actor* asks for: 0 on CPU, ``k`` whole ones apart from the learner (half of the one GPU
    with ``rollout_pool.share_gpu``, the learner's rank asks for the other half), half of its one slot
    colocated with ``k = 1``, none colocated with ``k > 1`` (its vLLM workers hold the GPU shares)."""
    if not recipe.cluster.gpus_per_node:
        return 0
    if recipe.policy.generation.colocated.enabled:
        return COLOCATED_SHARE if recipe.gpus_per_engine == 1 else 0
    return pool_gpus_per_engine(recipe)


def colocation_group_name(pool_name: str) -> str:
    return f"{pool_name}-colocated"


def colocation_group(recipe: Recipe, pool_name: str, timeout_s: float = GROUP_READY_TIMEOUT_S) -> Any:
    """The pool's colocation placement group, made if it does not exist yet (a restarted pool replica finds
    its own); None when the recipe needs none. Raises :class:`PlacementError` at once when the cluster has
    fewer GPUs in all, after a few seconds when fewer are free (:func:`check_group_fits`), after ``timeout_s``
    when they are not granted, and when an engine's slots were granted on more than one node (a group made
    here is removed again)."""
    import ray
    from ray.util import placement_group, remove_placement_group
    from ray.util.placement_group import get_placement_group

    n = colocation_bundles(recipe)
    if not n:
        return None
    name = colocation_group_name(pool_name)
    try:
        group, made = get_placement_group(name), False
    except ValueError:
        check_group_fits(recipe, name, n)
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


def check_group_fits(recipe: Recipe, name: str, n: int, grace_s: float = FREE_GRACE_S) -> None:
    """A new colocation group of ``n`` whole GPUs: fail at once when the cluster has fewer in all, after
    ``grace_s`` when fewer are free (another pool's group or other actors hold them)."""
    import time

    import ray

    need = (f"colocation placement group {name!r} needs {n} whole GPUs (cluster.num_nodes x cluster.gpus_per_node "
            f"= {recipe.cluster.num_nodes} x {recipe.cluster.gpus_per_node})")
    total = ray.cluster_resources().get("GPU", 0)
    if total < n:
        raise PlacementError(f"{need}; the Ray cluster has {total:g} in all: set cluster.gpus_per_node (and "
                             f"rollout_pool.num_engines) to the GPUs the nodes have")
    deadline = time.monotonic() + grace_s
    while (free := ray.available_resources().get("GPU", 0)) < n and time.monotonic() < deadline:
        time.sleep(0.5)
    if free < n:
        raise PlacementError(f"{need}; {free:g} of the Ray cluster's {total:g} GPUs are free (other actors or "
                             f"placement groups hold {total - free:g}; `ray status` lists them): stop what holds "
                             f"them or lay the recipe out on fewer GPUs")


def check_engine_slots(recipe: Recipe, nodes: Mapping[int, str]) -> None:
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


def engine_bundles(recipe: Recipe, index: int, group: Any) -> list[int]:
    """Bundles of the colocation group engine ``index`` owns: slots ``k*index .. k*index+k-1``."""
    k, slots = recipe.gpus_per_engine, gpu_slots(group)
    mine = slots[k * index:k * index + k]
    if len(mine) != k:
        raise PlacementError(f"engine {index} needs colocation slots {k * index}..{k * index + k - 1}; the "
                             f"group has {len(slots)}")
    return mine


def engine_options(recipe: Recipe, index: int, group: Any, env: Mapping[str, str] | None = None) -> dict:
    """Ray actor options of engine ``index``: its GPUs, colocated its first bundle and (``k > 1``) the
    environment that puts its vLLM workers on its other bundles; ``env`` is merged into ``runtime_env``."""
    env_vars = dict(env or {})
    options: dict = {"num_gpus": engine_gpus(recipe)}
    if group is None and recipe.cluster.engine_resources:
        options["resources"] = dict(recipe.cluster.engine_resources)
    if group is not None:
        mine = engine_bundles(recipe, index, group)
        options["scheduling_strategy"] = in_bundle(group, mine[0])
        if len(mine) > 1:
            env_vars.update({BUNDLE_INDICES_ENV: ",".join(map(str, mine)), PER_WORKER_GPUS_ENV: str(COLOCATED_SHARE)})
    if env_vars:
        options["runtime_env"] = {"env_vars": env_vars}
    return options
